"""The pipeline: the codelab's journey as one Prefect flow of cached, versioned stages.

    fetch -> encode -> train_single -> train_parallel -> compare
          -> checkpoint -> verify -> generate

Each stage is a task whose Prefect cache key is its store version key. A stage is
reported "cached" when Prefect's cache hit, and is re-run when asked (``refresh``)
or when its version folder is missing or damaged.
"""

from __future__ import annotations

import os
from typing import Any, Literal

import jax
from prefect import flow
from prefect.logging import get_run_logger

from artifacts.store import Store
from flows.settings import store_root
from model.config import PipelineConfig, build_config
from tasks.checkpoint import checkpoint
from tasks.compare import compare
from tasks.encode import encode
from tasks.fetch import fetch
from tasks.generate import generate
from tasks.train import TrainingRequest, hardware, train_parallel, train_single
from tasks.verify import VerifyParams, verify

STAGES = ("fetch", "encode", "train_single", "train_parallel", "compare", "checkpoint", "verify", "generate")
StageName = Literal["fetch", "encode", "train_single", "train_parallel", "compare", "checkpoint", "verify", "generate"]
Preset = Literal["auto", "codelab", "cpu", "tiny"]


def pick_preset(preset: str) -> str:
    if preset != "auto":
        return preset
    return "codelab" if jax.default_backend() == "gpu" else "cpu"


class StageRunner:
    """Calls stage tasks, refreshing those asked for or whose version is not intact,
    and keeps what each did for the run summary."""

    def __init__(self, store: Store, refresh: set[str]):
        self.store, self.refresh = store, refresh
        self.summary: dict[str, dict[str, Any]] = {}

    def __call__(self, stage_task, params: Any, **upstream: dict[str, Any]) -> dict[str, Any]:
        stage = stage_task.stage
        forced = stage.name in self.refresh
        intact = self.store.lookup(stage.name, stage.key(params, upstream)) is not None
        state = stage_task.with_options(refresh_cache=forced or not intact)(
            params=params, upstream=upstream, store=str(self.store.root), force=forced, return_state=True
        )
        description = state.result()  # raises the stage's own error if it failed
        cached = state.name == "Cached" or not description.get("ran", True)
        self.summary[stage.name] = {
            "state": "cached" if cached else "ran",
            "key": description["key"],
            "path": description["path"],
            "metrics": description["metrics"],
        }
        return description


@flow(name="bardflow", log_prints=True, persist_result=False)
def pipeline(
    preset: Preset = "auto",
    config: PipelineConfig | None = None,
    corpus: str | None = None,
    store: str | None = None,
    refresh: list[StageName] = [],  # noqa: B006 - Prefect needs a literal default for the form
) -> dict[str, Any]:
    """Fetch, encode, train on one device and on all, compare, checkpoint, verify, generate.

    ``config`` overrides the preset entirely when given; ``corpus`` overrides its source.
    """
    logger = get_run_logger()
    chosen = pick_preset(preset)
    config = config or build_config(chosen)
    corpus = corpus or os.environ.get("BARDFLOW_CORPUS")
    if corpus:
        config = config.model_copy(update={"data": config.data.model_copy(update={"corpus": corpus})})
    devices, platform = hardware()
    logger.info("preset %s%s on %d %s device(s)", chosen, " (auto)" if preset == "auto" else "", devices, platform)
    run = StageRunner(Store(store_root(store)), set(refresh))

    corpus_version = run(fetch, config.data)
    data = run(encode, config.data, fetch=corpus_version)
    single = run(train_single, TrainingRequest(model=config.model, train=config.train, devices=1, platform=platform), encode=data)
    parallel = run(train_parallel, TrainingRequest(model=config.model, train=config.train, devices=devices, platform=platform), encode=data)
    run(compare, {}, train_single=single, train_parallel=parallel)
    saved = run(checkpoint, {}, train_parallel=parallel)
    run(verify, VerifyParams(), checkpoint=saved, train_parallel=parallel, encode=data)
    run(generate, config.generate, checkpoint=saved)

    return {"preset": chosen, "store": str(run.store.root), "stages": run.summary}
