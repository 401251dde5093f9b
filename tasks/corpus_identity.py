"""A corpus's identity: its md5 (given, known, or computed for a local corpus when the run
starts, and remembered on this machine for files that have not moved), the one-line refusal
of bytes that are not it, and the check that a stored fetch version found by its md5 holds the
very bytes this run took of a local corpus. The fetch stage itself is ``tasks/fetch.py``."""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import os
import time
from dataclasses import asdict
from pathlib import Path

from ..artifacts.manifest import canonical_json
from ..artifacts.objects import Bucket
from ..artifacts.store import SETTLED_NS, Version, file_identity
from ..config.machine import cache_dir
from ..config.settings import TINYSHAKESPEARE_MD5, TINYSHAKESPEARE_URL, ConfigError, CorpusFigures, DataConfig
from ..model.data.sources import (
    COMPRESSED,
    BucketCorpus,
    Digest,
    FetchError,
    corpus_files,
    decoded_chunks,
    is_bucket,
    local_path,
    md5_of,
)
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
    if not any(compressed(f.name) for f in files) and figures.size != sum(f.stat().st_size for f in files):
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


def compressed(name: str) -> bool:
    return name.lower().endswith((*COMPRESSED, ".zip"))
