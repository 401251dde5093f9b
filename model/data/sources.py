"""Where a corpus comes from, checked before anything reads it: a download, or local files
that must be regular files (a device or a FIFO would be read for ever or block) and, for a
folder, files within it; and how its bytes are read: compressed files (``.gz``, ``.xz``,
``.zst``, ``.zip``) are decompressed as they stream. Light to import (no JAX, no Prefect):
the command line checks a corpus with it before the run's server starts."""

from __future__ import annotations

import fnmatch
import hashlib
import os
import stat
import urllib.parse
import urllib.request
from collections.abc import Iterable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Protocol

from ...config.settings import TINYSHAKESPEARE_URL, CorpusFigures
from ...errors import BardflowError, NotRegularFile, file_kind, open_regular
from .splits import ThreadedDigest


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


COMPRESSED = (".gz", ".xz", ".zst")  # and .zip, an archive of members


def selected(relative: str, pattern: str | None) -> bool:
    """Whether a folder's file (its path within the folder) is part of the corpus: by default a
    ``.txt`` file, compressed or not; else whether it matches ``pattern`` (``data.glob``;
    ``**/`` matches any depth, the folder itself included)."""
    if pattern is None:
        name = relative.lower()
        for suffix in COMPRESSED:
            name = name.removesuffix(suffix)
        return name.endswith(".txt")
    return fnmatch.fnmatchcase(relative, pattern) or (
        pattern.startswith("**/") and fnmatch.fnmatchcase(relative, pattern[3:])
    )


def corpus_files(path: Path, pattern: str | None = None) -> list[Path]:
    """What a local corpus is made of: the file itself, or a folder's files that ``selected``
    takes (hidden ones left out), recursively, in sorted order of their paths within it. Only regular files are
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
            raise FetchError(
                f"corpus {path} is a {file_kind(mode)}, not a regular file; point --corpus at a text file "
                "or a folder of .txt files"
            )
        return [path]
    root = path.resolve()
    files = []
    for folder, subfolders, names in os.walk(path):  # symbolic links to folders are not entered
        subfolders[:] = [name for name in subfolders if not name.startswith(".")]
        for name in names:
            file = Path(folder) / name
            shown = file.relative_to(path).as_posix()
            if name.startswith(".") or not selected(shown, pattern):
                continue
            if file.is_symlink():
                target = file.resolve()
                if root not in target.parents:
                    raise FetchError(
                        f"corpus folder {path}: {shown} is a symbolic link to {target}, outside the "
                        "folder; a corpus folder is read only within itself: copy that file in, or "
                        "remove the link"
                    )
            try:
                mode = os.stat(file).st_mode
            except OSError:
                raise FetchError(
                    f"corpus folder {path}: {shown} is a broken link or cannot be read; remove it or "
                    "fix its permissions"
                ) from None
            if not stat.S_ISREG(mode):
                raise FetchError(
                    f"corpus folder {path}: {shown} is a {file_kind(mode)}, not a regular file; "
                    "remove it from the folder"
                )
            files.append(file)
    if not files:
        what = f"files matching data.glob={pattern!r}" if pattern else ".txt files (or .txt.gz, .txt.xz, .txt.zst)"
        raise FetchError(
            f"corpus folder {path} holds no {what}; put the text in such files, set data.glob to "
            "select the files (e.g. --set data.glob='**/*.md'), or point --corpus at one file"
        )
    return sorted(files, key=lambda p: p.relative_to(path).as_posix())


def open_corpus_file(file: Path):
    """``file`` opened for reading, refused unless it is a regular file (``open_regular``), so
    a file swapped for another kind after ``corpus_files`` looked is refused too."""
    try:
        return open_regular(file)
    except NotRegularFile as refused:
        raise FetchError(
            f"corpus {file} is a {refused.kind}, not a regular file; point --corpus at a text file or "
            "a folder of .txt files"
        ) from None
    except PermissionError as error:
        raise FetchError(f"corpus file {file} is not readable; fix its permissions") from error
    except OSError as error:  # a socket cannot be opened (ENXIO)
        raise FetchError(
            f"corpus {file} cannot be opened as a file ({error.strerror}); point --corpus at a text "
            "file or a folder of .txt files"
        ) from error


class _Counting:
    """A binary file that counts what is read from it: the raw bytes of a compressed file as
    its decompressor pulls them (for progress)."""

    def __init__(self, handle):
        self.handle, self.read_bytes = handle, 0

    def read(self, size: int = -1) -> bytes:
        data = self.handle.read(size)
        self.read_bytes += len(data)
        return data

    def readinto(self, buffer) -> int:
        data = self.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)

    def readable(self) -> bool:
        return True

    def __getattr__(self, name):  # seek, tell, seekable, close: the file's own
        return getattr(self.handle, name)


def decompressed(file: Path, handle, name: str | None = None) -> Iterator[bytes]:
    """The bytes a file holds, decompressed by its name's suffix (``name``: the name to go by,
    for a download), a MiB at a time; a damaged archive is one line naming it."""
    name = (name or file.name).lower()
    try:
        if name.endswith(".zip"):
            import zipfile

            with zipfile.ZipFile(handle) as archive:
                members = sorted((m for m in archive.infolist() if not m.is_dir()), key=lambda m: m.filename)
                if not members:
                    raise FetchError(f"the archive {file} holds no files; point --corpus at one that holds the text")
                for member in members:
                    with archive.open(member) as stream:
                        while chunk := stream.read(1 << 20):
                            yield chunk
            return
        if name.endswith(".gz"):
            import gzip

            stream = gzip.GzipFile(fileobj=handle, mode="rb")
        elif name.endswith(".xz"):
            import lzma

            stream = lzma.LZMAFile(handle)
        elif name.endswith(".zst"):
            try:
                import zstandard
            except ImportError:
                raise FetchError(
                    f"{file} is zstd-compressed, and reading it needs the zstandard package: pip "
                    "install 'bardflow[zstd]', or decompress it first (zstd -d)"
                ) from None
            stream = zstandard.ZstdDecompressor().stream_reader(handle, read_across_frames=True)
        else:
            stream = handle
        while chunk := stream.read(1 << 20):
            yield chunk
    except FetchError:
        raise
    except (OSError, EOFError, ValueError, RuntimeError) as error:  # gzip, lzma, zstd and zipfile's own kinds
        if isinstance(error, PermissionError):
            raise
        kind = name.rsplit(".", 1)[-1]
        raise FetchError(
            f"{file} could not be read as a .{kind} file ({error.__class__.__name__}: {error}); it is "
            "damaged or not what its name says: fetch it again or rename it"
        ) from error


def decoded_chunks(files: list[Path], counted=None) -> Iterator[bytes]:
    """The corpus's bytes: each file's content, decompressed, in order; ``counted(n)`` hears
    how many of the files' own bytes have been read so far."""
    done = 0
    for file in files:
        with open_corpus_file(file) as handle:
            raw = _Counting(handle)
            for chunk in decompressed(file, raw):
                if counted is not None:
                    counted(done + raw.read_bytes)
                yield chunk
            done += os.fstat(handle.fileno()).st_size


def md5_of(chunks: Iterable[bytes]) -> str:
    """md5 of a corpus's bytes (``decoded_chunks`` or ``BucketCorpus.chunks``): its checksum,
    the one a publisher gives for the text (enwik8's for the member of enwik8.zip)."""
    digest = hashlib.md5()
    for chunk in chunks:
        digest.update(chunk)
    return digest.hexdigest()


def is_bucket(source: str) -> bool:
    """Whether ``source`` is an object-store prefix (``s3://bucket/prefix``, ``gs://…``)."""
    return source.split("://", 1)[0] in ("s3", "gs", "gcs") and "://" in source


class ObjectBucket(Protocol):
    """What a corpus in a bucket is read through (``artifacts/objects.py``'s ``Bucket``): its
    fsspec filesystem, its prefix there, and one-line errors for what goes wrong."""

    fs: Any
    prefix: str

    def errors(self, doing: str) -> AbstractContextManager[None]: ...

    def path(self, *parts: str) -> str: ...

    def uri(self, *parts: str) -> str: ...


class BucketCorpus:
    """A bucket prefix's objects that ``selected`` takes (hidden ones left out), sorted by
    their keys below the prefix, read as one corpus, each decompressed by its name."""

    def __init__(self, bucket: ObjectBucket, source: str, pattern: str | None = None):
        self.bucket, self.source = bucket, source
        with self.bucket.errors(f"list the corpus at {source}"):
            found = self.bucket.fs.find(self.bucket.prefix, detail=True)
        base = self.bucket.prefix + "/"
        keys = {
            key.removeprefix(base): int(info.get("size") or 0)
            for key, info in found.items()
            if key.startswith(base) and info.get("type", "file") == "file"
        }
        self.objects = sorted(
            (name, size)
            for name, size in keys.items()
            if not any(part.startswith(".") for part in name.split("/")) and selected(name, pattern)
        )
        if not self.objects:
            what = (
                f"objects matching data.glob={pattern!r}" if pattern else ".txt objects (or .txt.gz, .txt.xz, .txt.zst)"
            )
            raise FetchError(
                f"the corpus prefix {source} holds no {what}; check the prefix, or set data.glob to "
                "select the objects (e.g. --set data.glob='**/*.md')"
            )

    @property
    def size(self) -> int:
        return sum(size for _, size in self.objects)

    def chunks(self, counted=None) -> Iterator[bytes]:
        done = 0
        for name, size in self.objects:
            with (
                self.bucket.errors(f"read {self.bucket.uri(name)}"),
                self.bucket.fs.open(self.bucket.path(name), "rb") as handle,
            ):
                raw = _Counting(handle)
                for chunk in decompressed(Path(name), raw, name):
                    if counted is not None:
                        counted(done + raw.read_bytes)
                    yield chunk
            done += size


def source_mode(files: list[Path]) -> int:
    """The permissions a stored copy of ``files`` may have: none for group or others that
    any of them lacks (the owner keeps read and write)."""
    mode = 0o666
    for file in files:
        mode &= os.stat(file).st_mode
    return (mode & 0o066) | 0o600


def check_local(source: str, pattern: str | None = None) -> None:
    """Refuses, in one line, a local corpus that cannot be read as one (missing, a device, a
    FIFO, a link out of its folder) without reading it; a download is checked as it arrives."""
    path = local_path(source)
    if path is not None:
        corpus_files(path, pattern)


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

    def figures(self) -> CorpusFigures:
        if self.md5 is None:
            raise RuntimeError("a sha256-only digest has no md5")
        return CorpusFigures(self.md5.hexdigest(), self.sha256.hexdigest(), self.size, self.seen)

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
