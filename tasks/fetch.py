"""Stage 1: fetch the corpus from an https URL, a file:// URL, a local path or a local
folder (one corpus: its files in sorted order), decompressing ``.gz``, ``.xz``, ``.zst`` and
``.zip`` sources as they stream, and check its md5. The version is keyed on the checksum
alone: the same bytes from a mirror, or compressed another way, are the same corpus.

A local corpus needs no checksum from the user: ``pin`` computes it when the run starts,
so the version is keyed as if it had been given; this machine remembers it for files whose
size, inode and times have not moved since (a run whose stages are cached reads nothing). A
download is checked against a known checksum: the default corpus's own, or the one the user
gives (``data.md5``). The checksum is of the corpus, the text a compressed source holds
(the one its publisher gives: enwik8's for the member of enwik8.zip), as are its sha256 and
the count of byte values in it, each computed as the bytes stream: nothing is read twice,
and memory does not grow with the corpus."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import http.client
import json
import os
import socket
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

from ..artifacts import ui
from ..artifacts.store import SETTLED_NS, Builder, file_identity
from ..model.config import TINYSHAKESPEARE_MD5, TINYSHAKESPEARE_URL, ConfigError, DataConfig
from ..model.data import ThreadedDigest, write_all
from ..runtime import cache_dir
from .registry import FETCH
from .sources import (
    COMPRESSED,
    BucketCorpus,
    FetchError,
    corpus_files,
    decoded_chunks,
    decompressed,
    is_bucket,
    local_path,
    md5_of,
    source_mode,
)

(CORPUS,) = FETCH.builds
KNOWN_SIZES = {TINYSHAKESPEARE_MD5: 1_115_394}
ATTEMPTS = 4
# No network, no such host, or nothing listening: asking again seconds later changes nothing, so
# the one line comes at once (offline, four attempts took 21 s). Timeouts, resets and a busy
# server's 5xx are retried.
NOT_RETRIED = (errno.ENETUNREACH, errno.EHOSTUNREACH, errno.ECONNREFUSED)
TIMEOUT_S = 30.0


def pin(data: DataConfig, remembered: bool = True) -> DataConfig:
    """``data`` with the corpus's md5 filled in where the user gave none: computed for a local
    file or folder (or, ``remembered``, taken from this machine's record of the same files
    unchanged), the known one for the default download. Any other download must name its
    checksum, which the fetched bytes are then checked against."""
    if data.md5 is not None:
        return data
    path = local_path(data.corpus)
    if path is not None:  # every figure fetch needs, in the same pass
        files = corpus_files(path, data.glob)
        figures = recalled_figures(path, data.glob, files) if remembered else None
        if figures is None:
            figures = read_figures(path, data.glob, files)
        _PINNED[(data.corpus, data.glob, figures.md5)] = figures
        return data.model_copy(update={"md5": figures.md5})
    if is_bucket(data.corpus):  # read once more, now: what the objects hold keys the version
        corpus = BucketCorpus(data.corpus, data.glob)
        ui.say("fetch: computing the md5 of %s (%d objects, %.1f MB); pass --set data.md5=<its md5> to skip this",
               data.corpus, len(corpus.objects), corpus.size / 1e6)
        return data.model_copy(update={"md5": md5_of(corpus.chunks())})
    if data.corpus == TINYSHAKESPEARE_URL:
        return data.model_copy(update={"md5": TINYSHAKESPEARE_MD5})
    raise ConfigError(f"a downloaded corpus is checked against its md5, and {data.corpus} has none; pass it with "
                      "--set data.md5=<md5 of the file>, or download the file and pass its path with --corpus")


@dataclass(frozen=True)
class Figures:
    """What a corpus's bytes come to: its checksums, its size and the byte values it holds."""

    md5: str
    sha256: str
    size: int
    seen: bytes  # the distinct byte values, sorted

    @property
    def distinct(self) -> int:
        return len(self.seen)


class Digest:
    """Figures of a corpus's bytes as they stream: md5 (on a thread: ``ThreadedDigest``),
    sha256, size and which byte values occur; or, ``sha256_only`` (a copy of bytes whose
    figures are known), its sha256 (on a thread) and size. A download that starts over
    restarts it."""

    def __init__(self, sha256_only: bool = False):
        self.sha256_only = sha256_only
        self.restart()

    def restart(self) -> None:
        self.md5 = None if self.sha256_only else ThreadedDigest(hashlib.md5())
        self.sha256 = ThreadedDigest(hashlib.sha256()) if self.sha256_only else hashlib.sha256()
        self.size, self.seen = 0, b""

    def figures(self) -> Figures:
        if self.md5 is None:
            raise RuntimeError("a sha256-only digest has no md5")
        return Figures(self.md5.hexdigest(), self.sha256.hexdigest(), self.size, self.seen)

    def update(self, chunk: bytes) -> None:
        if self.md5 is not None:
            self.md5.update(chunk)
        self.sha256.update(chunk)
        self.size += len(chunk)
        if self.sha256_only:
            return
        # Which values occur: what is left of the chunk without those seen so far (C speed;
        # soon nothing, as a text's alphabet is complete within its first pages).
        new = chunk.translate(None, self.seen)
        if new:
            self.seen = bytes(sorted(set(self.seen) | set(new)))


# The figures of each local corpus this process pinned, by source, filter and md5: fetch
# takes the md5 and the byte values from there, and checks the bytes it copies by their
# sha256 alone (md5 runs on one core at about half sha256's speed).
_PINNED: dict[tuple[str, str | None, str], Figures] = {}

# This machine's record of local corpora's figures, one file per corpus state, keyed by its
# files' paths and identities as the store knows a file it has hashed (device, inode, size,
# modification and change times), under the same racy rule (SETTLED_NS): a file written
# within seconds of the read is not recorded. The newest KEPT_FIGURES are kept.
FIGURES_FORMAT = 1
KEPT_FIGURES = 64


def _figures_file(path: Path, pattern: str | None, files: list[Path]) -> tuple[Path, list]:
    """Where the record of these files as they are now lives, and their identities."""
    state = [file_identity(os.stat(f)) for f in files]
    key = json.dumps([FIGURES_FORMAT, str(path.resolve()), pattern, [str(f) for f in files], state])
    return cache_dir() / "corpus-figures" / f"{hashlib.sha256(key.encode()).hexdigest()[:32]}.json", state


def recalled_figures(path: Path, pattern: str | None, files: list[Path]) -> Figures | None:
    """The figures recorded for exactly these files unchanged, if any."""
    record, _ = _figures_file(path, pattern, files)
    try:
        found = json.loads(record.read_text())
        figures = Figures(found["md5"], found["sha256"], int(found["size"]), bytes.fromhex(found["seen"]))
    except (OSError, ValueError, KeyError, TypeError):  # none, or not one this code wrote
        return None
    if len(figures.md5) != 32 or len(figures.sha256) != 64:
        return None
    return figures


def read_figures(path: Path, pattern: str | None, files: list[Path]) -> Figures:
    """The figures of the corpus's bytes, read whole; recorded when its files were settled
    before the read and did not move during it."""
    record, before = _figures_file(path, pattern, files)
    started = time.time_ns()
    corpus = Digest()
    for chunk in decoded_chunks(files):
        corpus.update(chunk)
    figures = corpus.figures()
    settled = all(started - max(mtime, ctime) > SETTLED_NS for _, (_, mtime, ctime) in before)
    if settled and [file_identity(os.stat(f)) for f in files] == before:
        with contextlib.suppress(OSError):  # a record is a saving, never a need
            record.parent.mkdir(parents=True, exist_ok=True)
            partial = record.with_name(f".{record.name}.{os.getpid()}")
            partial.write_text(json.dumps({**asdict(figures), "seen": figures.seen.hex()}))
            os.replace(partial, record)
            for old in sorted(record.parent.glob("*.json"), key=lambda p: p.stat().st_mtime_ns)[:-KEPT_FIGURES]:
                old.unlink(missing_ok=True)
    return figures


def forget_figures(md5: str) -> None:
    """Drops this machine's records that give ``md5``: a copy found other bytes."""
    for record in (cache_dir() / "corpus-figures").glob("*.json"):
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            if json.loads(record.read_text())["md5"] == md5:
                record.unlink(missing_ok=True)


def _written(chunks: Iterable[bytes], target: Path, sha256_only: bool = False) -> Digest:
    """``chunks`` written to ``target``, and their figures."""
    corpus = Digest(sha256_only)
    with open(target, "wb") as handle:
        for chunk in chunks:
            write_all(handle, chunk)
            corpus.update(chunk)
    return corpus


def _compressed(name: str) -> bool:
    return name.lower().endswith((*COMPRESSED, ".zip"))


def _download(url: str, target: Path, digest: Digest | None = None, progress=None, attempts: int = ATTEMPTS,
              timeout_s: float = TIMEOUT_S) -> None:
    """Downloads ``url`` into ``target`` with ``digest`` (if any) hearing every byte once; a dropped
    connection resumes where it stopped (an HTTP Range request; a server that answers with
    the whole file again starts over), with exponential backoff on transient errors."""
    last: Exception | None = None
    have = 0
    with open(target, "wb") as out:
        for attempt in range(attempts):
            if attempt:
                time.sleep(2 ** (attempt - 1))
            request = urllib.request.Request(url, headers={"Range": f"bytes={have}-"} if have else {})
            try:
                with urllib.request.urlopen(request, timeout=timeout_s) as response:
                    if have and response.status != 206:  # the server sends it all again: start over
                        out.seek(0)
                        out.truncate()
                        have = 0
                        if digest is not None:
                            digest.restart()
                    length = response.headers.get("Content-Length")
                    total = have + int(length) if length is not None else None
                    while chunk := response.read(1 << 20):
                        write_all(out, chunk)
                        if digest is not None:
                            digest.update(chunk)
                        have += len(chunk)
                        if progress is not None:
                            progress(have, total)
                    if total is not None and have < total:
                        raise http.client.IncompleteRead(b"", total - have)
                return
            except urllib.error.HTTPError as error:
                last = error
                if error.code == 416 and have:  # nothing past what we have: it was all there
                    return
                if error.code < 500 and error.code != 429:
                    break  # the server said no; asking again will not change that
            except (urllib.error.URLError, TimeoutError, ConnectionError, http.client.HTTPException) as error:
                last = error
                cause = getattr(error, "reason", error)
                if isinstance(cause, socket.gaierror) or getattr(cause, "errno", None) in NOT_RETRIED:
                    break
    reason = getattr(last, "reason", last)
    raise FetchError(
        f"could not download {url} ({reason}) after {attempt + 1} attempt(s); check the network, "
        "or pass a local copy with --corpus PATH or a mirror with --corpus file:///PATH"
    ) from last


def fetch_to(source: str, target: Path, pattern: str | None = None, progress=None,
             files: list[Path] | None = None, known: Figures | None = None) -> tuple[list[Path] | None, Figures]:
    """Writes the corpus to ``target``: the local files it was made of (None for a
    download), and the figures of what went into ``target`` (its md5 among them).
    ``progress(done, total)`` hears the source's bytes read so far; ``files``: a local
    source's files, where the caller has listed them already; ``known``: a local source's
    figures as ``pin`` read them, which the copy is checked against by size and sha256."""
    path = local_path(source)
    if path is not None:
        files = corpus_files(path, pattern) if files is None else files
        copied = _written(decoded_chunks(files, progress), target, sha256_only=known is not None)
        if known is None:
            return files, copied.figures()
        if copied.size != known.size or copied.sha256.hexdigest() != known.sha256:
            forget_figures(known.md5)
            raise FetchError(f"the corpus at {source} changed since its md5 was taken ({known.size:,} bytes "
                             f"then, {copied.size:,} now, or other bytes); run again once nothing writes to it")
        return files, known
    if is_bucket(source):
        objects = BucketCorpus(source, pattern)
        if progress is not None:
            progress(0, objects.size)
        return None, _written(objects.chunks(progress), target).figures()
    parsed = urllib.parse.urlparse(source)
    if parsed.scheme not in ("http", "https"):
        raise FetchError(f"unsupported corpus source {source!r}; use an https:// or file:// URL, an s3:// or gs:// "
                         "prefix, or a path")
    name = urllib.parse.unquote(parsed.path.rsplit("/", 1)[-1])
    if not _compressed(name):  # the download is the corpus: every figure as it arrives
        corpus = Digest()
        _download(source, target, corpus, progress)
        return None, corpus.figures()
    download = target.with_name(f".download-{name}")  # an archive is read whole (a zip's index is at its end)
    try:
        # Checked by what it holds: the corpus's md5, after decompression (a damaged archive
        # fails that, or the decompression itself).
        _download(source, download, None, progress)
        with open(download, "rb") as handle:
            return None, _written(decompressed(Path(source), handle, name), target).figures()
    finally:
        download.unlink(missing_ok=True)


def build(settings: DataConfig, out: Builder) -> None:
    if settings.md5 is None:
        raise ConfigError("the corpus's md5 is not known: a run computes or checks it before its first stage (pin)")
    target = out.path(CORPUS)
    started = time.monotonic()
    path = local_path(settings.corpus)
    listed = corpus_files(path, settings.glob) if path is not None else None
    size_hint = sum(os.stat(f).st_size for f in listed) if listed is not None else KNOWN_SIZES.get(settings.md5, 1)
    with ui.Progress(FETCH.name, size_hint, "fetch", in_bytes=True) as progress:
        known = _PINNED.get((settings.corpus, settings.glob, settings.md5)) if path is not None else None
        files, corpus = fetch_to(settings.corpus, target, settings.glob, progress, listed, known)
        progress(progress.total)  # all of it: a compressed source's reader may stop short of its last bytes
    actual = corpus.md5
    seconds = time.monotonic() - started
    size = corpus.size
    if size == 0:
        raise FetchError(f"the corpus at {settings.corpus} is empty (0 bytes); point --corpus at the text file")
    if actual != settings.md5:
        expected_size = KNOWN_SIZES.get(settings.md5)
        truncated = (
            f" ({size:,} bytes where {expected_size:,} were expected: truncated or another file)"
            if expected_size and size != expected_size else ""
        )
        raise FetchError(
            f"md5 mismatch for {settings.corpus}: expected {settings.md5}, got {actual}{truncated}; "
            "fetch it again or fix the source, or if this is the corpus you want, "
            f"pass its checksum: --set data.md5={actual}"
        )
    out.digests[CORPUS] = {"bytes": size, "sha256": corpus.sha256}
    if files is not None:  # no wider permissions than its source's
        os.chmod(target, source_mode(files))
    distinct = corpus.distinct
    out.metrics.update({"bytes": size, "md5": actual, "sha256": corpus.sha256,
                        "distinct_bytes": distinct, "mb_per_s": round(size / 1e6 / max(seconds, 1e-9), 1)})
    out.record["source"] = settings.corpus
    if files is not None:
        out.record["source_files"] = len(files)
    if files is not None and path is not None and path.is_dir():  # a folder: which files, in order
        out.record["corpus_files"] = [{"name": f.relative_to(path).as_posix(), "bytes": f.stat().st_size}
                                      for f in files]
    text = "" if distinct > 100 or 0 in corpus.seen else "; text"  # ASCII text holds about 60 to 100 values
    read = f" from {len(files):,} files" if files is not None and len(files) > 1 else ""
    ui.say("fetch: %s bytes%s, %d distinct byte values%s, %.0f MB/s", f"{size:,}", read, distinct, text,
           size / 1e6 / max(seconds, 1e-9))
    ui.table(
        FETCH.name,
        [{"source": settings.corpus, "bytes": size, "md5": actual, "distinct byte values": distinct,
          **({"files": len(files)} if files is not None else {})}],
        description=f"Corpus fetched: {size:,} bytes{read}, {distinct} distinct byte values, md5 "
                    + ("verified against the known checksum" if files is None else "computed from its files"),
    )
