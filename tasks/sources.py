"""Where a corpus comes from, checked before anything reads it: a download, or local files
that must be regular files (a device or a FIFO would be read for ever or block) and, for a
folder, files within it. Light to import (no JAX, no Prefect): the command line checks a
corpus with it before the run's server starts."""

from __future__ import annotations

import os
import stat
import urllib.parse
import urllib.request
from pathlib import Path

from ..model.config import TINYSHAKESPEARE_URL
from ..model.errors import BardflowError


class FetchError(BardflowError, RuntimeError):
    """The corpus could not be fetched or is not the expected file."""


def corpus_name(source: str) -> str:
    """A corpus as its source names it: the default download is TinyShakespeare, anything else
    its file or folder name."""
    if source == TINYSHAKESPEARE_URL:
        return "TinyShakespeare"
    return source.rstrip("/").rsplit("/", 1)[-1] or source


def local_path(source: str) -> Path | None:
    """The file or folder a path or file:// source names; None for a download."""
    parsed = urllib.parse.urlparse(source)
    if parsed.scheme == "file":
        return Path(urllib.request.url2pathname(parsed.path))
    if parsed.scheme == "" or len(parsed.scheme) == 1:  # a path (or a Windows drive letter)
        return Path(source).expanduser()
    return None


def _kind(mode: int) -> str:
    """What a file that is not a regular one is, in words."""
    for test, name in ((stat.S_ISFIFO, "FIFO (named pipe)"), (stat.S_ISCHR, "character device"),
                       (stat.S_ISBLK, "block device"), (stat.S_ISSOCK, "socket"), (stat.S_ISDIR, "folder")):
        if test(mode):
            return name
    return "special file"


def corpus_files(path: Path) -> list[Path]:
    """What a local corpus is made of: the file itself, or a folder's ``.txt`` files
    (hidden ones left out) in sorted order of their names within it. Only regular files are
    read: a device or a FIFO (``/dev/zero``, ``mkfifo``) would be read for ever or block, and
    a folder's symbolic link that leads out of the folder is refused, so that a corpus folder
    never publishes a file from elsewhere (``/etc/shadow``) into the store."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise FetchError(f"corpus file {path} does not exist; check --corpus / BARDFLOW_CORPUS") from None
    except PermissionError:
        raise FetchError(f"corpus file {path} is not readable; fix its permissions") from None
    if not stat.S_ISDIR(mode):
        if not stat.S_ISREG(mode):
            raise FetchError(f"corpus {path} is a {_kind(mode)}, not a regular file; point --corpus at a text file "
                             "or a folder of .txt files")
        return [path]
    root = path.resolve()
    files = []
    for folder, subfolders, names in os.walk(path):  # symbolic links to folders are not entered
        subfolders[:] = [name for name in subfolders if not name.startswith(".")]
        for name in names:
            if not name.endswith(".txt") or name.startswith("."):
                continue
            file = Path(folder) / name
            shown = file.relative_to(path).as_posix()
            if file.is_symlink():
                target = file.resolve()
                if root not in target.parents:
                    raise FetchError(f"corpus folder {path}: {shown} is a symbolic link to {target}, outside the "
                                     "folder; a corpus folder is read only within itself: copy that file in, or "
                                     "remove the link")
            try:
                mode = os.stat(file).st_mode
            except OSError:
                raise FetchError(f"corpus folder {path}: {shown} is a broken link or cannot be read; remove it or "
                                 "fix its permissions") from None
            if not stat.S_ISREG(mode):
                raise FetchError(f"corpus folder {path}: {shown} is a {_kind(mode)}, not a regular file; remove it "
                                 "from the folder")
            files.append(file)
    if not files:
        raise FetchError(f"corpus folder {path} holds no .txt files; put the text in .txt files or point "
                         "--corpus at one file")
    return sorted(files, key=lambda p: p.relative_to(path).as_posix())


def open_regular(file: Path):
    """``file`` opened for reading, refused unless it is a regular file: checked on the open
    file itself (a FIFO opened without O_NONBLOCK would block before any check could run),
    so a file swapped for another kind after ``corpus_files`` looked is refused too."""
    try:
        descriptor = os.open(file, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except PermissionError as error:
        raise FetchError(f"corpus file {file} is not readable; fix its permissions") from error
    except OSError as error:  # a socket cannot be opened (ENXIO)
        raise FetchError(f"corpus {file} cannot be opened as a file ({error.strerror}); point --corpus at a text "
                         "file or a folder of .txt files") from error
    mode = os.fstat(descriptor).st_mode
    if not stat.S_ISREG(mode):
        os.close(descriptor)
        raise FetchError(f"corpus {file} is a {_kind(mode)}, not a regular file; point --corpus at a text file or "
                         "a folder of .txt files")
    return os.fdopen(descriptor, "rb")


def chunks(files: list[Path]):
    """The bytes of ``files`` in order, a MiB at a time."""
    for file in files:
        with open_regular(file) as handle:
            while chunk := handle.read(1 << 20):
                yield chunk


def source_mode(files: list[Path]) -> int:
    """The permissions a stored copy of ``files`` may have: none for group or others that
    any of them lacks (the owner keeps read and write)."""
    mode = 0o666
    for file in files:
        mode &= os.stat(file).st_mode
    return (mode & 0o066) | 0o600


def check_local(source: str) -> None:
    """Refuses, in one line, a local corpus that cannot be read as one (missing, a device, a
    FIFO, a link out of its folder) without reading it; a download is checked as it arrives."""
    path = local_path(source)
    if path is not None:
        corpus_files(path)
