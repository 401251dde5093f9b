"""What every stage shares: its Prefect task wrapper and its version-key recipe.

A stage task takes ``params`` (its own settings), ``upstream`` (descriptions of
the versions it reads), ``store`` (the store root) and ``force`` (rebuild even if
the version exists), and returns the small JSON description of its version.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from prefect import task

from artifacts.caching import cache_key_fn, jsonable, stage_key
from artifacts.store import Builder, Store, Version


@dataclass(frozen=True)
class Stage:
    name: str
    code_version: str  # bump when the stage's output for the same inputs changes
    key_params: Callable[[Any], Any] = jsonable  # the part of params that decides the output

    def key(self, params: Any, upstream: dict[str, dict[str, Any]]) -> str:
        return stage_key(self.name, self.code_version, self.key_params(params), upstream)

    def task(self, fn):
        """Wraps ``fn`` as this stage's Prefect task: JSON results, keyed on the version."""
        prefect_task = task(
            fn,
            name=self.name,
            cache_key_fn=cache_key_fn(self.name, self.key),
            persist_result=True,
            result_serializer="json",
        )
        prefect_task.stage = self
        return prefect_task

    def produce(
        self,
        params: Any,
        upstream: dict[str, dict[str, Any]],
        store: str,
        force: bool,
        work: Callable[[Builder], None],
    ) -> dict[str, Any]:
        version, ran = Store(store).produce(
            self.name,
            self.key(params, upstream),
            self.key_params(params),
            upstream,
            work,
            force=force,
        )
        return {**version.describe(), "ran": ran}


def inputs(store: str, upstream: dict[str, dict[str, Any]]) -> dict[str, Version]:
    """The upstream versions, each verified against its manifest before use."""
    return {name: Store(store).require(description) for name, description in upstream.items()}
