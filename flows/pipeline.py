"""The pipeline: the codelab's journey as one Prefect flow of cached, versioned stages.

    fetch -> (tokenize) -> encode -> train_single -> train_parallel -> compare
          -> checkpoint -> export -> verify -> generate

(tokenize: only where ``data.tokenizer`` is not ``bytes``.)

The stages, their order and what each reads are ``tasks/registry.py``. Each stage runs as
a Prefect task that asks the store for its version and builds it only when the store does
not hold it intact (or when asked to: ``refresh``). The task's state is ``Cached`` exactly
when the store answered, and the run summary, ``--json`` and the UI all show that state.
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Callable
from functools import partial
from typing import Any, Literal, cast

from prefect import flow, task
from prefect.cache_policies import NO_CACHE
from prefect.logging import get_run_logger
from prefect.runtime import deployment, flow_run
from prefect.states import Cancelled, Completed
from pydantic import ValidationError

from ..artifacts.objects import checked_store
from ..artifacts.store import Version, abandon_unfinished
from ..config.settings import ConfigError, GenerateConfig, Overrides, PipelineConfig, Prompt, TrainingRequest
from ..errors import BardflowError
from ..prefect_server import notify
from ..prefect_server.process import full_database, server_gone, serving_this_process
from ..prefect_server.slots import training_slot
from ..processes import stopping
from ..processes.distributed import hardware
from ..tasks import report
from ..tasks.compare import overfitting
from ..tasks.registry import HISTORY, STAGES
from ..tasks.stage import RunPlan, Stage, produce
from . import ui
from .environment import (
    STORE_CREDENTIALS,
    label_flow_run,
    prepare_environment,
    store_credentials,
    store_location,
)
from .records import RunSummary, StageRow
from .run_config import resolve_run_config
from .stage_pages import publish
from .terminal import ExplainedErrorFilter, one_line, quiet_explained_errors
from .tracking import RunTracking

report.use(ui)  # the stages of this process tell the run's log, the terminal's bars and the UI

RUN_ARTIFACT = "run"  # key bardflow-run: one row per stage of each run
SAME = "Unchanged"  # a task that built again what the store held already
# A stage's state in the summary: the store answered, or it ran; a run whose output the store
# already held shows that version's figures, not its own, so the summary says so.
STATES = {"Cached": "cached", SAME: "ran (unchanged)"}
# Typed parameters: the UI's form offers exactly these (the registry's stages and the presets,
# written out for type checkers; tests/test_config.py holds them to the registry and presets).
StageName = Literal[
    "fetch",
    "tokenize",
    "encode",
    "train_single",
    "train_parallel",
    "compare",
    "checkpoint",
    "export",
    "verify",
    "generate",
]
Preset = Literal["auto", "codelab", "cpu", "quality", "gpt2", "tiny"]


def opened(root: str):
    """The store, checked, with its keys from a Prefect block when one is named
    (``BARDFLOW_STORE_CREDENTIALS``); a refusal then names the block."""
    block = store_credentials()
    try:
        return checked_store(root)
    except BardflowError as error:
        if block is None:
            raise
        error.args = (f"{error} (the keys came from the Prefect block {block}, {STORE_CREDENTIALS})",)
        raise


def _ended(tracked: RunTracking | None, error: BaseException | None = None, stage: str = "") -> None:
    """A run's end, where it is told: its MLflow run's status, and a failure's event (which
    `bardflow notify` turns into a message); a stop asked for is no failure."""
    stopped = isinstance(error, (stopping.Stopped, KeyboardInterrupt)) or stopping.requested() is not None
    if tracked is not None:
        tracked.end("FINISHED" if error is None else "KILLED" if isinstance(error, stopping.Stopped) else "FAILED")
    if error is not None and not stopped:
        notify.emit(notify.RUN_FAILED, {"stage": stage, "error": one_line(error)})


def _stage_task(stage: Stage):
    def run_stage(settings: Any, upstream: dict[str, Version], store: str, force: bool = False):
        logger = get_run_logger()
        # One training at a time on a host (prefect_server/slots.py).
        around = (
            partial(training_slot, stage.name, logger.info, flow_run.id, say=partial(logger.info, extra=ui.TERMINAL))
            if isinstance(settings, TrainingRequest)
            else None
        )
        try:
            version, built = produce(
                stage, settings, upstream, checked_store(store), force, notice=logger.warning, around=around
            )
            if built:  # what the UI shows of it, from its figures and files
                publish(stage.name, version, upstream)
        except stopping.Stopped as stopped:
            stopping.end_if_failed()
            if deployment.id is None:
                raise  # a terminal's run: the command ends with the line and 130 or 143
            # A deployment's run cancelled (the UI, `prefect flow-run cancel`: its worker's SIGTERM)
            # is the user's choice, not a failure: the stage ends Cancelled, saying where to go on.
            line = as_deployment(str(stopped))
            logger.warning("cancelled: %s", line, extra=ui.TERMINAL)
            ExplainedErrorFilter.explained.add(line)  # said once: Prefect's lines repeating it stay off the terminal
            return Cancelled(message=line)
        except BaseException as error:
            # The run's server is gone (processes/stopping.py, fail), or cannot write its
            # database (its disk full): the stage has saved what it could and cleaned up on its
            # way here; Prefect can report nothing more. End now, in one line.
            line = full_database(error, serving_this_process()) if isinstance(error, Exception) else None
            if line is not None:
                server_gone(line)
            stopping.end_if_failed()
            raise
        if built and version.same_as_stored:
            return Completed(
                data=version,
                name=SAME,
                message=f"{stage.name} built again: the same output as the "
                f"stored version {version.key}, which is kept (its figures are that build's)",
            )
        if built:
            return version
        return Completed(data=version, name="Cached", message=f"the store holds {stage.name} version {version.key}")

    # Nothing is persisted or pickled: the store is the cache, and the version is its record.
    return task(name=stage.name, cache_policy=NO_CACHE, persist_result=False)(run_stage)


STAGE_TASKS = {stage.name: _stage_task(stage) for stage in STAGES}


def run_stages(
    chosen: str, auto: bool, config: PipelineConfig, store: str | None, refresh: list[str], processes: int = 1
) -> RunSummary:
    """The pipeline's story, in the registry's order; both flows below tell it, each with the
    configuration it resolved once (``resolve_run_config``: ``chosen`` is the preset, ``auto``
    whether it was picked for this machine)."""
    stopping.install()  # over the flow engine's own SIGTERM handler: training stops at a step, checkpointed
    stopping.on_force(abandon_unfinished)  # an end at once still leaves no build folder or lock file
    logger = get_run_logger()
    devices, platform = hardware()
    logger.info(
        "preset %s%s on %d %s device(s)",
        chosen,
        " (auto)" if auto else "",
        devices,
        platform,
        extra=ui.TERMINAL,
    )
    plan = RunPlan(config, devices, platform, processes)
    stages = [stage for stage in STAGES if stage.wanted(plan)]  # bytes: no tokenize
    settings = {stage.name: stage.settings(plan) for stage in stages}  # every refusal before any work
    root = store_location(store)
    opened(root)  # an unreachable bucket or wrong credentials: one line, before any work
    tracked = RunTracking.start(config, chosen, root, logger.warning)  # None: not asked for
    versions: dict[str, Version] = {}
    summary: dict[str, StageRow] = {}
    current = stages[0].name
    try:
        for stage in stages:
            current = stage.name
            stopping.check(f"before {stage.name}")
            stopping.at(f"during {stage.name}")
            stage_settings = settings[stage.name]
            if tracked is not None and isinstance(stage_settings, TrainingRequest):
                stage_settings = stage_settings.model_copy(update={"report": tracked.target(stage.name)})
            version, row = _run_stage(stage, stage_settings, versions, root, stage.name in refresh)
            versions[stage.name], summary[stage.name] = version, row
            logger.info(
                "%s: %s in %.1f s (version %s)", stage.name, row.state, row.seconds, version.key[:12], extra=ui.TERMINAL
            )
            if tracked is not None:
                tracked.stage_done(stage.name, row.state, version)
    except BaseException as error:
        _ended(tracked, error, current)
        raise
    _ended(tracked)
    # The run's summary in the UI, which is also how a sweep's parent learns, from another
    # machine, what a child it ran on a worker produced.
    ui.table(RUN_ARTIFACT, _summary_rows(summary), description=f"bardflow run, preset {chosen}")
    samples = json.loads(versions["generate"].file("samples.json").read_text())  # the pay-off, shown last
    return RunSummary(
        chosen,
        root,
        str(flow_run.id),
        summary,
        samples,
        _warnings(versions, logger),
        tracked.where() if tracked is not None else None,
    )


def _run_stage(
    stage: Stage, settings: Any, versions: dict[str, Version], root: str, refresh: bool
) -> tuple[Version, StageRow]:
    """One stage's task on the versions it reads; its version and its row of the run's summary
    (the stage's error is raised here if it failed)."""
    started = time.perf_counter()
    state = STAGE_TASKS[stage.name](
        settings, {name: versions[name] for name in stage.reads if name in versions}, root, refresh, return_state=True
    )
    if state.is_cancelled():  # a deployment's run cancelled within the stage: the flow ends Cancelled too
        raise stopping.Stopped(stopping.requested() or signal.SIGTERM, state.message or f"{stage.name} cancelled")
    version = cast(Version, state.result())
    row = StageRow(
        STATES.get(state.name or "", "ran"),
        version.key,
        version.location,
        version.metrics,
        round(time.perf_counter() - started, 3),
    )
    return version, row


def as_deployment(line: str) -> str:
    """A stop's line as a deployment's user acts on it: a run of the deployment, not a command."""
    return line.replace("rerun the same command", "run the deployment again")


def _told(story: Callable[[], RunSummary]) -> RunSummary:
    """The pipeline's story. A deployment's run stopped by its worker's SIGTERM (a cancel from
    the UI or `prefect flow-run cancel`) ends Cancelled, the user's choice and no failure (the
    stage has said where to go on); a terminal's run raises, and the command ends with its line
    and 130 or 143."""
    try:
        return story()
    except stopping.Stopped as stopped:
        if deployment.id is None:
            raise
        return cast(RunSummary, Cancelled(message=as_deployment(str(stopped))))


def _summary_rows(summary: dict[str, StageRow]) -> list[dict[str, Any]]:
    return [
        {"stage": name, "state": row.state, "key": row.key, "seconds": row.seconds} for name, row in summary.items()
    ]


def _warnings(versions: dict[str, Version], logger) -> list[str]:
    """What the run's figures say is wrong with it (overfitting), told in the log and the UI."""
    found = [line for line in [overfitting(json.loads(versions["train_parallel"].file(HISTORY).read_text()))] if line]
    for line in found:
        logger.warning(line)
        ui.markdown(RUN_ARTIFACT, f"**Warning**: {line}\n", "A warning about this run", what="warning")
    return found


@flow(name="bardflow-pipeline", log_prints=True, persist_result=False)
def pipeline(
    preset: Preset = "auto",
    config: PipelineConfig | None = None,
    corpus: str | None = None,
    store: str | None = None,
    refresh: list[StageName] = [],  # noqa: B006 - Prefect needs a literal default for the form
    processes: int = 1,
    settings: Overrides | None = None,
    track: list[str] | None = None,
) -> RunSummary:
    """Fetch, encode, train on one device and on all, compare, checkpoint, export, verify, generate.

    ``config`` overrides the preset entirely when given; ``settings`` is what a config file
    for ``bardflow run --config`` holds (any sections, and a preset, which then replaces
    ``preset``), applied over the preset;
    ``corpus`` overrides its source. ``processes`` > 1 runs train_parallel as that many
    processes of this host, which share its devices out (one per GPU, say) and train as
    one data-parallel run. ``track``: where the run is tracked as it trains, as ``--track``
    takes it (``mlflow=URI``, ``tensorboard=DIR``).
    """
    prepare_environment()  # first: JAX reads it when it starts (a deployment's run comes in here)
    quiet_explained_errors()
    label_flow_run()
    chosen, config = resolve_run_config(preset, config=config, settings=settings, track=track, corpus=corpus)
    return _told(partial(run_stages, chosen, preset == "auto", config, store, list(refresh), processes))


@flow(name="bardflow-samples", log_prints=True, persist_result=False)
def samples(
    prompts: list[str] | None = None,
    temperature: float | None = None,
    max_new_bytes: int | None = None,
    seed: int | None = None,
    preset: Preset = "auto",
    corpus: str | None = None,
    store: str | None = None,
    processes: int = 1,
) -> RunSummary:
    """New samples from the trained model. Every stage before ``generate`` comes from the
    cache when it is there (training runs only if nothing is cached); a setting left empty
    keeps the preset's value."""
    prepare_environment()  # first: JAX reads it when it starts (a deployment's run comes in here)
    quiet_explained_errors()
    label_flow_run()
    chosen, base = resolve_run_config(preset, corpus=corpus)
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
        raise ConfigError(f"invalid generation settings: {error.errors()[0]['msg']}") from error
    config = base.model_copy(update={"generate": generate_config})
    return _told(partial(run_stages, chosen, preset == "auto", config, store, [], processes))
