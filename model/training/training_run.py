"""One training run, from Arrow files to a saved state: what a training stage does in its
own process, and what every process of a multi-process run does. No Prefect, no store."""

from __future__ import annotations

import json
import signal
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import jax

from ...config.settings import TrainingRequest
from ...processes import stopping
from ..data.splits import Batches, read_split
from ..network.kernels import fused_attention_problem
from . import trackers
from .checkpoint import TrainingCheckpoints, params_digest, save_train_state
from .evaluation import eval_choice, eval_limit, val_batches
from .hooks import Hook, StepInfo
from .loop import TrainingSetup, TrainResult, train
from .placement import Placement
from .run_records import HistoryEntry, TrainingMetrics, Tuning
from .step import init_state_meanwhile, model_from_state
from .step_settings import CPU_TOKENS_PER_PASS, StepSettings, resolve
from .utilization import utilization

EVAL_TOKENS = 1 << 16  # per device, on accelerators


@dataclass(frozen=True)
class RunFiles:
    train: Path  # the encode stage's split folders of Arrow shards
    val: Path
    resume: Path  # the resumable checkpoints, kept until the run is published
    state: Path  # where the final training state goes (must not exist)
    saved: Callable[[], None] | None = None  # hears of each complete checkpoint (to copy it elsewhere)
    # The encode manifest's shard lists ({"train": [{file, rows, …}], "val": …}): with them a
    # shard is opened when first read, after ``bring`` has it fetched where it is not yet.
    shards: dict[str, list[dict]] | None = None
    bring: Callable[[Path], None] | None = None


@dataclass(frozen=True)
class TrainingResult:
    """What one training run comes to: what the stage makes its version's manifest and history
    of, and what process 0 of a multi-process run hands the stage (``to_json``, in its
    ``result.json``)."""

    metrics: TrainingMetrics  # the manifest's figures: throughput, losses, layout, memory, settings
    history: list[HistoryEntry]  # the loss record: one entry each logged step
    params_digest: str  # the trained parameters' bytes, hashed (``params_digest``)
    devices: list[str]

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> TrainingResult:
        return cls(**json.loads(text))


def stop_agreed(step: int) -> bool:
    """Whether to stop before ``step``: asked here (SIGINT, SIGTERM), or, with several
    processes, when JAX's preemption service says so: it catches SIGTERM in any process and
    has them all agree on one step, so that they save its checkpoint together."""
    if jax.process_count() == 1:
        return stopping.requested() is not None
    from jax.experimental import multihost_utils

    return multihost_utils.reached_preemption_sync_point(step)


def stop_hook() -> Hook:
    """Before the next step, when asked to stop: the checkpoint of the step reached, then
    ``stopping.Stopped`` with a line that says how to resume."""

    def stop(info: StepInfo) -> None:
        if info.state is None or not stop_agreed(info.done):  # inside a call of several steps
            return
        saved = info.record.save(info)
        signum = stopping.requested() or signal.SIGTERM  # a peer process's signal
        kept = (
            f"the checkpoint of step {saved} is saved: rerun the same command to resume from it"
            if saved
            else "no checkpoint was saved, so a rerun starts from step 0"
        )
        raise stopping.Stopped(
            signum, f"stopped by {stopping.name(signum)} {stopping.where()} at step {info.done} of {info.last}; {kept}"
        )

    return Hook(stop, lambda info: info.done < info.last)


def _validation(files: RunFiles, request: TrainingRequest, placement: Placement, devices: int, global_batch: int):
    """The validation batches this process evaluates (its rows of each), how many rows they
    hold, and how many the split has. The validation rows (the whole split, or a fixed choice
    of a large one) are evaluated every train.eval_every steps. Accelerators want few large
    calls; a CPU wants cache-sized ones (docs/benchmarks.md, "Training step")."""
    val_rows = read_split(files.val, (files.shards or {}).get("val"), files.bring)
    chosen = eval_choice(len(val_rows), eval_limit(request.train.eval_rows, global_batch, val_rows.shape[1]))
    evaluated = val_rows if chosen is None else val_rows.take(chosen)
    per_device = EVAL_TOKENS if placement.devices[0].platform != "cpu" else 2 * CPU_TOKENS_PER_PASS
    eval_batch = max(1, per_device // val_rows.shape[1]) * devices
    val = [
        (rows[slice(*placement.rows(len(rows)))], weights[slice(*placement.rows(len(rows)))])
        for rows, weights in val_batches(evaluated, eval_batch, multiple=devices)
    ]
    return val, len(evaluated), len(val_rows)  # the split's mapping goes: val holds copies


def run_training(
    request: TrainingRequest,
    files: RunFiles,
    devices: list,
    parallel: bool,
    on_step: Callable[[int, int], None] | None = None,
    warn: trackers.Warn = trackers.warn_on_stderr,
    note: Callable[[str], None] = lambda message: None,
) -> TrainingResult:
    """Trains ``request`` on ``devices`` (``parallel``: a ``data`` mesh over them, which may
    span processes), resuming from the newest checkpoint in ``files.resume``, and saves the
    final state at ``files.state`` (every process calls this; process 0 writes, and reports
    each record to ``request.report``'s trackers, warning through ``warn``; ``note`` tells the
    user of a long step before training, the CPU's measurement). Returns the
    run's summary: metrics, loss history, a digest of the parameters, the devices."""
    placement = (
        Placement.data_parallel(devices, fsdp=request.train.sharding == "fsdp")
        if parallel
        else Placement.single(devices[0])
    )
    global_batch = request.train.per_device_batch * len(devices)
    # Only this process's rows of every batch are read (memory-mapped) and placed.
    train_rows = read_split(files.train, (files.shards or {}).get("train"), files.bring)
    val, eval_rows, val_split_rows = _validation(files, request, placement, len(devices), global_batch)
    rows = placement.rows(global_batch)
    _say_rows(rows, global_batch)
    step, tuning = _step_settings(request, placement, train_rows.shape[1], len(devices), note)
    graphdef, shapes, state = init_state_meanwhile(step.model(request.model), request.train)
    checkpoints = TrainingCheckpoints(files.resume, request.train.keep_checkpoints, files.saved, note=note)
    # train.keep=best: the best state so far, in a folder of its own beside the resumable ones.
    best = (
        TrainingCheckpoints(files.resume / "best", 1, files.saved, note=note) if request.train.keep == "best" else None
    )
    hooks = [stop_hook()]
    if request.report is not None and jax.process_index() == 0:  # process 0 alone writes
        hooks.append(trackers.history_hook(request.report, warn))
    try:
        result = train(
            TrainingSetup(
                graphdef,
                state,
                Batches(train_rows, global_batch, rows),
                val,
                placement,
                request.train,
                on_step=on_step,
                checkpoints=checkpoints,
                stop_after=request.steps,
                step=step,
                hooks=hooks,
                best=best,
                note=note,
                shapes=shapes,
                bytes_per_token=request.bytes_per_token,
            )
        )
    finally:
        checkpoints.close()
        if best is not None:
            best.close()
        trackers.close(request.report)
    save_train_state(files.state, result.state)
    return TrainingResult(
        metrics=_metrics(request, result, step, tuning, devices, (eval_rows, val_split_rows)),
        history=result.history,
        params_digest=params_digest(model_from_state(graphdef, result.state)),
        devices=[str(d) for d in devices],
    )


def _say_rows(rows: tuple[int, int], global_batch: int) -> None:
    """With several processes, which rows of every batch this one reads."""
    if jax.process_count() > 1:
        print(
            f"process {jax.process_index()} of {jax.process_count()}: rows [{rows[0]}, {rows[1]}) of every "
            f"global batch of {global_batch}, on {jax.local_device_count()} local device(s)",
            flush=True,
        )


def _step_settings(
    request: TrainingRequest, placement: Placement, seq_len: int, devices: int, note: Callable[[str], None]
) -> tuple[StepSettings, Tuning | None]:
    """How the step runs: the settings' choices, and on a CPU what was measured on this CPU,
    once (``model/training/cpu_tuning.py``)."""
    platform, tuning = placement.devices[0].platform, None
    if platform == "cpu":
        from .cpu_tuning import choose

        tuning = choose(request.model, request.train, placement, seq_len, say=note)
    step = resolve(
        request.model,
        request.train,
        seq_len,
        platform,
        tuning and tuning["chosen"],
        probe=fused_attention_problem,
        processes=request.processes,
        devices=devices,
    )
    return step, tuning


def _metrics(
    request: TrainingRequest,
    result: TrainResult,
    step: StepSettings,
    tuning: Tuning | None,
    devices: list,
    validation: tuple[int, int],
) -> TrainingMetrics:
    """The run's figures: the loop's, how the step ran, the rows evaluated (``validation``:
    evaluated, in the split) and the devices' utilization."""
    eval_rows, val_split_rows = validation
    return {
        **result.metrics(),
        "step_settings": step.as_json(),
        "cpu_tuning": tuning,
        "per_device_batch": request.train.per_device_batch,
        "seq_len": result.seq_len,
        "platform": request.platform,
        "processes": request.processes,
        "eval_rows": eval_rows,
        "val_split_rows": val_split_rows,
        **utilization(
            request.model,
            min(result.seq_len, request.model.max_seq_len),
            result.tokens_per_s,
            len(devices),
            devices[0].device_kind,
            step.precision,
        ),
    }
