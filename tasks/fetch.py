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
import hashlib
import hmac
import json
import os
import time
import urllib.parse
from collections.abc import Iterable
from dataclasses import asdict
from pathlib import Path
from typing import NamedTuple

from ..artifacts.objects import Bucket
from ..artifacts.store import SETTLED_NS, Builder, Version, canonical_json, file_identity
from ..config.machine import cache_dir
from ..config.settings import TINYSHAKESPEARE_MD5, TINYSHAKESPEARE_URL, ConfigError, CorpusFigures, DataConfig
from ..model.data.download import download
from ..model.data.sources import (
    COMPRESSED,
    BucketCorpus,
    Digest,
    FetchError,
    corpus_files,
    decoded_chunks,
    decompressed,
    is_bucket,
    local_path,
    md5_of,
    source_mode,
)
from ..model.data.splits import write_all
from . import report
from .registry import FETCH

(CORPUS,) = FETCH.builds
KNOWN_SIZES = {TINYSHAKESPEARE_MD5: 1_115_394}


def pin(data: DataConfig, remembered: bool = True) -> DataConfig:
    """``data`` with the corpus's md5 filled in where the user gave none: computed for a local
    file or folder (or, ``remembered``, taken from this machine's record of the same files
    unchanged), the known one for the default download. Any other download must name its
    checksum, which the fetched bytes are then checked against.

    A local corpus's md5 is taken even when the user gave one, and the two must agree: the
    md5 keys the fetch version, so a stated one that another corpus in the store has would
    otherwise hand the run that corpus's bytes (a config file reused for another corpus). A
    stated md5 of a local corpus that is gone names what the store holds, and stands."""
    path = local_path(data.corpus)
    if path is not None and (data.md5 is None or path.exists()):  # every figure fetch needs, in the same pass
        files = corpus_files(path, data.glob)
        figures = recalled_figures(path, data.glob, files) if remembered else None
        if figures is None:
            figures = read_figures(path, data.glob, files)
        if data.md5 is not None and data.md5 != figures.md5:
            raise md5_mismatch(data.corpus, data.md5, figures)
        return data.pinned(figures)
    if data.md5 is not None:
        return data
    if is_bucket(data.corpus):  # read once more, now: what the objects hold keys the version
        corpus = BucketCorpus(Bucket(data.corpus), data.corpus, data.glob)
        report.say(
            "fetch: computing the md5 of %s (%d objects, %.1f MB); pass --set data.md5=<its md5> to skip this",
            data.corpus,
            len(corpus.objects),
            corpus.size / 1e6,
        )
        return data.model_copy(update={"md5": md5_of(corpus.chunks())})
    if data.corpus == TINYSHAKESPEARE_URL:
        return data.model_copy(update={"md5": TINYSHAKESPEARE_MD5})
    raise ConfigError(
        f"a downloaded corpus is checked against its md5, and {data.corpus} has none; pass it with "
        "--set data.md5=<md5 of the file>, or download the file and pass its path with --corpus"
    )


def md5_mismatch(source: str, expected: str, found: CorpusFigures) -> FetchError:
    """The one line for a corpus whose bytes are not the md5 asked for: both checksums, and
    which way out (another fetch, or the md5 of what is there)."""
    expected_size = KNOWN_SIZES.get(expected)
    truncated = (
        f" ({found.size:,} bytes where {expected_size:,} were expected: truncated or another file)"
        if expected_size and found.size != expected_size
        else ""
    )
    packed = str(source).lower().endswith((".gz", ".xz", ".zst", ".bz2", ".zip", ".tar", ".tgz"))
    return FetchError(
        f"md5 mismatch for {source}: expected {expected}, got {found.md5}{truncated}; fetch it again or "
        f"fix the source, or if this is the corpus you want, pass its checksum: --set data.md5="
        f"{found.md5}" + (" (data.md5 is of the decompressed text, not of the archive)" if packed else "")
    )


def accept(settings: DataConfig, version: Version) -> None:
    """A stored fetch version found by its md5, checked against the figures this run took of a
    local corpus (read, or remembered): the same sha256 and size, or the version is not this
    corpus's. A record of this machine that named the wrong md5 is forgotten, so a rerun reads
    the corpus again."""
    figures = settings.figures
    stored = version.manifest.get("files", {}).get(CORPUS, {})
    if figures is None or (stored.get("sha256"), stored.get("bytes")) == (figures.sha256, figures.size):
        return
    forget_figures(figures.md5)
    raise FetchError(
        f"the stored corpus with md5 {figures.md5} ({version.key}) is not the one at {settings.corpus} "
        f"({stored.get('bytes', 0):,} bytes there, {figures.size:,} here, other sha256): this machine's "
        "record of its checksum was wrong and is forgotten; rerun to read the corpus again"
    )


# This machine's record of local corpora's figures, one file per corpus state, keyed by its
# files' paths and identities as the store knows a file it has hashed (device, inode, size,
# modification and change times), under the same racy rule (SETTLED_NS): a file written
# within seconds of the read is not recorded. The newest KEPT_FIGURES are kept. Each record
# is sealed with an HMAC over its key and figures, under a key of this cache folder's own
# (made once, readable by its owner alone): a record edited by hand or by another program,
# or moved to another corpus's name, is not believed, and the corpus is read again.
FIGURES_FORMAT = 2
KEPT_FIGURES = 64
SEAL_KEY = ".seal-key"


def _figures_file(path: Path, pattern: str | None, files: list[Path]) -> tuple[Path, list, str]:
    """Where the record of these files as they are now lives, their identities, and the key."""
    state = [file_identity(os.stat(f)) for f in files]
    key = json.dumps([FIGURES_FORMAT, str(path.resolve()), pattern, [str(f) for f in files], state])
    digest = hashlib.sha256(key.encode()).hexdigest()[:32]
    return cache_dir() / "corpus-figures" / f"{digest}.json", state, key


def _seal(folder: Path, key: str, figures: dict, create: bool = False) -> str | None:
    """The HMAC of a record's key and figures, under this cache folder's seal key (made when
    ``create``); None where there is none."""
    secret = folder / SEAL_KEY
    try:
        if create and not secret.exists():
            folder.mkdir(parents=True, exist_ok=True)
            partial = folder / f".{SEAL_KEY}.{os.getpid()}"
            descriptor = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(descriptor, "wb") as handle:
                handle.write(os.urandom(32))
            with contextlib.suppress(FileExistsError):  # another process made one first: theirs
                os.link(partial, secret)
            partial.unlink(missing_ok=True)
        material = secret.read_bytes()
    except OSError:
        return None
    return hmac.new(material, (key + canonical_json(figures)).encode(), hashlib.sha256).hexdigest()


def recalled_figures(path: Path, pattern: str | None, files: list[Path]) -> CorpusFigures | None:
    """The figures recorded for exactly these files unchanged, if any, and sealed by this
    cache folder's key."""
    record, _, key = _figures_file(path, pattern, files)
    try:
        found = json.loads(record.read_text())
        kept = found["figures"]
        seal = _seal(record.parent, key, kept)
        if seal is None or not hmac.compare_digest(seal, str(found["seal"])):
            return None
        figures = CorpusFigures(kept["md5"], kept["sha256"], int(kept["size"]), bytes.fromhex(kept["seen"]))
    except (OSError, ValueError, KeyError, TypeError):  # none, or not one this code wrote
        return None
    if len(figures.md5) != 32 or len(figures.sha256) != 64:
        return None
    if not any(_compressed(f.name) for f in files) and figures.size != sum(f.stat().st_size for f in files):
        return None  # plain files are their corpus: a record of another size is of another corpus
    return figures


def read_figures(path: Path, pattern: str | None, files: list[Path]) -> CorpusFigures:
    """The figures of the corpus's bytes, read whole; recorded when its files were settled
    before the read and did not move during it."""
    record, before, key = _figures_file(path, pattern, files)
    started = time.time_ns()
    corpus = Digest()
    for chunk in decoded_chunks(files):
        corpus.update(chunk)
    figures = corpus.figures()
    settled = all(started - max(mtime, ctime) > SETTLED_NS for _, (_, mtime, ctime) in before)
    if settled and [file_identity(os.stat(f)) for f in files] == before:
        with contextlib.suppress(OSError):  # a record is a saving, never a need
            kept = {**asdict(figures), "seen": figures.seen.hex()}
            seal = _seal(record.parent, key, kept, create=True)
            if seal is None:
                return figures
            partial = record.with_name(f".{record.name}.{os.getpid()}")
            partial.write_text(json.dumps({"figures": kept, "seal": seal}))
            os.replace(partial, record)
            for old in sorted(record.parent.glob("*.json"), key=lambda p: p.stat().st_mtime_ns)[:-KEPT_FIGURES]:
                old.unlink(missing_ok=True)
    return figures


def forget_figures(md5: str) -> None:
    """Drops this machine's records that give ``md5``: a copy found other bytes."""
    for record in (cache_dir() / "corpus-figures").glob("*.json"):
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            if json.loads(record.read_text())["figures"]["md5"] == md5:
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
    if not _compressed(name):  # the download is the corpus: every figure as it arrives
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
