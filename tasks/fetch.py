"""Stage 1: fetch the corpus from an https URL, a file:// URL or a local path, and
check its md5. The version is keyed on the checksum alone: the same bytes from a
mirror are the same corpus."""

from __future__ import annotations

import shutil
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

from bardflow.artifacts import ui
from bardflow.artifacts.store import Builder, file_digest
from bardflow.model.config import TINYSHAKESPEARE_MD5, DataConfig
from bardflow.model.errors import BardflowError
from bardflow.tasks.registry import FETCH

(CORPUS,) = FETCH.builds
KNOWN_SIZES = {TINYSHAKESPEARE_MD5: 1_115_394}
ATTEMPTS = 4
TIMEOUT_S = 30.0


class FetchError(BardflowError, RuntimeError):
    """The corpus could not be fetched or is not the expected file."""


def _copy_local(path: Path, target: Path) -> None:
    try:
        shutil.copyfile(path, target)
    except FileNotFoundError as error:
        raise FetchError(f"corpus file {path} does not exist; check --corpus / BARDFLOW_CORPUS") from error
    except IsADirectoryError as error:
        raise FetchError(f"corpus path {path} is a folder; point --corpus at the text file") from error
    except PermissionError as error:
        raise FetchError(f"corpus file {path} is not readable; fix its permissions") from error


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
    reason = getattr(last, "reason", last)
    raise FetchError(
        f"could not download {url} ({reason}) after {attempt + 1} attempt(s); check the network, "
        "or pass a local copy with --corpus PATH or a mirror with --corpus file:///PATH"
    ) from last


def fetch_to(source: str, target: Path) -> None:
    parsed = urllib.parse.urlparse(source)
    if parsed.scheme in ("http", "https"):
        _download(source, target)
    elif parsed.scheme == "file":
        _copy_local(Path(urllib.request.url2pathname(parsed.path)), target)
    elif parsed.scheme == "" or len(parsed.scheme) == 1:  # a path (or a Windows drive letter)
        _copy_local(Path(source).expanduser(), target)
    else:
        raise FetchError(f"unsupported corpus source {source!r}; use an https:// or file:// URL or a path")


def build(settings: DataConfig, out: Builder) -> None:
    target = out.path(CORPUS)
    fetch_to(settings.corpus, target)
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
    out.metrics.update({"bytes": size, "md5": actual})
    out.record["source"] = settings.corpus
    ui.table(
        FETCH.name,
        [{"source": settings.corpus, "bytes": size, "md5": actual}],
        description=f"Corpus fetched: {size:,} bytes, md5 verified",
    )
