"""Corpora as users keep them, through the real fetch and encode stages over a real store:
compressed files and archives (gzip, xz, zstd, zip), a folder with a filter, and downloads
from a real HTTP server on 127.0.0.1 that drops the connection midway (resumed with a Range
request), an enwik8-style zip among them."""

import gzip
import hashlib
import http.server
import json
import lzma
import threading
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest

from bardflow.artifacts.store import Store
from bardflow.config.settings import DataConfig, build_config
from bardflow.flows import ui
from bardflow.model.data.splits import encode, read_split
from bardflow.tasks import corpus_identity
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


def test_a_local_corpus_s_checksum_is_remembered_until_one_of_its_files_changes(tmp_path, monkeypatch):
    """A run whose stages are cached reads nothing of a local corpus: this machine keeps its
    figures by its files' stat. A changed file is read again; a record that lies is caught by
    fetch's sha256 and forgotten."""
    from bardflow.tasks import fetch as fetch_module

    monkeypatch.setenv("BARDFLOW_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(corpus_identity, "SETTLED_NS", 0)  # these files were written a moment ago
    text = play_text(60_000)
    folder = tmp_path / "plays"
    folder.mkdir()
    (folder / "a.txt").write_bytes(text[:20_000])
    (folder / "b.txt").write_bytes(text[20_000:])
    reads = []  # how many files each full read of the corpus took
    real = fetch_module.decoded_chunks
    for module in (fetch_module, corpus_identity):  # the stage's reads and the checksum's
        monkeypatch.setattr(
            module, "decoded_chunks", lambda files, progress=None: reads.append(len(files)) or real(files, progress)
        )

    def pinned(**options) -> DataConfig:
        return pin(DataConfig(corpus=str(folder)), **options)

    first = pinned()
    assert first.md5 == md5_bytes(text) and reads == [2]
    assert pinned() == first and reads == [2]  # remembered: nothing read
    version = make(FETCH, first, tmp_path / "store")[0]  # the copy still checked by its sha256
    assert reads == [2, 2] and version.file(CORPUS).read_bytes() == text
    assert (version.metrics["sha256"], version.metrics["distinct_bytes"]) == (
        hashlib.sha256(text).hexdigest(),
        len(set(text)),
    )
    assert pinned(remembered=False) == first and reads == [2, 2, 2]

    (folder / "b.txt").write_bytes(text[20_000:].swapcase())  # same size, other bytes
    changed = pinned()
    assert changed.md5 == md5_bytes(text[:20_000] + text[20_000:].swapcase()) and reads == [2, 2, 2, 2]
    assert pinned() == changed and len(reads) == 4

    monkeypatch.setattr(corpus_identity, "SETTLED_NS", 60 * 10**9)  # written within the clock's tick
    (folder / "a.txt").write_bytes(text[:20_000].swapcase())
    assert pinned() == pinned() and len(reads) == 6  # not remembered: read each time
    monkeypatch.setattr(corpus_identity, "SETTLED_NS", 0)

    # A record that lies (a file system whose times did not move): fetch finds other bytes,
    # refuses in one line, and the record is gone; the next run reads the corpus again. (A
    # record edited by hand is not believed at all: see the next test.)
    truth = pinned()
    record, _, key = corpus_identity._figures_file(folder, None, sorted(folder.iterdir()))
    lie = {**json.loads(record.read_text())["figures"], "md5": "0" * 32, "sha256": "0" * 64}
    record.write_text(json.dumps({"figures": lie, "seal": corpus_identity._seal(record.parent, key, lie)}))
    with pytest.raises(FetchError, match="changed since its md5 was taken"):
        make(FETCH, pinned(), tmp_path / "store")
    assert not record.exists() and pinned() == truth

    monkeypatch.setattr(corpus_identity, "KEPT_FIGURES", 2)  # the newest records are kept, no more
    for n in range(3):
        (folder / "a.txt").write_bytes(text[n:20_000])
        pinned()
    assert len(list(record.parent.glob("*.json"))) == 2


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


def test_a_stated_md5_or_a_record_never_hands_a_run_another_corpus_s_bytes(tmp_path, monkeypatch):
    """The store holds corpus Y. Corpus X with Y's md5 stated (a config file reused), or X's
    record on this machine edited to Y's md5 and figures: refused, or read again; a sealed
    record that names Y is caught by the cached version's own sha256 and forgotten."""
    import os

    from bardflow.tasks import fetch as fetch_module

    monkeypatch.setenv("BARDFLOW_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(corpus_identity, "SETTLED_NS", 0)
    store = tmp_path / "store"
    y_text, x_text = play_text(70_000, seed=1), play_text(50_000, seed=2)
    (tmp_path / "y.txt").write_bytes(y_text)
    (tmp_path / "x.txt").write_bytes(x_text)
    y = pin(DataConfig(corpus=str(tmp_path / "y.txt")))
    make(FETCH, y, store)
    x = str(tmp_path / "x.txt")

    with pytest.raises(
        FetchError,
        match=rf"md5 mismatch for {x}: expected {y.md5}, got {md5_bytes(x_text)}; fetch "
        rf"it again or fix the source, .* --set data.md5={md5_bytes(x_text)}$",
    ):
        pin(DataConfig(corpus=x, md5=y.md5))
    assert pin(DataConfig(corpus=x, md5=md5_bytes(x_text))).md5 == md5_bytes(x_text)  # stated rightly: fine
    gone = DataConfig(corpus=str(tmp_path / "gone.txt"), md5=y.md5)
    assert pin(gone) == gone  # nothing to contradict it: the stored corpus by its md5

    # X's record, edited to Y's figures with its file's times put back: not believed.
    def pinned() -> DataConfig:
        return pin(DataConfig(corpus=x))

    assert pinned().md5 == md5_bytes(x_text)
    record, _, key = corpus_identity._figures_file(Path(x), None, [Path(x)])
    y_figures = {
        "md5": y.md5,
        "sha256": hashlib.sha256(y_text).hexdigest(),
        "size": len(y_text),
        "seen": bytes(sorted(set(y_text))).hex(),
    }
    sealed = json.loads(record.read_text())
    times = os.stat(record)
    record.write_text(json.dumps({**sealed, "figures": y_figures}))
    os.utime(record, ns=(times.st_atime_ns, times.st_mtime_ns))
    reads = []
    real = fetch_module.decoded_chunks
    for module in (fetch_module, corpus_identity):  # the stage's reads and the checksum's
        monkeypatch.setattr(
            module, "decoded_chunks", lambda files, progress=None: reads.append(len(files)) or real(files, progress)
        )
    assert pinned().md5 == md5_bytes(x_text) and reads == [1]  # read again
    version, built = make(FETCH, pinned(), store)
    assert built and version.file(CORPUS).read_bytes() == x_text

    # Records sealed as this machine seals them (what a bug would write): one of Y's figures
    # whole is not X's size, so not believed; one with Y's md5 and X's other figures selects
    # the stored version of that md5, whose bytes are not X's: one line, and the record goes.
    def sealed_record(figures: dict) -> None:
        record.write_text(json.dumps({"figures": figures, "seal": corpus_identity._seal(record.parent, key, figures)}))

    sealed_record(y_figures)
    read_before = len(reads)
    assert pinned().md5 == md5_bytes(x_text) and len(reads) == read_before + 1
    sealed_record({**json.loads(record.read_text())["figures"], "md5": y.md5})
    lied = pinned()
    assert lied.md5 == y.md5
    with pytest.raises(
        FetchError,
        match=rf"the stored corpus with md5 {y.md5} \(\w+\) is not the one at {x} "
        r"\(70,000 bytes there, 50,000 here, other sha256\).*rerun to read",
    ):
        make(FETCH, lied, store)
    assert not record.exists() and pinned().md5 == md5_bytes(x_text)


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
