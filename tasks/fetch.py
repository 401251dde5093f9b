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

import os
import time
import urllib.parse
from collections.abc import Iterable
from pathlib import Path
from typing import NamedTuple

from ..artifacts.objects import Bucket
from ..artifacts.store import Builder
from ..config.settings import ConfigError, CorpusFigures, DataConfig
from ..model.data.download import download
from ..model.data.sources import (
    BucketCorpus,
    Digest,
    FetchError,
    corpus_files,
    decoded_chunks,
    decompressed,
    is_bucket,
    local_path,
    source_mode,
)
from ..model.data.splits import write_all
from . import report
from .corpus_identity import KNOWN_SIZES, compressed, forget_figures, md5_mismatch
from .registry import FETCH

(CORPUS,) = FETCH.builds


def _written(chunks: Iterable[bytes], target: Path, sha256_only: bool = False) -> Digest:
    """``chunks`` written to ``target``, and their figures."""
    corpus = Digest(sha256_only)
    with open(target, "wb") as handle:
        for chunk in chunks:
            write_all(handle, chunk)
            corpus.update(chunk)
    return corpus


class Fetched(NamedTuple):
    """What ``fetch_to`` wrote: the local files it was made of (None for a download), the
    figures of what went into the target (its md5 among them), and, for a download that a
    server redirected to another host, the URL the bytes came from."""

    files: list[Path] | None
    figures: CorpusFigures
    redirected_to: str | None = None


def fetch_to(
    source: str,
    target: Path,
    pattern: str | None = None,
    progress=None,
    files: list[Path] | None = None,
    known: CorpusFigures | None = None,
) -> Fetched:
    """Writes the corpus to ``target``. ``progress(done, total)`` hears the source's bytes
    read so far; ``files``: a local source's files, where the caller has listed them
    already; ``known``: a local source's figures as ``pin`` read them, which the copy is
    checked against by size and sha256."""
    path = local_path(source)
    if path is not None:
        files = corpus_files(path, pattern) if files is None else files
        copied = _written(decoded_chunks(files, progress), target, sha256_only=known is not None)
        if known is None:
            return Fetched(files, copied.figures())
        if copied.size != known.size or copied.sha256.hexdigest() != known.sha256:
            forget_figures(known.md5)
            raise FetchError(
                f"the corpus at {source} changed since its md5 was taken ({known.size:,} bytes "
                f"then, {copied.size:,} now, or other bytes); run again once nothing writes to it"
            )
        return Fetched(files, known)
    if is_bucket(source):
        objects = BucketCorpus(Bucket(source), source, pattern)
        if progress is not None:
            progress(0, objects.size)
        return Fetched(None, _written(objects.chunks(progress), target).figures())
    parsed = urllib.parse.urlparse(source)
    if parsed.scheme not in ("http", "https"):
        raise FetchError(
            f"unsupported corpus source {source!r}; use an https:// or file:// URL, an s3:// or gs:// prefix, or a path"
        )
    name = urllib.parse.unquote(parsed.path.rsplit("/", 1)[-1])
    if not compressed(name):  # the download is the corpus: every figure as it arrives
        corpus = Digest()
        came_from = download(source, target, corpus.update, corpus.restart, progress)
        return Fetched(None, corpus.figures(), _elsewhere(source, came_from))
    scratch = target.with_name(f".download-{name}")  # an archive is read whole (a zip's index is at its end)
    try:
        # Checked by what it holds: the corpus's md5, after decompression (a damaged archive
        # fails that, or the decompression itself).
        came_from = download(source, scratch, progress=progress)
        with open(scratch, "rb") as handle:
            figures = _written(decompressed(Path(source), handle, name), target).figures()
        return Fetched(None, figures, _elsewhere(source, came_from))
    finally:
        scratch.unlink(missing_ok=True)


def _elsewhere(source: str, came_from: str) -> str | None:
    """Where a download came from, when a redirect took it to another host."""
    return None if urllib.parse.urlparse(came_from).netloc == urllib.parse.urlparse(source).netloc else came_from


def build(settings: DataConfig, out: Builder) -> None:
    if settings.md5 is None:
        raise ConfigError("the corpus's md5 is not known: a run computes or checks it before its first stage (pin)")
    target = out.path(CORPUS)
    started = time.monotonic()
    path = local_path(settings.corpus)
    listed = corpus_files(path, settings.glob) if path is not None else None
    size_hint = sum(os.stat(f).st_size for f in listed) if listed is not None else KNOWN_SIZES.get(settings.md5, 1)
    with report.progress(FETCH.name, size_hint, "fetch", in_bytes=True) as progress:
        known = settings.figures if path is not None else None
        files, corpus, redirected_to = fetch_to(settings.corpus, target, settings.glob, progress, listed, known)
        progress(progress.total)  # all of it: a compressed source's reader may stop short of its last bytes
    actual = corpus.md5
    seconds = time.monotonic() - started
    size = corpus.size
    if size == 0:
        raise FetchError(f"the corpus at {settings.corpus} is empty (0 bytes); point --corpus at the text file")
    if actual != settings.md5:
        if redirected_to is not None:  # another host's bytes: where they came from, not what they are
            raise FetchError(
                f"md5 mismatch for {settings.corpus}: the server redirected to {redirected_to}, whose "
                f"file is not the corpus with md5 {settings.md5}; check the URL, or download the file "
                "and pass its path with --corpus"
            )
        raise md5_mismatch(settings.corpus, settings.md5, corpus)
    out.digests[CORPUS] = {"bytes": size, "sha256": corpus.sha256}
    if files is not None:  # no wider permissions than its source's
        os.chmod(target, source_mode(files))
    distinct = corpus.distinct
    out.metrics.update(
        {
            "bytes": size,
            "md5": actual,
            "sha256": corpus.sha256,
            "distinct_bytes": distinct,
            "mb_per_s": round(size / 1e6 / max(seconds, 1e-9), 1),
        }
    )
    out.record["source"] = settings.corpus
    if files is not None:
        out.record["source_files"] = len(files)
    if files is not None and path is not None and path.is_dir():  # a folder: which files, in order
        out.record["corpus_files"] = [
            {"name": f.relative_to(path).as_posix(), "bytes": f.stat().st_size} for f in files
        ]
    text = "" if distinct > 100 or 0 in corpus.seen else "; text"  # ASCII text holds about 60 to 100 values
    read = f" from {len(files):,} files" if files is not None and len(files) > 1 else ""
    report.say(
        "fetch: %s bytes%s, %d distinct byte values%s, %s",
        f"{size:,}",
        read,
        distinct,
        text,
        _rate(size / max(seconds, 1e-9)),
    )


def _rate(bytes_per_s: float) -> str:
    """A speed in the unit that gives it a figure: ``34 MB/s``, ``820 kB/s``."""
    return f"{bytes_per_s / 1e6:.0f} MB/s" if bytes_per_s >= 1e6 else f"{bytes_per_s / 1e3:.0f} kB/s"
