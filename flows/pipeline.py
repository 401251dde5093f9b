"""The pipeline: the codelab's journey as one Prefect flow of cached, versioned stages.

    fetch -> encode -> train_single -> train_parallel -> compare
          -> checkpoint -> verify -> generate

Each stage is a task whose Prefect cache key is its store version key. A stage is
reported "cached" when Prefect's cache hit, and is re-run when asked (``refresh``)
or when its version folder is missing or damaged.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any, Literal

import jax
from prefect import flow
from prefect.logging import get_run_logger

from pydantic import ValidationError

from artifacts.store import Store
from flows.settings import PRESETS, STAGES, store_root
from model.config import ConfigError, GenerateConfig, PipelineConfig, Prompt, build_config
from model.distributed import ProcessGroup
from tasks.checkpoint import checkpoint
from tasks.compare import compare
from tasks.encode import encode
from tasks.fetch import fetch
from tasks.generate import generate
from tasks.train import TrainingRequest, hardware, train_parallel, train_single
from tasks.verify import VerifyParams, verify

StageName = Literal[STAGES]  # typed parameters: the UI's form offers exactly these
Preset = Literal[PRESETS]
OWN_PACKAGES = {"model", "tasks", "artifacts", "flows"}


class ExplainedErrorFilter(logging.Filter):
    """Our own errors (bad input, damaged files) name the problem and the fix in their
    message; a traceback in the log would only bury that line. Other errors keep theirs."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if error is not None and type(error).__module__.split(".")[0] in OWN_PACKAGES:
            record.exc_info, record.exc_text = None, None
        return True


def quiet_explained_errors() -> None:
    loggers = [logging.getLogger(name) for name in ("", "prefect", "prefect.flow_runs", "prefect.task_runs")]
    for handler in (h for logger in loggers for h in logger.handlers):
        if not any(isinstance(f, ExplainedErrorFilter) for f in handler.filters):
            handler.addFilter(ExplainedErrorFilter())


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
        key = stage.key(params, upstream)
        intact = self.store.lookup(stage.name, key) is not None
        if not intact and self.store.path(stage.name, key).exists():
            get_run_logger().warning("%s version %s is damaged or incomplete: rebuilding it", stage.name, key)
        started = time.perf_counter()
        state = stage_task.with_options(
            refresh_cache=forced or not intact,
            # Cache records live beside the versions they describe: whoever points at the
            # same store (a local run, a worker) shares the cache, and nothing else does.
            result_storage=self.store.root / ".prefect-results",
        )(params=params, upstream=upstream, store=str(self.store.root), force=forced, return_state=True)
        description = state.result()  # raises the stage's own error if it failed
        cached = state.name == "Cached" or not description.get("ran", True)
        self.summary[stage.name] = {
            "state": "cached" if cached else "ran",
            "key": description["key"],
            "path": description["path"],
            "metrics": description["metrics"],
            "seconds": round(time.perf_counter() - started, 3),
        }
        return description


def parallel_request(config: PipelineConfig, processes: int) -> TrainingRequest:
    """``train_parallel``'s request: every device of this host, shared out among
    ``processes`` local processes, or, under a cluster scheduler, every device of every host."""
    devices, platform = hardware()
    group = ProcessGroup.from_env()
    if group is not None:
        if processes > 1:
            raise ConfigError(f"processes={processes} starts processes on this host, but this is process "
                              f"{group.process_id} of {group.num_processes} of a cluster job already; leave processes at 1")
        return TrainingRequest(model=config.model, train=config.train, devices=devices * group.num_processes,
                               platform=platform, processes=group.num_processes)
    if processes < 1 or devices % processes:
        hint = " (on a CPU, emulate devices with --cpu-devices)" if platform == "cpu" else ""
        raise ConfigError(f"processes={processes} cannot share out the {devices} {platform} device(s) of this host "
                          f"evenly; use a divisor of {devices}{hint}")
    return TrainingRequest(model=config.model, train=config.train, devices=devices, platform=platform,
                           processes=processes)


def run_stages(preset: str, config: PipelineConfig | None, corpus: str | None, store: str | None,
               refresh: list[str], processes: int = 1) -> dict[str, Any]:
    """The pipeline's story; both flows below tell it."""
    quiet_explained_errors()
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
    parallel = run(train_parallel, parallel_request(config, processes), encode=data)
    run(compare, {}, train_single=single, train_parallel=parallel)
    saved = run(checkpoint, {}, train_parallel=parallel)
    run(verify, VerifyParams(), checkpoint=saved, train_parallel=parallel, encode=data)
    run(generate, config.generate, checkpoint=saved)

    return {"preset": chosen, "store": str(run.store.root), "stages": run.summary}


@flow(name="bardflow", log_prints=True, persist_result=False)
def pipeline(
    preset: Preset = "auto",
    config: PipelineConfig | None = None,
    corpus: str | None = None,
    store: str | None = None,
    refresh: list[StageName] = [],  # noqa: B006 - Prefect needs a literal default for the form
    processes: int = 1,
) -> dict[str, Any]:
    """Fetch, encode, train on one device and on all, compare, checkpoint, verify, generate.

    ``config`` overrides the preset entirely when given; ``corpus`` overrides its source.
    ``processes`` > 1 runs train_parallel as that many processes of this host, which
    share its devices out (one per GPU, say) and train as one data-parallel run.
    """
    return run_stages(preset, config, corpus, store, list(refresh), processes)


@flow(name="bardflow", log_prints=True, persist_result=False)
def samples(
    prompts: list[str] | None = None,
    temperature: float | None = None,
    max_new_bytes: int | None = None,
    seed: int | None = None,
    preset: Preset = "auto",
    corpus: str | None = None,
    store: str | None = None,
    processes: int = 1,
) -> dict[str, Any]:
    """New samples from the trained model. Every stage before ``generate`` comes from the
    cache when it is there (training runs only if nothing is cached); a setting left empty
    keeps the preset's value."""
    base = build_config(pick_preset(preset))
    changes: dict[str, Any] = {}
    if prompts is not None:
        default_temperature = base.generate.prompts[0].temperature
        changes["prompts"] = tuple(Prompt(text=t, temperature=default_temperature) for t in prompts)
    if temperature is not None:
        chosen = changes.get("prompts", base.generate.prompts)
        changes["prompts"] = tuple(p.model_copy(update={"temperature": temperature}) for p in chosen)
    if max_new_bytes is not None:
        changes["max_new_bytes"] = max_new_bytes
    if seed is not None:
        changes["seed"] = seed
    try:
        generate_config = GenerateConfig.model_validate({**base.generate.model_dump(), **changes})
    except ValidationError as error:
        raise ConfigError(f"invalid generation settings: {error.errors()[0]['msg']}") from None
    config = base.model_copy(update={"generate": generate_config})
    return run_stages(preset, config, corpus, store, [], processes)
