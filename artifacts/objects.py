"""The store on object storage (``s3://bucket/prefix``, ``gs://…``): the bucket is the
source of truth, and each machine keeps a verified local mirror of what it reads.

Object stores have no rename and no locks, so a version is committed differently than on
disk (``artifacts/store.py``):

* its files go first, under a prefix of their own build (``<stage>/<key>/<build>/<file>``);
* its manifest goes last, at ``<stage>/<key>/manifest.json``, with a conditional write
  (create only if absent). The manifest is the commit record: a version without one is
  invisible, and a builder that commits removes every build prefix the manifest does not
  name (what crashed or lost builders left);
* two builders of the same version on two machines may both build, but only the first
  manifest is committed; the other builder drops its objects and uses the committed
  version. On one machine, builders wait for each other on the mirror's lock;
* every object is checked against the manifest's sha256 as it is downloaded, and the
  mirror's copy again on every lookup; the files of a manifest's ``on_demand`` folders (a
  split's shards) are fetched one by one as a reader first opens them (``Version.bring``),
  so a worker holds the shards it reads, not the whole split; an object replaced in the bucket changes its ETag,
  which the mirror compares on each lookup, so a damaged object is noticed and rebuilt.

Resumable training checkpoints are staged by Orbax in the mirror and copied to
``<stage>/.resume-<key>/<step>/`` once complete (``<step>.json`` last, as its commit record),
so a run killed on one machine resumes on another. The file-system layer is fsspec (s3fs,
gcsfs), which takes endpoints and credentials the standard way (``AWS_ENDPOINT_URL``,
``AWS_ACCESS_KEY_ID`` … or a profile).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import uuid
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, cast

from typing_extensions import TypedDict

from ..errors import StoreError
from .manifest import FileEntry, Manifest, manifest_intact, on_demand
from .resume import ResumeFolder
from .store import MANIFEST, Builder, Store, Version, VersionStore, describe_files, valid_key, valid_stage

SCHEMES = ("s3", "gs", "gcs")
REMOTE = "remote.json"  # in a mirrored version: the URI and the ETags it was downloaded with
WORKDIR = "BARDFLOW_WORKDIR"
_PARALLEL = 8  # objects moved at once


def is_remote(location: str | os.PathLike) -> bool:
    return str(location).split("://", 1)[0] in SCHEMES and "://" in str(location)


def default_workdir() -> Path:
    """Where this machine mirrors what it reads from object stores, one folder per store."""
    base = os.environ.get(WORKDIR)
    if base:
        return Path(base).expanduser().resolve()
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "bardflow" / "mirror"


class ObjectStoreError(StoreError):
    """The object store cannot be reached or used; the message names the problem and the fix."""


@functools.lru_cache(maxsize=8)
def _filesystem(scheme: str, environment: tuple):
    """One client per scheme and configuration (``environment``: the variables it reads),
    reused by every store of the process: a client costs a session and its connections."""
    import fsspec

    options: dict[str, Any] = {"skip_instance_cache": True, "use_listings_cache": False}
    if scheme == "s3":
        # Fail in seconds, not minutes, when the endpoint is down; retry throttling.
        options["config_kwargs"] = {
            "connect_timeout": 5,
            "read_timeout": 60,
            "retries": {"max_attempts": 3, "mode": "standard"},
        }
    return fsspec.filesystem(scheme, **options)


def _no_such_bucket(error: BaseException) -> bool:
    """Whether S3 itself answered NoSuchBucket (s3fs keeps botocore's error as the cause);
    cheaper than asking the bucket, for the common "no such object" of a lookup."""
    cause = error.__cause__ or error.__context__
    code = getattr(cause, "response", {}).get("Error", {}).get("Code") if cause is not None else None
    return code == "NoSuchBucket"


class Bucket:
    """One ``scheme://bucket/prefix`` through fsspec, with its failures translated into
    one-line errors. Paths given to its methods are relative to the prefix."""

    def __init__(self, url: str):
        scheme, _, rest = url.partition("://")
        self.scheme = "gs" if scheme == "gcs" else scheme
        self.url = f"{self.scheme}://{rest.strip('/')}"
        self.bucket, _, prefix = rest.strip("/").partition("/")
        self.prefix = f"{self.bucket}/{prefix}".rstrip("/")
        try:
            self.fs = _filesystem(self.scheme, _credentials())
        except ImportError as error:
            package = {"s3": "s3fs", "gs": "gcsfs"}.get(self.scheme, "an fsspec implementation")
            raise ObjectStoreError(f"the store {self.url} needs {package}: pip install {package}") from error

    def path(self, *parts: str) -> str:
        return "/".join([self.prefix, *(part for part in parts if part)])

    def uri(self, *parts: str) -> str:
        return f"{self.scheme}://{self.path(*parts)}"

    def endpoint(self) -> str:
        if self.scheme != "s3":
            return f"{self.scheme}://"
        return os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or "the default AWS endpoint"

    @contextlib.contextmanager
    def errors(self, doing: str) -> Iterator[None]:
        """Translates what fsspec and botocore raise into one line that names the fix."""
        try:
            yield
        except ObjectStoreError:
            raise
        except FileNotFoundError as error:
            if self.missing():
                raise ObjectStoreError(
                    f"the bucket {self.bucket!r} does not exist at {self.endpoint()} (while {doing}); "
                    f"create it (e.g. `aws s3 mb {self.scheme}://{self.bucket}`) or fix --store / BARDFLOW_STORE"
                ) from error
            raise
        except PermissionError as error:
            raise ObjectStoreError(
                f"{self.endpoint()} refused access to {self.url} while {doing} ({error}); check the "
                "credentials: AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or AWS_PROFILE (GOOGLE_APPLICATION_"
                "CREDENTIALS for gs://)"
            ) from error
        except Exception as error:
            name = type(error).__name__
            if name in ("NoCredentialsError", "PartialCredentialsError"):
                raise ObjectStoreError(
                    f"no credentials for {self.url}: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE"
                ) from error
            if name in (
                "EndpointConnectionError",
                "ConnectTimeoutError",
                "ClientConnectorError",
                "ConnectionError",
                "ReadTimeoutError",
            ) or isinstance(error, (ConnectionError, TimeoutError)):
                raise ObjectStoreError(
                    f"cannot reach the object store at {self.endpoint()} while {doing} ({error}); check "
                    "AWS_ENDPOINT_URL (or AWS_ENDPOINT_URL_S3) and that the server is up"
                ) from error
            raise

    def missing(self) -> bool:
        """Whether the bucket itself is gone, asked of the bucket: a "not found" for a path in
        it says nothing about the bucket (an empty prefix is a new store). Only a definite
        no counts; a refusal (credentials limited to a prefix) leaves it to the caller."""
        try:
            if self.scheme == "s3":
                self.fs.call_s3("head_bucket", Bucket=self.bucket)
                return False
            return not self.fs.exists(self.bucket)
        except FileNotFoundError:
            return True
        except Exception:  # noqa: BLE001 - refused or unreachable: not known to be missing
            return False

    def check(self) -> None:
        """Raises a one-line error unless the bucket exists and these credentials may list it."""
        with self.errors("opening the store"):
            try:
                self.fs.ls(self.prefix, refresh=True)  # the prefix only: credentials may be limited to it
            except FileNotFoundError:
                if self.missing():
                    raise
                # An empty prefix in an existing bucket: a new store.

    def read(self, name: str) -> bytes | None:
        with self.errors(f"reading {self.uri(name)}"):
            try:
                return self.fs.cat_file(self.path(name))
            except FileNotFoundError as error:
                if _no_such_bucket(error):
                    raise
                return None

    def write(self, name: str, data: bytes, exclusive: bool = False) -> bool:
        """Writes ``data``; with ``exclusive``, only if nothing is there yet (a conditional
        write), returning False when something was."""
        with self.errors(f"writing {self.uri(name)}"):
            if not exclusive:
                self.fs.pipe_file(self.path(name), data)
                return True
            try:
                self.fs.pipe_file(self.path(name), data, mode="create")
            except (FileExistsError, OSError) as error:
                if isinstance(error, FileExistsError) or "condition" in str(error).lower():
                    return False
                raise
            return True

    def listing(self, prefix: str) -> dict[str, dict[str, Any]]:
        """Every object under ``prefix``: its path relative to it, with size and ETag."""
        with self.errors(f"listing {self.uri(prefix)}"):
            found = self.fs.find(self.path(prefix), detail=True)
        base = self.path(prefix) + "/"
        return {
            name[len(base) :]: {
                "bytes": info.get("size"),
                "etag": info.get("ETag") or info.get("etag") or info.get("md5Hash") or info.get("generation"),
            }
            for name, info in found.items()
            if name.startswith(base) and info.get("type") != "directory"
        }

    def upload(self, files: Mapping[str, Path]) -> None:
        """``{name: local file}``, several at once."""
        with self.errors("uploading"), ThreadPoolExecutor(_PARALLEL) as pool:
            list(pool.map(lambda item: self.fs.put_file(str(item[1]), self.path(item[0])), files.items()))

    def download(self, files: Mapping[str, Path]) -> None:
        """``{name: local file}``, several at once."""
        for local in files.values():
            local.parent.mkdir(parents=True, exist_ok=True)
        with self.errors("downloading"), ThreadPoolExecutor(_PARALLEL) as pool:
            list(pool.map(lambda item: self.fs.get_file(self.path(item[0]), str(item[1])), files.items()))

    def remove(self, *names: str) -> None:
        """Objects, or every object under a prefix; what is already gone is no error."""
        with self.errors("removing"):
            for name in names:
                with contextlib.suppress(FileNotFoundError):
                    self.fs.rm(self.path(name), recursive=True)

    def glob(self, pattern: str) -> list[str]:
        with self.errors("listing"):
            base = self.prefix + "/"
            return [p[len(base) :] for p in self.fs.glob(self.path(pattern))]


def _fetch_verified(bucket: Bucket, prefix: str, files: Mapping[str, FileEntry], into: Path) -> bool:
    """Downloads ``files`` (name -> bytes, sha256) from ``prefix`` into ``into``; False if any is
    missing or differs from what ``files`` says."""
    try:
        bucket.download({f"{prefix}/{name}" if prefix else name: into / name for name in files})
    except FileNotFoundError:
        return False
    return not Store.damage(into, files)


class CommittedStep(TypedDict):
    files: dict[str, FileEntry]


class RemoteResumeFolder(ResumeFolder):
    """Training checkpoints staged in a local folder, with the object store as the source of
    truth: ``push`` copies each complete local step up (its ``<step>.json`` last) and removes
    steps no longer kept; ``pull`` brings the newest committed step down if it is missing here."""

    def __init__(self, path: Path, url: str):
        super().__init__(path)
        self.url = url

    def committed(self, bucket: Bucket) -> dict[int, CommittedStep]:
        """Each committed checkpoint's record (its files) by step."""
        records = {}
        for name in bucket.listing(""):
            stem = name.removesuffix(".json")
            if name.endswith(".json") and "/" not in name and stem.isdigit():
                records[int(stem)] = json.loads(bucket.read(name) or b"{}")
        return records

    def pull(self) -> int | None:
        bucket = Bucket(self.url)
        committed = self.committed(bucket)
        while committed:
            step = max(committed)
            local = self.path / str(step)
            if local.is_dir() and not Store.damage(local, committed[step]["files"]):
                return step
            incoming = self.path / f".pull-{step}-{uuid.uuid4().hex[:6]}"
            try:
                if _fetch_verified(bucket, str(step), committed[step]["files"], incoming):
                    shutil.rmtree(local, ignore_errors=True)
                    os.rename(incoming, local)
                    return step
            finally:
                shutil.rmtree(incoming, ignore_errors=True)
            # Another run training the same version may have moved on (it removes older steps)
            # or finished (it clears the folder) while this one read: damaged only if the step
            # it read is still committed.
            now = self.committed(bucket)
            if now.get(step) == committed[step]:
                raise ObjectStoreError(
                    f"the training checkpoint {bucket.uri(str(step))} is damaged; remove "
                    f"{bucket.uri()} to train from the start"
                )
            committed = now
        return None

    def push(self) -> None:
        bucket = Bucket(self.url)
        committed = self.committed(bucket)
        local = (
            sorted(int(p.name) for p in self.path.iterdir() if p.is_dir() and p.name.isdigit())
            if self.path.is_dir()
            else []
        )
        for step in local:
            if step not in committed:
                files = describe_files(self.path / str(step))
                bucket.upload({f"{step}/{name}": self.path / str(step) / name for name in files})
                bucket.write(f"{step}.json", json.dumps({"files": files}).encode())
        for step in committed:
            if step not in local and local and step < local[-1]:
                bucket.remove(f"{step}.json", str(step))  # the record first: never a half-removed step in use

    def clear(self) -> None:
        super().clear()
        Bucket(self.url).remove("")


class ObjectStore(VersionStore):
    """The store at ``scheme://bucket/prefix``, mirrored in ``workdir`` (see the module doc)."""

    def __init__(self, url: str, workdir: str | os.PathLike | None = None):
        self.bucket = Bucket(url)
        self.location = self.bucket.url
        base = Path(workdir).expanduser().resolve() if workdir else default_workdir()
        self.mirror = Store(base / self.bucket.prefix.replace("/", "_"))  # one mirror per store

    def check(self) -> None:
        self.bucket.check()

    def resume(self, stage: str, key: str) -> RemoteResumeFolder:
        local = self.mirror.resume(stage, key).path
        return RemoteResumeFolder(local, self.bucket.uri(valid_stage(stage), f".resume-{valid_key(key)}"))

    def _manifest(self, stage: str, key: str) -> Manifest | None:
        data = self.bucket.read(f"{valid_stage(stage)}/{valid_key(key)}/{MANIFEST}")
        if data is None:
            return None
        try:
            manifest = json.loads(data)
        except ValueError:
            manifest = None
        # Present but unreadable: an empty one, which no check accepts.
        return cast(Manifest, manifest if isinstance(manifest, dict) else {})

    def lookup(self, stage: str, key: str) -> Version | None:
        """The version, mirrored here and verified, if the bucket holds it intact; else None."""
        manifest = self._manifest(stage, key)
        if not manifest or manifest.get("key") != key or "objects" not in manifest or not manifest_intact(manifest):
            return None
        prefix = f"{stage}/{key}/{manifest['objects']}"
        listed = self.bucket.listing(prefix)
        files = manifest.get("files", {})
        if any(name not in listed or listed[name]["bytes"] != entry["bytes"] for name, entry in files.items()):
            return None
        committed = manifest.get("etags")  # as the objects were at commit: any object written since is damage,
        if committed and any(listed[name]["etag"] != committed.get(name) for name in files):  # shards included
            return None
        etags = {name: listed[name]["etag"] for name in files}
        local = self.mirror.lookup(stage, key, partial=True)
        if local is not None and local.fingerprint == manifest["fingerprint"] and self._etags(local) == etags:
            return self._remote(local)
        if not self._mirror(stage, key, manifest, prefix, etags):
            return None
        local = self.mirror.lookup(stage, key, partial=True)
        return self._remote(local) if local is not None else None

    @staticmethod
    def _etags(version: Version) -> dict[str, str] | None:
        try:
            return json.loads(version.file(REMOTE).read_text())["etags"]
        except (OSError, ValueError, KeyError):
            return None

    def _remote(self, version: Version) -> Version:
        fetch = None
        if version.manifest.get("on_demand"):
            fetch = functools.partial(
                self._fetch_on_demand,
                version.path,
                version.manifest,
                f"{version.stage}/{version.key}/{version.manifest.get('objects')}",
            )
        return Version(
            version.stage,
            version.key,
            version.path,
            version.manifest,
            uri=self.bucket.uri(version.stage, version.key),
            store=self.location,
            fetch=fetch,
        )

    def _fetch_on_demand(self, folder: Path, manifest: Manifest, prefix: str, names: list[str]) -> None:
        """Brings ``names`` (``on_demand`` files of the mirrored version in ``folder``) down,
        each verified before it takes its place: a reader never opens a partial file."""
        files = manifest["files"]
        unknown = [name for name in names if name not in files or not on_demand(manifest, name)]
        if unknown:
            raise StoreError(f"{', '.join(unknown)}: not a file this version fetches on demand")
        incoming = folder / f".pull-{uuid.uuid4().hex[:8]}"
        try:
            wanted = {name: files[name] for name in names}
            if not _fetch_verified(self.bucket, prefix, wanted, incoming):
                raise ObjectStoreError(
                    f"{', '.join(names)} of {self.bucket.uri(prefix)} differs from its manifest or is gone; "
                    f"rerun with --refresh {manifest.get('stage', 'the stage')}"
                )
            for name in names:
                os.replace(incoming / name, folder / name)  # two readers on this host: the same bytes
        finally:
            shutil.rmtree(incoming, ignore_errors=True)

    def _mirror(self, stage: str, key: str, manifest: Manifest, prefix: str, etags: dict[str, str]) -> bool:
        """Downloads a committed version into the mirror (its ``on_demand`` files only as they
        are read); False if an object differs from the manifest."""
        final = self.mirror.path(stage, key)
        incoming = final.parent / f".pull-{key}-{uuid.uuid4().hex[:8]}"
        incoming.mkdir(parents=True)
        try:
            now = {name: entry for name, entry in manifest["files"].items() if not on_demand(manifest, name)}
            if not _fetch_verified(self.bucket, prefix, now, incoming):
                return False
            for folder in manifest.get("on_demand", ()):
                (incoming / folder).mkdir(parents=True, exist_ok=True)
            (incoming / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True))
            (incoming / REMOTE).write_text(json.dumps({"uri": self.bucket.uri(stage, key), "etags": etags}))
            if final.exists():
                shutil.rmtree(final)  # a stale or damaged copy: the bucket is the truth
            os.rename(incoming, final)
            return True
        finally:
            shutil.rmtree(incoming, ignore_errors=True)

    def remains(self, stage: str, key: str, force: bool) -> bool:
        return force or self._manifest(stage, key) is not None

    def lock(self, stage: str, key: str) -> contextlib.AbstractContextManager:
        return self.mirror.lock(stage, key)  # builders on this machine; on two, the first manifest wins

    def clear_leftovers(self, stage: str, key: str) -> None:
        self.mirror.clear_leftovers(stage, key)

    def build(
        self,
        stage: str,
        key: str,
        params: Any,
        inputs: Mapping[str, Version],
        resume: ResumeFolder,
        force: bool = False,
    ) -> contextlib.AbstractContextManager[Builder]:
        """Built in the mirror, then committed to the bucket (see the module doc)."""
        replace = self.remains(stage, key, force)
        build = f"build-{uuid.uuid4().hex[:12]}"
        return self.mirror.build_folder(
            stage,
            key,
            params,
            inputs,
            resume=resume,
            commit=lambda folder: self._commit(stage, key, folder, build, replace),
        )

    def _commit(self, stage: str, key: str, folder: Path, build: str, replace: bool) -> bool:
        """Uploads a sealed build folder, then its manifest as the commit record. True if this
        build is now the version; False if another builder committed first."""
        manifest = json.loads((folder / MANIFEST).read_text())
        manifest["objects"] = build
        (folder / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True))
        files = manifest["files"]
        self.bucket.upload({f"{stage}/{key}/{build}/{name}": folder / name for name in files})
        # The objects' ETags as uploaded go into the commit record: a lookup on any machine then
        # tells an object written since (a shard read only on demand) before anything reads it.
        listed = self.bucket.listing(f"{stage}/{key}/{build}")
        etags = {name: listed.get(name, {}).get("etag") for name in files}
        manifest["etags"] = etags
        (folder / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True))
        record = json.dumps(manifest, indent=2, sort_keys=True).encode()
        won = self.bucket.write(f"{stage}/{key}/{MANIFEST}", record, exclusive=not replace)
        if won:  # the mirror's copy is this folder: record the ETags it stands for
            (folder / REMOTE).write_text(json.dumps({"uri": self.bucket.uri(stage, key), "etags": etags}))
        keep = build if won else (self._manifest(stage, key) or {}).get("objects")
        stale = {
            name.split("/", 1)[0] for name in self.bucket.listing(f"{stage}/{key}") if name.startswith("build-")
        } - {keep}
        self.bucket.remove(*(f"{stage}/{key}/{prefix}" for prefix in sorted(stale)))
        return won

    def versions(self, stage: str | None = None) -> list[Version]:
        """Every committed version in the bucket (manifests only: nothing is downloaded), newest first."""
        found = []
        for name in self.bucket.glob(f"{stage or '*'}/*/{MANIFEST}"):
            stage_name, key, _ = name.split("/")
            try:
                valid_stage(stage_name)
                valid_key(key)
                manifest = json.loads(self.bucket.read(name) or b"")
            except (StoreError, ValueError):
                continue
            if not isinstance(manifest, dict) or not manifest_intact(manifest := cast(Manifest, manifest)):
                continue
            found.append(
                Version(
                    stage_name,
                    key,
                    self.mirror.path(stage_name, key),
                    manifest,
                    uri=self.bucket.uri(stage_name, key),
                    store=self.location,
                )
            )
        return sorted(found, key=lambda v: v.manifest.get("created", ""), reverse=True)


def checked_store(location: str) -> VersionStore:
    """The store at ``location``, opened and checked (bucket reachable, credentials accepted)
    once per process and mirror folder: the command line, the flow and every stage task of a
    run share it. Other credentials (a run whose keys come from a block) check again."""
    return _checked(location, os.environ.get(WORKDIR), _credentials())


def _credentials() -> tuple:
    """The variables a bucket's client reads: its identity, as far as a cache is concerned."""
    return tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith(("AWS_", "GOOGLE_"))))


@functools.lru_cache(maxsize=16)
def _checked(location: str, workdir: str | None, credentials: tuple) -> VersionStore:
    store = open_store(location, workdir)
    store.check()  # a failed check is not cached: it raises
    return store


def open_store(location: str | os.PathLike, workdir: str | os.PathLike | None = None) -> VersionStore:
    """The store at ``location``: a local folder, or ``s3://bucket/prefix`` / ``gs://…``
    mirrored in ``workdir`` (default ``$BARDFLOW_WORKDIR`` or ``~/.cache/bardflow/mirror``)."""
    if "://" in str(location):
        if not is_remote(location):
            raise StoreError(
                f"unsupported store {location}: use a local folder or one of {', '.join(s + '://' for s in SCHEMES)}"
            )
        return ObjectStore(str(location), workdir)
    return Store(location)
