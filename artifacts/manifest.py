"""A version's manifest: its record of what it is, what it was built from, its files and figures,
and with what; how its key is made and how its seal is checked."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any, NotRequired

from pydantic import JsonValue
from typing_extensions import TypedDict

_LIBRARIES = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "numpy", "pyarrow", "prefect")


def canonical_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)


# Fields a manifest's digest leaves out: the digest itself, and where an object store put
# the files and their ETags there (added when the build is committed to the bucket).
_UNDIGESTED = ("digest", "objects", "etags")


# A version's figures by name, open: each stage types its own where it makes them (the
# training stages' are model/training/run_records.py's TrainingMetrics).
Metrics = dict[str, Any]


class FileEntry(TypedDict):
    bytes: int
    sha256: str


class InputEntry(TypedDict):
    """A version a build read: which, and the fingerprint of its files then."""

    stage: str
    key: str
    fingerprint: str


class ProjectVersion(TypedDict):
    version: str | None  # bardflow's, as installed
    commit: str | None  # in a git checkout ("+changes" when files differ from it)


class Manifest(TypedDict):
    """A version's ``manifest.json``: what it is, what it was built from, its files and figures,
    and where and with what it was built; sealed by ``digest``."""

    stage: str
    key: str
    fingerprint: str  # the files' content, hashed: equal files, equal fingerprint
    inputs: dict[str, InputEntry]
    params: JsonValue  # the stage's settings, as its key took them
    files: dict[str, FileEntry]
    metrics: Metrics
    libraries: dict[str, str]
    bardflow: ProjectVersion
    host: str
    created: str
    digest: NotRequired[str]
    on_demand: NotRequired[list[str]]  # folders an object store brings when first read
    objects: NotRequired[str]  # an object store's folder of this version's files
    etags: NotRequired[dict[str, str]]  # and their ETags as committed
    # What a stage records of itself (``Builder.record``).
    code_version: NotRequired[str]
    source: NotRequired[str]
    source_files: NotRequired[int]
    corpus_files: NotRequired[list[JsonValue]]
    shards: NotRequired[dict[str, list[Any]]]  # the encode stage's Arrow shards by split
    hf: NotRequired[dict[str, JsonValue]]  # the transformers folder: what became of it
    devices: NotRequired[list[str] | None]  # the devices a training ran on
    resumed_from_step: NotRequired[int | None]
    reused_from: NotRequired[str]


def manifest_digest(manifest: Manifest) -> str:
    """sha256 of a manifest's content as it reads back from JSON."""
    body = json.loads(json.dumps({k: v for k, v in manifest.items() if k not in _UNDIGESTED}, default=str))
    return hashlib.sha256(canonical_json(body).encode()).hexdigest()


def manifest_intact(manifest: Manifest) -> bool:
    """False when a manifest was edited after it was sealed (older manifests carry no digest)."""
    return "digest" not in manifest or manifest["digest"] == manifest_digest(manifest)


def version_key(stage: str, code_version: str, params: Any, inputs: dict[str, str]) -> str:
    """The name of a stage's version: a hash of everything that decides its output —
    the stage, its code version, its own parameters and the fingerprints of its inputs."""
    recipe = {"stage": stage, "code": code_version, "params": params, "inputs": inputs}
    return hashlib.sha256(canonical_json(recipe).encode()).hexdigest()[:20]


def on_demand(manifest: Manifest, name: str) -> bool:
    """Whether the file ``name`` lies in one of the manifest's ``on_demand`` folders."""
    return any(name.startswith(folder.rstrip("/") + "/") for folder in manifest.get("on_demand", ()))


@functools.lru_cache(maxsize=1)
def project_version() -> ProjectVersion:
    """bardflow's own version and, in a git checkout, its commit ("+changes" when files differ
    from it): what code built a version, next to the libraries it ran on."""
    found = ProjectVersion(version=None, commit=None)
    with contextlib.suppress(metadata.PackageNotFoundError):
        found["version"] = metadata.version("bardflow")
    checkout = Path(__file__).resolve().parents[1]
    if (checkout / ".git").exists():
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            head = subprocess.run(
                ["git", "-C", str(checkout), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10
            )
            changes = subprocess.run(
                ["git", "-C", str(checkout), "status", "--porcelain", "--untracked-files=no"],
                capture_output=True,
                text=True,
                timeout=10,
            )
            if head.returncode == 0:
                found["commit"] = head.stdout.strip() + ("+changes" if changes.stdout.strip() else "")
    return found


def library_versions() -> dict[str, str]:
    found = {}
    for name in _LIBRARIES:
        with contextlib.suppress(metadata.PackageNotFoundError):
            found[name] = metadata.version(name)
    return found
