"""A store of immutable, content-checked stage versions: on disk here, on object
storage in ``artifacts/objects.py`` (same methods; ``objects.open_store`` picks by location).

Layout: ``<root>/<stage>/<key>/`` holds one version: its files and ``manifest.json``.
A version is built under ``<root>/<stage>/.build-<key>-<nonce>/`` and renamed into
place only once complete and checksummed, so a reader never sees half of one.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import fcntl
import hashlib
import json
import os
import re
import shutil
import socket
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from ..errors import NOT_WRITABLE_FIX, StoreError
from .manifest import (
    FileEntry,
    Manifest,
    Metrics,
    canonical_json,
    library_versions,
    manifest_digest,
    manifest_intact,
    on_demand,
    project_version,
)
from .resume import ResumeFolder

MANIFEST = "manifest.json"
_NAME = re.compile(r"^[a-z][a-z0-9_]{0,63}$")
_KEY = re.compile(r"^[0-9a-f]{20}$")


_cleanups: list[Callable[[], None]] = []  # this process's build folders and lock files, while it has them


@contextlib.contextmanager
def _unfinished(cleanup: Callable[[], None]) -> Iterator[None]:
    _cleanups.append(cleanup)
    try:
        yield
    finally:
        _cleanups.remove(cleanup)


def abandon_unfinished() -> None:
    """Removes the build folders and lock files this process holds, for an end that skips
    every ``finally`` (a forced stop: processes/stopping.py): a failed run leaves none behind."""
    for cleanup in reversed(list(_cleanups)):
        try:
            cleanup()
        except OSError:
            pass


def valid_stage(stage: str) -> str:
    if not _NAME.match(stage):
        raise StoreError(f"invalid stage name {stage!r}: use lowercase letters, digits and _")
    return stage


def valid_key(key: str) -> str:
    if not _KEY.match(key):
        raise StoreError(f"invalid version key {key!r}: expected 20 hex digits")
    return key


def file_digest(path: Path, algorithm: str = "sha256") -> str:
    with open(path, "rb") as handle:
        return hashlib.file_digest(handle, algorithm).hexdigest()


# The sha256 of each file this process has read or written, with the file's stat as it
# was: a version looked up again (every stage that reads it checks it, and a build is looked
# up once published) is not read again while its files are unchanged. Any write changes a
# file's ctime, which no tool can set back. A file read within seconds of its last write is
# not remembered, since a second write in the same clock tick would leave its times as they
# were (git's "racy" rule); a file this process hashed as it wrote it is, as the writes
# were all its own and done.
_HASHED: dict[tuple[int, int], tuple[tuple[int, int, int], str]] = {}
SETTLED_NS = 2_000_000_000


def file_identity(stat: os.stat_result) -> tuple[tuple[int, int], tuple[int, int, int]]:
    return (stat.st_dev, stat.st_ino), (stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns)


def stored_digest(path: Path) -> str:
    """The sha256 of the file at ``path``, read only if it changed since this process read
    or wrote it."""
    stat = path.stat()
    identity, times = file_identity(stat)
    known = _HASHED.get(identity)
    if known is not None and known[0] == times:
        return known[1]
    digest = file_digest(path)
    if time.time_ns() - max(stat.st_mtime_ns, stat.st_ctime_ns) > SETTLED_NS:
        _HASHED[identity] = (times, digest)
    return digest


def describe_files(folder: Path, known: dict[str, FileEntry] | None = None) -> dict[str, FileEntry]:
    """Size and sha256 of every file under ``folder``, by relative name: a manifest's ``files``.
    ``known``: digests a builder took as it wrote (a file of that size is not read again, and
    this process remembers it as hashed)."""
    described = {}
    for p in sorted(folder.rglob("*")):
        if p.is_file():
            name, stat = p.relative_to(folder).as_posix(), p.stat()
            entry = (known or {}).get(name)
            if entry is not None and entry["bytes"] == stat.st_size:
                identity, times = file_identity(stat)
                _HASHED[identity] = (times, entry["sha256"])
            else:
                entry = FileEntry(bytes=stat.st_size, sha256=file_digest(p))
            described[name] = entry
    return described


@dataclass(frozen=True)
class Version:
    """A handle on one complete version: what a stage hands the stages that read it."""

    stage: str
    key: str
    path: Path  # on this machine (for an object store: its verified local mirror)
    manifest: Manifest
    uri: str = ""  # where the store keeps it, when that is not ``path`` (s3://…)
    store: str = ""  # the location of the store that holds it
    same_as_stored: bool = False  # built again (a refresh) with the stored version's output: that one was kept
    # Brings files the store left where it keeps them (the manifest's ``on_demand`` folders)
    # to ``path``, verified; None where every file is already here (a local store).
    fetch: Callable[[list[str]], None] | None = field(default=None, compare=False, repr=False)

    @property
    def location(self) -> str:
        return self.uri or str(self.path)

    @property
    def fingerprint(self) -> str:
        return self.manifest["fingerprint"]

    @property
    def metrics(self) -> Metrics:
        return self.manifest.get("metrics", {})

    def file(self, name: str) -> Path:
        return self.path / name

    def bring(self, path: Path) -> None:
        """Makes sure the file at ``path`` (in this version) is here: an object store's mirror
        fetches an ``on_demand`` file the first time a reader opens it."""
        if self.fetch is not None and not path.exists():
            self.fetch([path.relative_to(self.path).as_posix()])


class Builder:
    """Collects what a stage writes into its build folder."""

    def __init__(self, stage: str, key: str, directory: Path, resume: ResumeFolder):
        self.stage, self.key, self.dir = stage, key, directory
        self.resume = resume
        self.metrics: Metrics = {}
        self.record: Metrics = {}  # what the stage records of itself in the manifest (open, as its figures)
        self.digests: dict[str, FileEntry] = {}  # taken while writing
        # Folders whose files a reader may need only some of (a split's shards): an object
        # store's mirror fetches each when it is first read, not with the version.
        self.on_demand: list[str] = []
        self.fingerprint: str | None = None
        self.same_as_stored = False  # the build's output was the stored version's: that one stays

    def path(self, name: str) -> Path:
        target = (self.dir / name).resolve()
        if self.dir.resolve() not in target.parents:
            raise StoreError(f"output name {name!r} leaves the version folder")
        target.parent.mkdir(parents=True, exist_ok=True)
        return target


class VersionStore(abc.ABC):
    """What the stages need of a store: versions looked up, checked and produced. ``produce``
    is written once, here; a backend (a folder, a bucket) supplies its lookup, its lock and
    how a sealed build becomes the version (a rename; an upload and a conditional write)."""

    location: str
    reads_without_lock = False  # whether a lookup may run beside a builder of the same version

    @abc.abstractmethod
    def check(self) -> None:
        """Raises, naming the fix, if the store cannot be used at all (before any work)."""

    @abc.abstractmethod
    def lookup(self, stage: str, key: str) -> Version | None:
        """The version if it is there and intact, else None."""

    @abc.abstractmethod
    def remains(self, stage: str, key: str, force: bool) -> bool:
        """Whether something of this version is already there (damaged, or being replaced)."""

    @abc.abstractmethod
    def lock(self, stage: str, key: str) -> contextlib.AbstractContextManager:
        """Serialises this machine's builders of one version."""

    @abc.abstractmethod
    def resume(self, stage: str, key: str) -> ResumeFolder:
        """Where an interrupted build of the version keeps what a rerun picks up."""

    @abc.abstractmethod
    def clear_leftovers(self, stage: str, key: str) -> None:
        """Removes what builders that died left of this version; callers hold the lock."""

    @abc.abstractmethod
    def build(
        self, stage: str, key: str, params: Any, inputs: Mapping[str, Version], resume: ResumeFolder, force: bool
    ) -> contextlib.AbstractContextManager[Builder]:
        """A builder over a private folder, made the version when the block ends without error."""

    @abc.abstractmethod
    def versions(self, stage: str | None = None) -> list[Version]:
        """Every complete version (of ``stage``), newest first."""

    def require(self, handed: Version) -> Version:
        """A version a stage was handed, checked again before use: still there, every file
        as its manifest says, the same output it was when handed over."""
        version = self.lookup(handed.stage, handed.key)
        if version is None or version.fingerprint != handed.fingerprint:
            raise StoreError(
                f"the {handed.stage} version {handed.key} in {self.location} is "
                f"missing or damaged; rerun with --refresh {handed.stage}"
            )
        return version

    def produce(
        self,
        stage: str,
        key: str,
        params: Any,
        inputs: Mapping[str, Version],
        work: Callable[[Builder], None],
        force: bool = False,
        notice: Callable[[str], None] | None = None,
    ) -> tuple[Version, bool]:
        """The version ``stage/key``: reused if a complete one exists (unless ``force``),
        else built by ``work`` and made the version. Returns it and whether ``work`` ran.
        ``notice`` hears of a damaged version about to be rebuilt."""
        if not force and self.reads_without_lock:
            existing = self.lookup(stage, key)
            if existing is not None:
                return existing, False
        with self.lock(stage, key):
            existing = self.lookup(stage, key)
            if existing is not None and not force:
                return existing, False
            if existing is None and notice is not None and self.remains(stage, key, force):
                notice(f"{stage} version {key} in {self.location} is damaged or incomplete: rebuilding it")
            self.clear_leftovers(stage, key)
            resume = self.resume(stage, key)
            resume.pull()
            try:
                with self.build(stage, key, params, inputs, resume, force) as builder:
                    work(builder)
            except BaseException:
                resume.drop_if_empty()  # a failed run leaves only what a rerun needs
                raise
            version = self.lookup(stage, key)
            if version is None:
                raise StoreError(f"the {stage} version {key} did not verify after it was written to {self.location}")
            resume.clear()
            if builder.same_as_stored:
                version = dataclasses.replace(version, same_as_stored=True)
            return version, True


class Store(VersionStore):
    """The store in a local folder: a version is published by renaming its build folder."""

    # Reading a published version needs no lock: it appears whole (a rename) or not at all.
    # So a store this process cannot write still serves what it holds.
    reads_without_lock = True

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root).expanduser().resolve()
        self.location = str(self.root)

    def _stage_dir(self, stage: str) -> Path:
        return self.root / valid_stage(stage)

    def path(self, stage: str, key: str) -> Path:
        return self._stage_dir(stage) / valid_key(key)

    def check(self) -> None:
        """Nothing to check ahead for a folder: a write names any problem with it."""

    def resume(self, stage: str, key: str) -> ResumeFolder:
        """Where an interrupted build of ``stage/key`` keeps what it needs to pick up again.
        Stable across processes (unlike build folders); removed once the version is published."""
        return ResumeFolder(self.path(stage, key).parent / f".resume-{key}")

    def lookup(self, stage: str, key: str, partial: bool = False) -> Version | None:
        """The version if it exists and every file matches its manifest, else None.
        ``partial`` (a mirror's copy): its ``on_demand`` files may be absent."""
        path = self.path(stage, key)
        try:
            manifest = json.loads((path / MANIFEST).read_text())
        except (OSError, ValueError):
            return None
        if (
            manifest.get("key") != key
            or not manifest_intact(manifest)
            or self.damage(
                path, manifest.get("files", {}), (lambda name: on_demand(manifest, name)) if partial else None
            )
        ):
            return None
        return Version(stage, key, path, manifest, store=self.location)

    @staticmethod
    def damage(
        path: Path, files: Mapping[str, FileEntry], may_be_absent: Callable[[str], bool] | None = None
    ) -> list[str]:
        """Names of ``files`` (a manifest's) that are missing, resized or changed since they were
        described; a file ``may_be_absent`` says of (an ``on_demand`` one) may be missing."""
        bad = []
        for name, entry in files.items():
            file = path / name
            if may_be_absent is not None and may_be_absent(name) and not file.exists():
                continue
            try:
                if file.stat().st_size != entry["bytes"] or stored_digest(file) != entry["sha256"]:
                    bad.append(name)
            except OSError:
                bad.append(name)
        return bad

    @contextlib.contextmanager
    def lock(self, stage: str, key: str) -> Iterator[None]:
        """Serialises builders of the same version across processes."""
        stage_dir = self._stage_dir(stage)
        try:
            stage_dir.mkdir(parents=True, exist_ok=True)
            handle = open(stage_dir / f".lock-{key}", "a+")
        except OSError as error:
            raise StoreError(
                f"cannot write to the store at {self.root} ({error.strerror}); {NOT_WRITABLE_FIX}"
            ) from error
        path = stage_dir / f".lock-{key}"
        mine = [handle]

        def let_go() -> None:  # a forced end (processes/stopping.py) skips the finally below
            with contextlib.suppress(OSError):  # a store turned read-only: the next builder removes it
                if os.stat(path).st_ino == os.fstat(mine[0].fileno()).st_ino:
                    path.unlink(missing_ok=True)

        while True:  # the holder before us may have removed the file we waited on: lock a fresh one
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                if os.stat(path).st_ino == os.fstat(handle.fileno()).st_ino:
                    break
            except FileNotFoundError:
                pass
            handle.close()
            handle = open(path, "a+")
            mine[0] = handle
        try:
            with _unfinished(let_go):
                yield
        finally:
            with contextlib.suppress(OSError):  # no lock file outlives its holder, but in a read-only store
                path.unlink(missing_ok=True)
            fcntl.flock(handle, fcntl.LOCK_UN)
            handle.close()

    def remains(self, stage: str, key: str, force: bool) -> bool:
        return self.path(stage, key).exists()

    def clear_leftovers(self, stage: str, key: str) -> None:
        """Build and download folders of ``stage/key`` left by a process that died; callers hold the lock."""
        for pattern in (f".build-{key}-*", f".pull-{key}-*"):
            for stale in self.path(stage, key).parent.glob(pattern):
                shutil.rmtree(stale, ignore_errors=True)

    def build(
        self,
        stage: str,
        key: str,
        params: Any,
        inputs: Mapping[str, Version],
        resume: ResumeFolder,
        force: bool = False,
    ) -> contextlib.AbstractContextManager[Builder]:
        return self.build_folder(stage, key, params, inputs, resume)

    @contextlib.contextmanager
    def build_folder(
        self,
        stage: str,
        key: str,
        params: Any,
        inputs: Mapping[str, Version],
        resume: ResumeFolder | None = None,
        commit: Callable[[Path], bool] | None = None,
    ) -> Iterator[Builder]:
        """Yields a builder over a private folder; on success publishes it as the version.

        If the stage fails, the folder is removed and any earlier version stays as it was.
        Callers that may race hold ``lock(stage, key)`` (``produce`` does). ``commit``, if
        given, hears of the sealed folder first and says whether to publish it here too
        (an object store commits it to its bucket, and may find another build was first).
        """
        final = self.path(stage, key)
        scratch = final.parent / f".build-{key}-{uuid.uuid4().hex[:8]}"
        try:
            scratch.mkdir(parents=True)
        except OSError as error:
            raise StoreError(
                f"cannot write to the store at {self.root} ({error.strerror}); {NOT_WRITABLE_FIX}"
            ) from error
        builder = Builder(stage, key, scratch, resume or self.resume(stage, key))
        try:
            with _unfinished(lambda: shutil.rmtree(scratch, ignore_errors=True)):
                yield builder
                self._seal(builder, params, inputs)
                if commit is None or commit(scratch):
                    published = self._publish(scratch, final)
                    # Here, the stored version was kept; a bucket's commit (above) may have
                    # repaired its copy there, which is news, not "the same".
                    builder.same_as_stored = commit is None and not published
        finally:
            shutil.rmtree(scratch, ignore_errors=True)

    def _seal(self, builder: Builder, params: Any, inputs: Mapping[str, Version]) -> None:
        files = describe_files(builder.dir, builder.digests)
        fingerprint = (
            builder.fingerprint
            or hashlib.sha256(canonical_json({n: f["sha256"] for n, f in files.items()}).encode()).hexdigest()
        )
        # The stage's own record (open, as its figures) among the fixed fields.
        manifest = cast(
            Manifest,
            {
                "stage": builder.stage,
                "key": builder.key,
                "fingerprint": fingerprint,
                "inputs": {
                    name: {"stage": up.stage, "key": up.key, "fingerprint": up.fingerprint}
                    for name, up in inputs.items()
                },
                "params": params,
                "files": files,
                "metrics": builder.metrics,
                **({"on_demand": sorted(builder.on_demand)} if builder.on_demand else {}),
                **builder.record,
                "libraries": library_versions(),
                "bardflow": project_version(),
                "host": socket.gethostname(),
                "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            },
        )
        manifest["digest"] = manifest_digest(manifest)  # a hand edit of any figure is noticed
        manifest_path = builder.dir / MANIFEST
        with open(manifest_path, "w") as handle:
            json.dump(manifest, handle, indent=2, sort_keys=True, default=str)
            handle.flush()
            os.fsync(handle.fileno())

    def _publish(self, scratch: Path, final: Path) -> bool:
        """Makes the build the version; False when the version in place has the same output
        and is kept as it is."""
        if final.exists():
            previous = self.lookup(final.parent.name, final.name)
            fresh = json.loads((scratch / MANIFEST).read_text())
            if previous is not None and previous.fingerprint == fresh["fingerprint"]:
                return False  # same output as the version in place: keep that one untouched
            # A refresh of the same recipe, or a damaged version being rebuilt: keep the old
            # folder out of the way rather than deleting anything a user might still want.
            aside = final.parent / ".replaced" / f"{final.name}-{time.strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:6]}"
            aside.parent.mkdir(exist_ok=True)
            os.rename(final, aside)
        os.rename(scratch, final)
        return True

    def versions(self, stage: str | None = None) -> list[Version]:
        """Every complete version in the store, newest first."""
        found = []
        stages = [stage] if stage else sorted(p.name for p in self.root.glob("*") if p.is_dir() and _NAME.match(p.name))
        for name in stages:
            for path in self._stage_dir(name).glob("*"):
                if not _KEY.match(path.name):
                    continue
                try:
                    manifest = json.loads((path / MANIFEST).read_text())
                except (OSError, ValueError):
                    continue
                if manifest_intact(manifest):  # an edited manifest's figures are not shown as the stage's
                    found.append(Version(name, path.name, path, manifest, store=self.location))
        return sorted(found, key=lambda v: v.manifest.get("created", ""), reverse=True)
