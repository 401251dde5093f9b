"""Corpora as users keep them, through the real fetch and encode stages over a real store:
compressed files and archives (gzip, xz, zstd, zip), a folder with a filter, and downloads
from a real HTTP server on 127.0.0.1 that drops the connection midway (resumed with a Range
request), an enwik8-style zip among them."""

import gzip
import hashlib
import http.server
import lzma
import threading
import time
import zipfile

import numpy as np
import pytest

from bardflow.artifacts.store import Store
from bardflow.config.settings import DataConfig, build_config
from bardflow.flows import ui
from bardflow.model.data.splits import encode, read_split
from bardflow.tasks.corpus_identity import pin
from bardflow.tasks.fetch import CORPUS, FetchError
from bardflow.tasks.registry import ENCODE, FETCH
from tests.helpers import md5_bytes, play_text
from tests.test_stages import make


class FlakyFiles:
    """Serves ``files`` (name -> bytes) on 127.0.0.1 with Range requests, and cuts the first
    answer for each file off after ``cut`` bytes, as a dropped connection would."""

    def __init__(self, files: dict[str, bytes], cut: int):
        self.requests: list[tuple[str, str | None]] = []
        served, requests, dropped = files, self.requests, set()

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self):
                name = self.path.lstrip("/")
                requests.append((name, self.headers.get("Range")))
                if name not in served:
                    self.send_error(404)
                    return
                data, start = served[name], 0
                if self.headers.get("Range"):
                    start = int(self.headers["Range"].removeprefix("bytes=").split("-")[0])
                    self.send_response(206)
                    self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
                else:
                    self.send_response(200)
                self.send_header("Content-Length", str(len(data) - start))
                self.end_headers()
                if name not in dropped:  # the first answer stops short and the connection closes
                    dropped.add(name)
                    self.wfile.write(data[start : start + cut])
                    self.close_connection = True
                    return
                self.wfile.write(data[start:])

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _zip(name: str, data: bytes) -> bytes:
    import io

    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        archive.writestr(name, data)
    return buffer.getvalue()


def test_downloads_resume_after_a_dropped_connection_and_an_archive_is_read_as_its_member(tmp_path):
    text = play_text(300_000)
    archive = _zip("enwik8", text)  # enwik8.zip's layout: one member, enwik8
    served = FlakyFiles({"corpus.txt": text, "enwik8.zip": archive}, cut=20_000)
    try:
        store = tmp_path / "store"
        plain = make(FETCH, DataConfig(corpus=f"{served.url}/corpus.txt", md5=md5_bytes(text)), store)[0]
        # Checked by the md5 of what it holds (enwik8's published md5 is its member's); another
        # store, as the same text is already a version in this one.
        zipped = make(FETCH, DataConfig(corpus=f"{served.url}/enwik8.zip", md5=md5_bytes(text)), tmp_path / "z")[0]
    finally:
        served.close()
    # Each was cut off once and resumed where it stopped, not downloaded again.
    assert len(archive) > 40_000 and served.requests == [
        ("corpus.txt", None),
        ("corpus.txt", "bytes=20000-"),
        ("enwik8.zip", None),
        ("enwik8.zip", "bytes=20000-"),
    ]
    for version in (plain, zipped):
        assert version.file(CORPUS).read_bytes() == text
        assert version.metrics["sha256"] == hashlib.sha256(text).hexdigest()
        assert version.metrics["distinct_bytes"] == len(set(text))
    assert zipped.metrics["md5"] == md5_bytes(text)
    assert not list(zipped.path.glob(".download-*"))
    # A wrong checksum is still caught, after the resumed download.
    with pytest.raises(FetchError, match="md5 mismatch"):
        served = FlakyFiles({"corpus.txt": text}, cut=50_000)
        try:
            make(FETCH, DataConfig(corpus=f"{served.url}/corpus.txt", md5="0" * 32), tmp_path / "other")
        finally:
            served.close()


def test_compressed_files_are_their_text_and_a_filtered_folder_is_one_corpus(tmp_path):
    text = play_text(120_000)
    sources = {"c.txt.gz": gzip.compress(text), "c.txt.xz": lzma.compress(text), "c.zip": _zip("c.txt", text)}
    try:
        import zstandard

        sources["c.txt.zst"] = zstandard.ZstdCompressor().compress(text)
    except ImportError:
        pass
    store = tmp_path / "store"
    built = []
    for name, data in sources.items():
        (tmp_path / name).write_bytes(data)
        data_config = pin(DataConfig(corpus=str(tmp_path / name)))
        assert data_config.md5 == md5_bytes(text), name  # the corpus's checksum, whatever holds it
        version, was_built = make(FETCH, data_config, store)
        assert version.file(CORPUS).read_bytes() == text, name
        built.append(was_built)
    assert built == [True] + [False] * (len(sources) - 1)  # the same text compressed another way: cached

    folder = tmp_path / "docs"
    (folder / "deep" / "er").mkdir(parents=True)
    (folder / "a.md").write_bytes(text[:50_000])
    packed = gzip.compress(text[50_000:], mtime=0)  # its header holds a time: this one, both times
    (folder / "deep" / "er" / "b.md").write_bytes(packed)  # a match, compressed or not
    (folder / "notes.txt").write_bytes(b"not this")
    chosen = pin(DataConfig(corpus=str(folder), glob="**/*.md"))
    version = make(FETCH, chosen, store)[0]
    assert version.manifest["source_files"] == 2
    # b.md is gzip-compressed but named .md: it is read as the bytes it is.
    assert version.file(CORPUS).read_bytes() == text[:50_000] + packed
    assert pin(DataConfig(corpus=str(folder))).md5 == md5_bytes(b"not this")  # default: .txt files
    with pytest.raises(FetchError, match=r"holds no files matching data.glob='\*\*/\*.rst'.*--set data.glob="):
        pin(DataConfig(corpus=str(folder), glob="**/*.rst"))

    (tmp_path / "zeros.bin").write_bytes(bytes(100_000))  # not text: bytes are bytes, and it says so
    zeros = make(FETCH, pin(DataConfig(corpus=str(tmp_path / "zeros.bin"))), store)[0]
    assert zeros.metrics["distinct_bytes"] == 1 and zeros.metrics["bytes"] == 100_000

    (tmp_path / "bad.txt.gz").write_bytes(gzip.compress(text)[:-100])  # cut short
    with pytest.raises(FetchError, match=r"bad.txt.gz could not be read as a .gz file .* fetch it again"):
        make(FETCH, pin(DataConfig(corpus=str(tmp_path / "bad.txt.gz"))), store)


def _logged_progress(
    stage: str, total: int, reports: list[tuple[int, float]], in_bytes: bool = False, started: float | None = None
) -> list[str]:
    """The lines a bar made at second ``started`` (the first report's, by default) logs without
    a terminal for ``reports`` (done, at that second)."""
    import logging

    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logger = logging.getLogger("bardflow")
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.INFO)  # not .level: the logger keeps a cache of what it lets through
    now = [reports[0][1] if started is None else started]
    try:
        with ui.Progress(stage, total, stage, in_bytes=in_bytes, clock=lambda: now[0]) as progress:
            for done, seconds in reports:
                now[0] = seconds
                progress(done)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    return lines


def test_without_a_terminal_a_long_copy_logs_its_bytes_speed_and_time_left():
    """A worker's log has no bar: fetch and encode say MB, MB/s and an ETA every 10 %, the
    ETA at the pace since the first report (a slow start does not stretch it)."""
    reports = [(20_000_000, 4.0), (25_000_000, 5.0), (80_000_000, 10.0), (100_000_000, 12.0)]
    lines = _logged_progress("fetch", 100_000_000, reports, in_bytes=True, started=0.0)
    assert lines == [
        "fetch: 20.0 of 100.0 MB (20%), 5.0 MB/s, ETA 16 s",  # 25 MB: still 20 %, not said
        "fetch: 80.0 of 100.0 MB (80%), 8.0 MB/s, ETA 2 s",  # 60 MB in the 6 s since 20
        "fetch: 100.0 of 100.0 MB (100%), 8.3 MB/s, done",
    ]
    assert [ui.time_left(s) for s in (0.2, 59.6, 185)] == ["ETA 0 s", "ETA 1 min 00 s", "ETA 3 min 05 s"]


def test_a_local_corpus_is_read_once_for_its_figures_and_its_copy_checked_by_sha256(tmp_path, monkeypatch):
    from bardflow.tasks import fetch as fetch_module

    text = play_text(50_000)
    source = tmp_path / "corpus.txt"
    source.write_bytes(text)
    pinned = pin(DataConfig(corpus=str(source)))
    full = []  # the digests fetch makes that take an md5 and the byte values again
    real = fetch_module.Digest
    monkeypatch.setattr(
        fetch_module, "Digest", lambda sha256_only=False: full.append(not sha256_only) or real(sha256_only)
    )
    version = make(FETCH, pinned, tmp_path / "store")[0]
    assert full == [False] and version.file(CORPUS).read_bytes() == text
    figures = version.metrics
    assert (figures["md5"], figures["sha256"]) == (md5_bytes(text), hashlib.sha256(text).hexdigest())
    assert figures["distinct_bytes"] == len(set(text)) and figures["bytes"] == len(text)

    # Changed between the run's checksum and the copy, at the same size: refused, nothing stored.
    source.write_bytes(text[::-1])
    changed = pin(DataConfig(corpus=str(source)))
    source.write_bytes(text[::-1].swapcase())
    with pytest.raises(FetchError, match="changed since its md5 was taken.*run again"):
        make(FETCH, changed, tmp_path / "store")
    assert [v.key for v in Store(tmp_path / "store").versions("fetch")] == [version.key]


def test_encode_streams_bounded_shards_with_the_rows_of_the_in_memory_encoding(tmp_path, monkeypatch):
    from bardflow.model.data import splits as data_module

    text = play_text(200_000)
    (tmp_path / "corpus.txt").write_bytes(text)
    cfg = build_config("tiny", {"data.every_position": True})
    corpus = make(FETCH, pin(cfg.data.model_copy(update={"corpus": str(tmp_path / "corpus.txt")})), tmp_path / "s")[0]
    monkeypatch.setattr(data_module, "SHARD_BYTES", 40_000)  # several shards of a small corpus
    version = make(ENCODE, cfg.data, tmp_path / "s", fetch=corpus)[0]
    shards = version.manifest["shards"]
    assert len(shards["train"]) > 3 and len(shards["val"]) >= 1
    for split, listed in shards.items():
        for shard in listed:  # the manifest's own file entries are the digests taken while writing
            assert version.manifest["files"][f"{split}/{shard['file']}"]["sha256"] == shard["sha256"]
            data = version.file(f"{split}/{shard['file']}").read_bytes()
            assert hashlib.sha256(data).hexdigest() == shard["sha256"]
    expected = encode(text, cfg.data.seq_len, cfg.data.train_fraction, cfg.data.shuffle_seed, every_position=True)
    np.testing.assert_array_equal(np.asarray(read_split(version.file("train"))), expected.train)
    np.testing.assert_array_equal(np.asarray(read_split(version.file("val"))), expected.val)
    assert version.metrics["train_sequences"] == sum(s["rows"] for s in shards["train"]) == len(expected.train)


def test_a_bucket_prefix_is_a_corpus_like_a_folder(tmp_path, object_server, monkeypatch):
    for name, value in object_server.env.items():
        monkeypatch.setenv(name, value)
    text = play_text(90_000)
    prefix = object_server.prefix("corpus")
    fs = object_server.filesystem()
    objects = {
        "a.txt": text[:30_000],
        "deep/b.txt.gz": gzip.compress(text[30_000:]),
        "c.md": b"left out",
        ".hidden.txt": b"left out",
    }
    for name, data in objects.items():
        fs.pipe(f"{prefix.removeprefix('s3://')}/{name}", data)
    chosen = pin(DataConfig(corpus=prefix))
    assert chosen.md5 == md5_bytes(text)  # the text the objects hold, in key order
    version = make(FETCH, chosen, tmp_path / "store")[0]
    assert version.file(CORPUS).read_bytes() == text
    assert pin(DataConfig(corpus=prefix, glob="*.md")).md5 == md5_bytes(b"left out")
    with pytest.raises(FetchError, match=r"corpus prefix s3://.* holds no objects matching data.glob='\*.rst'"):
        pin(DataConfig(corpus=prefix, glob="*.rst"))


class Trickle:
    """A server on 127.0.0.1 that answers slowly, its status line and headers one byte at a
    time (``slow_headers``) or its body, a byte every ``every_s``; or that redirects every
    path but ``/moved.txt`` to ``redirect`` (``{self}``: its own address; ``{path}``: the path
    asked for), and serves ``/moved.txt`` at once."""

    def __init__(self, every_s: float, slow_headers: bool = False, redirect: str | None = None):
        self.requests: list[str] = []
        requests, server = self.requests, self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self):
                requests.append(self.path)
                if self.path == "/moved.txt":
                    self.send_response(200)
                    self.send_header("Content-Length", "12")
                    self.end_headers()
                    self.wfile.write(b"the corpus.\n")
                    return
                if redirect is not None:
                    self.send_response(302)
                    self.send_header("Location", redirect.format(self=server.url, path=self.path))
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                head = b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n"
                try:
                    if slow_headers:
                        for byte in head:
                            self.wfile.write(bytes([byte]))
                            self.wfile.flush()
                            time.sleep(every_s)
                    else:
                        self.wfile.write(head)
                    for _ in range(1000):
                        self.wfile.write(b"x")
                        self.wfile.flush()
                        time.sleep(every_s)
                except OSError:  # the client gave up: as it should
                    pass

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.mark.parametrize("slow_headers", [False, True], ids=["body", "headers"])
def test_a_server_that_trickles_bytes_is_given_up_on_and_retried_in_one_line(tmp_path, slow_headers):
    """A byte every 0.2 s: the 30 s per-read timeout never fires, so the transfer's rate is
    judged over a window (here 1 s, at least 100 bytes/s), headers or body."""
    from bardflow.model.data.download import download

    server = Trickle(0.2, slow_headers)
    try:
        started = time.monotonic()
        with pytest.raises(FetchError) as raised:
            download(f"{server.url}/corpus.txt", tmp_path / "x", attempts=2, stall_s=1.0, min_bytes_per_s=100)
        took = time.monotonic() - started
    finally:
        server.close()
    line = str(raised.value)
    assert "\n" not in line and line.startswith(
        f"could not download {server.url}/corpus.txt (slower than 100 "
        "bytes/s for 1 s) after 2 attempt(s); check the network"
    )
    assert len(server.requests) == 2 and took < 8, took


def test_redirects_stay_within_the_scheme_and_host_and_a_loop_is_one_line(tmp_path):
    """A redirect to another port of the host (another server) is refused, naming it, and
    that server is never asked; one within the same server is followed; a redirect loop
    ends in one line."""
    from bardflow.model.data.download import download

    other = Trickle(0)
    servers = [
        other,
        Trickle(0, redirect=other.url + "/moved.txt"),
        Trickle(0, redirect="{self}/moved.txt"),
        Trickle(0, redirect="{self}{path}x"),
    ]
    away, within, loop = servers[1:]
    try:
        with pytest.raises(
            FetchError,
            match=rf"{away.url}/corpus.txt redirects to {other.url}/moved.txt, another "
            r"scheme, host or port, which is not followed; if that is where the "
            r"corpus is, pass it with --corpus",
        ):
            download(f"{away.url}/corpus.txt", tmp_path / "x")
        assert other.requests == []
        assert download(f"{within.url}/corpus.txt", tmp_path / "y") == f"{within.url}/moved.txt"
        assert (tmp_path / "y").read_bytes() == b"the corpus.\n"
        with pytest.raises(FetchError) as raised:
            download(f"{loop.url}/a", tmp_path / "z")
        assert "\n" not in str(raised.value) and "infinite loop" in str(raised.value), str(raised.value)
    finally:
        for server in servers:
            server.close()


def test_a_resumed_training_s_first_progress_line_has_a_measured_pace():
    """Resumed at step 500 of 1,000, its first report used to say "ETA 4 s" (the time since
    the bar began over every step done, earlier sessions' too), then "ETA 42 s"."""
    lines = _logged_progress("train_single", 1000, [(501, 100.2), (550, 105.0), (600, 110.0)])
    assert lines == ["train_single: 600/1000 (60%), ETA 40 s"]  # 99 steps in 9.8 s since the first report


def test_progress_never_says_more_than_the_whole():
    """An archive's raw bytes overrun its member's size by its directory: Prefect refused the
    progress artifact's value ("Progress: 100.0033%"), and a line said more than 100 %."""
    lines = _logged_progress("fetch", 100_000_000, [(95_000_000, 4.0), (110_000_000, 5.0)], in_bytes=True, started=0.0)
    assert lines[-1].startswith("fetch: 100.0 of 100.0 MB (100%)"), lines
