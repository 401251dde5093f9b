"""Stage 1: fetch the corpus from an https URL, a file:// URL, a local path or a local
folder of ``.txt`` files (one corpus: the files in sorted order), and check its md5. The
version is keyed on the checksum alone: the same bytes from a mirror are the same corpus.

A local corpus needs no checksum from the user: ``pin`` computes it when the run starts,
so the version is keyed as if it had been given. A download is checked against a known
checksum: the default corpus's own, or the one the user gives (``data.md5``)."""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
import socket
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

from ..artifacts import ui
from ..artifacts.store import Builder, file_digest
from ..model.config import TINYSHAKESPEARE_MD5, TINYSHAKESPEARE_URL, ConfigError, DataConfig
from .registry import FETCH
from .sources import FetchError, chunks, corpus_files, local_path, source_mode

(CORPUS,) = FETCH.builds
KNOWN_SIZES = {TINYSHAKESPEARE_MD5: 1_115_394}
ATTEMPTS = 4
# No network, no such host, or nothing listening: asking again seconds later changes nothing, so
# the one line comes at once (offline, four attempts took 21 s). Timeouts, resets and a busy
# server's 5xx are retried.
NOT_RETRIED = (errno.ENETUNREACH, errno.EHOSTUNREACH, errno.ECONNREFUSED)
TIMEOUT_S = 30.0


def pin(data: DataConfig) -> DataConfig:
    """``data`` with the corpus's md5 filled in where the user gave none: computed for a local
    file or folder, the known one for the default download. Any other download must name
    its checksum, which the fetched bytes are then checked against."""
    if data.md5 is not None:
        return data
    path = local_path(data.corpus)
    if path is not None:
        digest = hashlib.md5()
        for chunk in chunks(corpus_files(path)):
            digest.update(chunk)
        return data.model_copy(update={"md5": digest.hexdigest()})
    if data.corpus == TINYSHAKESPEARE_URL:
        return data.model_copy(update={"md5": TINYSHAKESPEARE_MD5})
    raise ConfigError(f"a downloaded corpus is checked against its md5, and {data.corpus} has none; pass it with "
                      "--set data.md5=<md5 of the file>, or download the file and pass its path with --corpus")


def _copy_local(path: Path, target: Path) -> list[Path]:
    files = corpus_files(path)
    with open(target, "wb") as out:
        out.writelines(chunks(files))
    return files


def _download(url: str, target: Path, attempts: int = ATTEMPTS, timeout_s: float = TIMEOUT_S) -> None:
    """Downloads with a per-request timeout and exponential backoff on transient errors."""
    last: Exception | None = None
    for attempt in range(attempts):
        if attempt:
            time.sleep(2 ** (attempt - 1))
        try:
            with urllib.request.urlopen(url, timeout=timeout_s) as response, open(target, "wb") as out:
                shutil.copyfileobj(response, out, 1 << 20)
            return
        except urllib.error.HTTPError as error:
            last = error
            if error.code < 500 and error.code != 429:
                break  # the server said no; asking again will not change that
        except (urllib.error.URLError, TimeoutError, ConnectionError) as error:
            last = error
            cause = getattr(error, "reason", error)
            if isinstance(cause, socket.gaierror) or getattr(cause, "errno", None) in NOT_RETRIED:
                break
    reason = getattr(last, "reason", last)
    raise FetchError(
        f"could not download {url} ({reason}) after {attempt + 1} attempt(s); check the network, "
        "or pass a local copy with --corpus PATH or a mirror with --corpus file:///PATH"
    ) from last


def fetch_to(source: str, target: Path) -> list[Path] | None:
    """Writes the corpus to ``target``; returns the local files it was made of (None for a download)."""
    path = local_path(source)
    if path is not None:
        return _copy_local(path, target)
    if urllib.parse.urlparse(source).scheme in ("http", "https"):
        _download(source, target)
        return None
    raise FetchError(f"unsupported corpus source {source!r}; use an https:// or file:// URL or a path")


def build(settings: DataConfig, out: Builder) -> None:
    if settings.md5 is None:
        raise ConfigError("the corpus's md5 is not known: a run computes or checks it before its first stage (pin)")
    target = out.path(CORPUS)
    files = fetch_to(settings.corpus, target)
    size = target.stat().st_size
    if size == 0:
        raise FetchError(f"the corpus at {settings.corpus} is empty (0 bytes); point --corpus at the text file")
    actual = file_digest(target, "md5")
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
    if files is not None:  # no wider permissions than its source's
        os.chmod(target, source_mode(files))
    out.metrics.update({"bytes": size, "md5": actual})
    out.record["source"] = settings.corpus
    path = local_path(settings.corpus)
    if files is not None and path is not None and path.is_dir():  # a folder: which files, in order
        out.record["corpus_files"] = [{"name": f.relative_to(path).as_posix(), "bytes": f.stat().st_size}
                                      for f in files]
    ui.table(
        FETCH.name,
        [{"source": settings.corpus, "bytes": size, "md5": actual}],
        description=f"Corpus fetched: {size:,} bytes, md5 "
                    + ("verified against the known checksum" if files is None else "computed from its files"),
    )
