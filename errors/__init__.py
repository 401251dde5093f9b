"""The one family of errors that bardflow explains.

An error of this family names the problem and the fix in its message: the command line
shows it as one ``bardflow: error: ...`` line (a traceback only with ``--debug``) and the
run's log keeps it without a traceback. Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import errno


class BardflowError(Exception):
    """An explained error: its message says what is wrong and what to do."""


class DistributedError(BardflowError, RuntimeError):
    """The processes cannot form one run; the message says which setting to fix."""


class StoreError(BardflowError, RuntimeError):
    """The store cannot be used as asked; the message names the path and the fix."""


class DiskFullError(BardflowError, OSError):
    """The disk under the store (or a checkpoint folder) has no room for what must be written."""


class NotWritableError(BardflowError, OSError):
    """The store (or a checkpoint folder in it) refuses writes: permissions, a read-only
    filesystem or an immutable flag."""


FREE_SPACE_FIX = (
    "free some space or put the store on a larger disk, then rerun the same command: finished stages "
    "and saved checkpoints are kept"
)


NOT_WRITABLE_FIX = (
    "make it writable or pick another with --store / BARDFLOW_STORE, then rerun the same command: finished "
    "stages and saved checkpoints are kept"
)

_REFUSED = {errno.EACCES, errno.EPERM, errno.EROFS}


def is_not_writable(error: BaseException | None) -> bool:
    """Whether ``error`` (or what caused it) is a write the filesystem refused."""
    while error is not None:
        if isinstance(error, OSError) and error.errno in _REFUSED:
            return True
        error = error.__cause__ or error.__context__
    return False


def require_writable(folder, what: str) -> None:
    """Refuses, before writing, a write into ``folder`` that the filesystem would refuse:
    Orbax's background writers meeting a read-only folder fail one by one while the others
    wait for them for the coordination timeout, and the process cannot exit meanwhile."""
    import uuid
    from pathlib import Path

    probe = Path(folder) / f".bardflow-probe-{uuid.uuid4().hex[:8]}"
    try:
        probe.mkdir()
        probe.rmdir()
    except OSError as error:
        if error.errno not in _REFUSED:
            raise
        raise NotWritableError(f"cannot write {what} to {folder} ({error.strerror}); {NOT_WRITABLE_FIX}") from error


def is_disk_full(error: BaseException | None) -> bool:
    """Whether ``error`` (or what caused it) is a write that found the disk full: an OSError
    ENOSPC or EDQUOT, or TensorStore's RESOURCE_EXHAUSTED from Orbax's writers."""
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


def file_kind(mode: int) -> str:
    """What a file that is not a regular one is, in words (for a refusal)."""
    import stat

    for test, name in (
        (stat.S_ISFIFO, "FIFO (named pipe)"),
        (stat.S_ISCHR, "character device"),
        (stat.S_ISBLK, "block device"),
        (stat.S_ISSOCK, "socket"),
        (stat.S_ISDIR, "folder"),
    ):
        if test(mode):
            return name
    return "special file"


class NotRegularFile(OSError):
    """A path that names a device, a FIFO, a socket or a folder where a file was asked for."""

    def __init__(self, kind: str):
        super().__init__(kind)
        self.kind = kind


def open_regular(path):
    """``path`` opened for reading if it is a regular file, else ``NotRegularFile`` (its kind in
    words); the open's own OSError otherwise. Opened without blocking (a FIFO would block its
    reader until a writer comes) and checked on the open file itself, so a file swapped for
    another kind after a look is refused too."""
    import os
    import stat

    descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    mode = os.fstat(descriptor).st_mode
    if not stat.S_ISREG(mode):
        os.close(descriptor)
        raise NotRegularFile(file_kind(mode))
    return os.fdopen(descriptor, "rb")
