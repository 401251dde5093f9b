"""Stages 3 and 4: train on the first device, then data-parallel on every device.

Both run the same compiled step and loop (``model.train``); only the placement
differs. The version holds the final training state (Orbax), the loss history and
the throughput figures.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import jax
from pydantic import BaseModel, ConfigDict, Field

from artifacts import ui
from artifacts.store import Builder, Store, canonical_json
from model.checkpoint import TrainingCheckpoints, params_digest, save_train_state
from model.config import ModelConfig, TrainConfig
from model.data import Batches, read_sequences
from model.distributed import ProcessGroup
from model.train import Placement, TrainingError, init_state, model_from_state, train, val_batches
from tasks.encode import TRAIN, VAL
from tasks.stage import Stage, inputs
from tasks.train_process import RESULT, ProcessFailure, launch_leader, launch_local


def _recipe(request: "TrainingRequest") -> dict[str, Any]:
    """How often to checkpoint does not change what training produces."""
    return request.model_dump(mode="json", exclude={"train": {"checkpoint_every", "keep_checkpoints"}})


# "2": one query/key/value projection per block (model/transformer.py), so a state of "1" differs.
SINGLE = Stage("train_single", "2", key_params=_recipe)
PARALLEL = Stage("train_parallel", "2", key_params=_recipe)
STATE, HISTORY = "state", "history.json"


class TrainingRequest(BaseModel):
    """What a training stage needs; ``devices``, ``processes`` and ``platform`` are part
    of the version key, since the same recipe on other hardware is another measurement.
    ``devices`` counts the devices of all processes together."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    model: ModelConfig
    train: TrainConfig
    devices: int
    platform: str
    processes: int = Field(1, gt=0)


def hardware() -> tuple[int, str]:
    return len(jax.devices()), jax.default_backend()


def _run(stage: Stage, request: TrainingRequest, upstream: dict, store: str, force: bool) -> dict:
    data = inputs(store, upstream)["encode"]
    resume_dir = Store(store).resume_dir(stage.name, stage.key(request, upstream))

    def work(out: Builder) -> None:
        if stage is PARALLEL and request.processes > 1:  # also every cluster run: see parallel_request
            return _work_in_processes(request, data, resume_dir, out)
        visible, platform = hardware()
        if stage is PARALLEL and (visible, platform) != (request.devices, request.platform):
            raise TrainingError(
                f"this process sees {visible} {platform} device(s) but the run asked for "
                f"{request.devices} {request.platform}; start the run where those devices are visible"
            )
        devices = jax.devices() if stage is PARALLEL else jax.devices()[:1]
        placement = Placement.data_parallel(devices) if stage is PARALLEL else Placement.single(devices[0])
        if stage is PARALLEL and len(devices) == 1:
            ui.log("train_parallel: only one device is visible, so this run is not data-parallel")
        global_batch = request.train.per_device_batch * len(devices)
        train_rows, _ = read_sequences(data.file(TRAIN))
        val_rows, _ = read_sequences(data.file(VAL))
        graphdef, state = init_state(request.model, request.train)
        label = f"{stage.name} ({len(devices)} {platform} device{'s' if len(devices) > 1 else ''}, batch {global_batch})"
        checkpoints = TrainingCheckpoints(resume_dir, request.train.keep_checkpoints)
        try:
            with ui.Progress(stage.name, request.train.steps, label) as progress:
                result = train(
                    graphdef,
                    state,
                    Batches(train_rows, global_batch),
                    val_batches(val_rows, global_batch, multiple=len(devices)),
                    placement,
                    request.train,
                    on_step=progress,
                    checkpoints=checkpoints,
                )
        finally:
            checkpoints.close()
        if result.resumed_from is not None:
            ui.log("%s resumed from its checkpoint at step %d (restored in %.1f s)",
                   stage.name, result.resumed_from, result.resume_s)
        save_train_state(out.path(STATE), jax.device_get(result.state))
        _finish(stage, out, run_metrics(result, request), result.history,
                params_digest(model_from_state(graphdef, result.state)), [str(d) for d in devices])

    return stage.produce(request, upstream, store, force, work)


def _finish(stage: Stage, out: Builder, metrics: dict[str, Any], history: list[dict[str, Any]],
            digest: str, devices: list[str]) -> None:
    """Everything of a training version but its state: history, metrics, fingerprint, UI."""
    out.path(HISTORY).write_text(json.dumps(history, indent=1))
    out.metrics.update(metrics)
    out.record["devices"] = devices
    out.record["resumed_from_step"] = metrics["resumed_from_step"]
    out.fingerprint = hashlib.sha256((digest + canonical_json(history) + canonical_json(metrics)).encode()).hexdigest()
    _publish(stage, history, metrics)


def run_metrics(result, request: TrainingRequest) -> dict[str, Any]:
    return {**result.metrics(), "per_device_batch": request.train.per_device_batch, "seq_len": result.seq_len,
            "platform": request.platform, "processes": request.processes}


def _work_in_processes(request: TrainingRequest, data, resume_dir, out: Builder) -> None:
    """``train_parallel`` as cooperating processes: this host's are started here and
    waited for; the run's own files come from them, the manifest from here."""
    group = ProcessGroup.from_env()
    launch = resume_dir / "launch"
    launch.mkdir(parents=True, exist_ok=True)
    spec = {"request": request.model_dump(mode="json"), "train_file": str(data.file(TRAIN)),
            "val_file": str(data.file(VAL)), "out_dir": str(out.dir), "resume_dir": str(resume_dir),
            "result_file": str(launch / RESULT)}
    (launch / RESULT).unlink(missing_ok=True)
    (launch / "spec.json").write_text(json.dumps(spec, indent=1))
    label = f"train_parallel ({request.processes if group is None else group.num_processes} processes, " \
            f"{request.devices} {request.platform} devices, batch {request.train.per_device_batch * request.devices})"
    try:
        with ui.Progress(PARALLEL.name, request.train.steps, label) as progress:
            if group is None:
                launch_local(launch / "spec.json", request.processes, request.devices // request.processes,
                             request.platform, on_step=progress)
            else:
                launch_leader(launch / "spec.json", on_step=progress)
    except ProcessFailure as failure:
        kept = TrainingCheckpoints.steps(resume_dir)
        resume = (f"rerun to resume from the checkpoint of step {kept[-1]}" if kept
                  else "no checkpoint was written yet, so a rerun starts from step 0")
        raise TrainingError(f"train_parallel failed: {failure}\n{resume}") from None
    result = json.loads((launch / RESULT).read_text())
    if result["metrics"]["resumed_from_step"] is not None:
        ui.log("train_parallel resumed from its checkpoint at step %d", result["metrics"]["resumed_from_step"])
    _finish(PARALLEL, out, result["metrics"], result["history"], result["params_digest"], result["devices"])


def _publish(stage: Stage, history: list[dict[str, Any]], metrics: dict[str, Any]) -> None:
    rows = [
        {"step": h["step"], "loss": round(h["loss"], 4), "perplexity": round(h["perplexity"], 2),
         "tokens": h["tokens"]}
        for h in history
    ]
    ui.table(
        stage.name,
        rows,
        description=(
            f"{stage.name}: {metrics['tokens_per_s']:,.0f} tokens/s, {metrics['ms_per_step']:.1f} ms/step, "
            f"{metrics['devices']} device(s), global batch {metrics['global_batch']}, "
            f"val loss {metrics['val_loss']:.4f}, compile {metrics['compile_s']:.1f} s"
            + (f", resumed from step {metrics['resumed_from_step']}" if metrics["resumed_from_step"] else "")
        ),
    )


@SINGLE.task
def train_single(params: TrainingRequest, upstream: dict, store: str, force: bool = False) -> dict:
    return _run(SINGLE, params, upstream, store, force)


@PARALLEL.task
def train_parallel(params: TrainingRequest, upstream: dict, store: str, force: bool = False) -> dict:
    return _run(PARALLEL, params, upstream, store, force)


def trained_model(version):
    """The model at the end of a training version, rebuilt from its own recorded request."""
    from model.checkpoint import load_train_state

    request = TrainingRequest.model_validate(version.manifest["params"])
    graphdef, template = init_state(request.model, request.train)
    state = load_train_state(version.file(STATE), template)
    return model_from_state(graphdef, state), request
