"""One training run, from Arrow files to a saved state: what a training stage does in its
own process, and what every process of a multi-process run does. No Prefect, no store."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import jax

from model.checkpoint import TrainingCheckpoints, params_digest, save_train_state
from model.config import TrainingRequest
from model.data import Batches, read_sequences
from model.train import CPU_TOKENS_PER_PASS, Placement, init_state, model_from_state, train, val_batches


EVAL_TOKENS = 1 << 16  # per device, on accelerators


@dataclass(frozen=True)
class RunFiles:
    train: Path  # Arrow files of the encode stage
    val: Path
    resume: Path  # the resumable checkpoints, kept until the run is published
    state: Path  # where the final training state goes (must not exist)
    saved: Callable[[], None] | None = None  # hears of each complete checkpoint (to copy it elsewhere)


def run_training(request: TrainingRequest, files: RunFiles, devices: list, parallel: bool,
                 on_step: Callable[[int, int], None] | None = None) -> dict[str, Any]:
    """Trains ``request`` on ``devices`` (``parallel``: a ``data`` mesh over them, which may
    span processes), resuming from the newest checkpoint in ``files.resume``, and saves the
    final state at ``files.state`` (every process calls this; process 0 writes). Returns the
    run's summary: metrics, loss history, a digest of the parameters, the devices."""
    placement = Placement.data_parallel(devices) if parallel else Placement.single(devices[0])
    global_batch = request.train.per_device_batch * len(devices)
    train_rows, _ = read_sequences(files.train)
    val_rows, _ = read_sequences(files.val)
    # Only this process's rows of every batch are read (memory-mapped) and placed.
    # The whole split is evaluated at every record. Accelerators want few large calls; a
    # CPU wants cache-sized ones (measured, cpu preset: 1.3 s per evaluation with 1,024
    # tokens per device and call, 3.3 s with 65,536).
    per_device = EVAL_TOKENS if placement.devices[0].platform != "cpu" else 2 * CPU_TOKENS_PER_PASS
    eval_rows = max(1, per_device // val_rows.shape[1]) * len(devices)
    val = [(rows[slice(*placement.rows(len(rows)))], weights[slice(*placement.rows(len(rows)))])
           for rows, weights in val_batches(val_rows, eval_rows, multiple=len(devices))]
    rows = placement.rows(global_batch)
    if jax.process_count() > 1:
        print(f"process {jax.process_index()} of {jax.process_count()}: rows [{rows[0]}, {rows[1]}) of every "
              f"global batch of {global_batch}, on {jax.local_device_count()} local device(s)", flush=True)
    model_cfg, train_cfg, xla_options, step_settings = request.model, request.train, None, None
    if placement.devices[0].platform == "cpu":  # measured on this CPU, once (model/cpu_tuning.py)
        from model.cpu_tuning import applied, choose

        step_settings = choose(model_cfg, train_cfg, placement, train_rows.shape[1])
        model_cfg, train_cfg, xla_options = applied(model_cfg, train_cfg, step_settings["chosen"])
    graphdef, state = init_state(model_cfg, train_cfg)
    checkpoints = TrainingCheckpoints(files.resume, request.train.keep_checkpoints, files.saved)
    try:
        result = train(graphdef, state, Batches(train_rows, global_batch, rows), val, placement,
                       train_cfg, on_step=on_step, checkpoints=checkpoints, stop_after=request.steps,
                       xla_options=xla_options)
    finally:
        checkpoints.close()
    save_train_state(files.state, result.state)
    metrics = {**result.metrics(), "step_settings": step_settings,
               "per_device_batch": request.train.per_device_batch, "seq_len": result.seq_len,
               "platform": request.platform, "processes": request.processes}
    return {"metrics": metrics, "history": result.history,
            "params_digest": params_digest(model_from_state(graphdef, result.state)),
            "devices": [str(d) for d in devices]}
