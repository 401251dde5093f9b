"""Prefect's task cache keyed on store version keys.

A stage's Prefect cache key is its version key (plus which store it lives in), so
Prefect reports "Cached" exactly when the store already holds that version. Task
inputs are never pickled or hashed by value: only parameters and upstream
fingerprints enter the key.
"""

from __future__ import annotations

import hashlib
from typing import Any

from artifacts.store import Store, version_key


def jsonable(params: Any) -> Any:
    """Pydantic models become plain data; plain data passes through."""
    if hasattr(params, "model_dump"):
        return params.model_dump(mode="json")
    return params


def fingerprints(upstream: dict[str, dict[str, Any]]) -> dict[str, str]:
    return {name: description["fingerprint"] for name, description in upstream.items()}


def stage_key(stage: str, code_version: str, params: Any, upstream: dict[str, dict[str, Any]]) -> str:
    return version_key(stage, code_version, jsonable(params), fingerprints(upstream))


def cache_key_fn(stage: str, key_of):
    """A Prefect ``cache_key_fn`` for ``stage``: its version key (``key_of(params,
    upstream)``) plus a tag of the store root, so two stores never share a record."""

    def key(_context, arguments: dict[str, Any]) -> str:
        version = key_of(arguments["params"], arguments.get("upstream") or {})
        store = hashlib.sha256(str(Store(arguments["store"]).root).encode()).hexdigest()[:8]
        return f"bardflow-{stage}-{version}-{store}"

    return key
