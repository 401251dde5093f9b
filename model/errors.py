"""The one family of errors that bardflow explains.

An error of this family names the problem and the fix in its message: the command line
shows it as one ``bardflow: error: ...`` line (a traceback only with ``--debug``) and the
run's log keeps it without a traceback. Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations


class BardflowError(Exception):
    """An explained error: its message says what is wrong and what to do."""


class DistributedError(BardflowError, RuntimeError):
    """The processes cannot form one run; the message says which setting to fix."""


class DiskFullError(BardflowError, OSError):
    """The disk under the store (or a checkpoint folder) has no room for what must be written."""


FREE_SPACE_FIX = (
    "free some space or put the store on a larger disk, then rerun the same command: finished stages "
    "and saved checkpoints are kept"
)


def is_disk_full(error: BaseException | None) -> bool:
    """Whether ``error`` (or what caused it) is a write that found the disk full: an OSError
    ENOSPC or EDQUOT, or TensorStore's RESOURCE_EXHAUSTED from Orbax's writers."""
    import errno

    while error is not None:
        if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        text = str(error)
        if "No space left on device" in text or ("RESOURCE_EXHAUSTED" in text and "writ" in text.lower()):
            return True
        error = error.__cause__ or error.__context__
    return False


def require_space(folder, nbytes: int, what: str, overhead: int = 1 << 18) -> None:
    """Refuses, before writing, a write of about ``nbytes`` that ``folder``'s disk cannot hold:
    a full disk found midway by a checkpoint's background writers ends in pages of noise.
    ``overhead``: what the format adds beyond a tenth of ``nbytes``."""
    import shutil
    from pathlib import Path

    folder = Path(folder)
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    free = shutil.disk_usage(folder).free
    needed = int(nbytes * 1.1) + overhead  # the format's own files and metadata
    if free < needed:
        raise DiskFullError(
            f"no room for {what} in {folder}: it needs about {needed / 2**20:.1f} MiB and "
            f"{free / 2**20:.1f} MiB are free; {FREE_SPACE_FIX}"
        )
