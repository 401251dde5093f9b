"""Stages 3 and 4: train on the first device, then data-parallel on every device.

Both run the same compiled step and loop (``model/training/training_run.py``); only the placement
differs. The version holds the final training state (Orbax), the loss history and
the throughput figures. ``train_parallel`` may run as several processes (``processes/launch.py``).
"""

from __future__ import annotations

import hashlib
import json
import shutil

import jax
from flax import nnx

from ..artifacts.manifest import canonical_json
from ..artifacts.resume import resume_or_adopt
from ..artifacts.store import Builder, Version
from ..config.settings import TrainingRequest
from ..model.training import trackers as tracking
from ..model.training.checkpoint import TrainingCheckpoints, load_train_state
from ..model.training.memory import compiled_needs
from ..model.training.step import TrainingError, init_state, model_from_state
from ..model.training.training_run import RunFiles, TrainingResult, run_training
from ..processes import stopping
from ..processes.distributed import ProcessGroup, hardware
from ..processes.launch import ProcessFailure, launch_leader, launch_local
from . import report, train_process
from .encode import TRAIN, VAL
from .registry import HISTORY, STATE, TRAIN_PARALLEL, TRAIN_SINGLE

RESULT = "result.json"  # process 0's summary of a multi-process run


def _files(encode: Version, out: Builder) -> RunFiles:
    """Checkpoints stay in ``out.resume`` (local); on an object store each complete one is
    copied to the bucket as well, so a rerun on another machine picks it up."""
    return RunFiles(
        train=encode.file(TRAIN),
        val=encode.file(VAL),
        resume=out.resume.path,
        state=out.path(STATE),
        saved=out.resume.push if out.resume.url else None,
        shards=encode.manifest.get("shards"),
        bring=encode.bring,
    )


def _per_byte(settings: TrainingRequest, encode: Version) -> TrainingRequest:
    """The request with its split's bytes per token (a tokenizer's run), for bits per byte."""
    return settings.model_copy(update={"bytes_per_token": encode.metrics.get("val_bytes_per_token", 1.0)})


def build_single(settings: TrainingRequest, out: Builder, encode: Version) -> None:
    settings = _per_byte(settings, encode)
    device = jax.devices()[0]
    label = f"train_single (1 {device.platform} device, batch {settings.train.per_device_batch})"
    if settings.steps < settings.train.steps:
        label = label[:-1] + f"; {settings.steps} of {settings.train.steps} steps)"
    resume_or_adopt(out.resume, settings, lambda line: report.say("%s: %s", TRAIN_SINGLE.name, line))
    with out.resume.writing(), report.progress(TRAIN_SINGLE.name, settings.steps, label) as progress:
        summary = run_training(
            settings,
            _files(encode, out),
            [device],
            parallel=False,
            on_step=progress,
            warn=report.warning,
            note=report.say,
        )
    _finish(TRAIN_SINGLE.name, out, summary)


def build_parallel(settings: TrainingRequest, out: Builder, encode: Version, train_single: Version) -> None:
    if train_single.manifest["params"] == TRAIN_PARALLEL.recipe(settings):
        return _reuse(train_single, out)
    settings = _per_byte(settings, encode)
    resume_or_adopt(out.resume, settings, lambda line: report.say("%s: %s", TRAIN_PARALLEL.name, line))
    files = _files(encode, out)
    if settings.processes > 1:  # also every cluster run: see RunPlan.parallel_training
        return _build_in_processes(settings, files, out, encode)
    visible, platform = hardware()
    if (visible, platform) != (settings.devices, settings.platform):
        raise TrainingError(
            f"this process sees {visible} {platform} device(s) but the run asked for "
            f"{settings.devices} {settings.platform}; start the run where those devices are visible"
        )
    if platform == "cpu" and visible > 1:
        # Emulated CPU devices share one process, and XLA:CPU ends that whole process
        # (SIGABRT, a page of C++ stack trace) when a collective between them stalls: one
        # supervised process trains instead, so that such an end is this stage's one-line
        # failure and the run goes on reporting it (docs/reliability.md).
        return _build_in_processes(settings, files, out, encode)
    label = (
        f"train_parallel ({visible} {platform} device{'s' if visible > 1 else ''}{_sharded(settings)}, "
        f"batch {settings.train.per_device_batch * visible})"
    )
    with out.resume.writing(), report.progress(TRAIN_PARALLEL.name, settings.steps, label) as progress:
        summary = run_training(
            settings,
            files,
            jax.devices()[:visible],
            parallel=True,
            on_step=progress,
            warn=report.warning,
            note=report.say,
        )
    _finish(TRAIN_PARALLEL.name, out, summary)


def _reuse(train_single: Version, out: Builder) -> None:
    """One device, one process: data-parallel training would repeat train_single's
    computation step for step, so its version is taken over instead of trained again."""
    report.say(
        "train_parallel: only one device is visible, so data-parallel training would repeat train_single "
        "exactly; reusing its version %s (on a CPU, emulate devices with --cpu-devices)",
        train_single.key,
    )
    shutil.copytree(train_single.file(STATE), out.path(STATE))
    shutil.copyfile(train_single.file(HISTORY), out.path(HISTORY))
    out.metrics.update({**train_single.metrics, "reused_from": train_single.key})
    out.record.update(
        {"devices": train_single.manifest.get("devices"), "resumed_from_step": None, "reused_from": train_single.key}
    )
    out.fingerprint = train_single.fingerprint


def _build_in_processes(settings: TrainingRequest, files: RunFiles, out: Builder, encode: Version) -> None:
    """This host's processes are started here and waited for; the state comes from them,
    the version's other files and its manifest from here. Processes on other hosts find
    the data through the store (``tasks/train_process.py``)."""
    group = ProcessGroup.from_env()
    launch = files.resume / "launch"
    launch.mkdir(parents=True, exist_ok=True)
    spec = {
        "request": settings.model_dump(mode="json"),
        "result": str(launch / RESULT),
        **{name: str(getattr(files, name)) for name in ("train", "val", "resume", "state")},
        "store": encode.store,
        "encode": encode.key,
        "resume_url": out.resume.url,
    }
    (launch / RESULT).unlink(missing_ok=True)
    (launch / "spec.json").write_text(json.dumps(spec, indent=1))
    processes = settings.processes if group is None else group.num_processes
    where = f"{processes} processes, " if processes > 1 else ""
    label = (
        f"train_parallel ({where}{settings.devices} {settings.platform} devices{_sharded(settings)}, "
        f"batch {settings.train.per_device_batch * settings.devices})"
    )
    try:
        with report.progress(TRAIN_PARALLEL.name, settings.steps, label) as progress:
            if group is None:
                launch_local(
                    train_process,
                    launch / "spec.json",
                    settings.processes,
                    settings.devices // settings.processes,
                    settings.platform,
                    on_step=progress,
                    on_warning=_relay(settings),
                    on_note=report.say,
                )
            else:
                launch_leader(
                    train_process,
                    launch / "spec.json",
                    on_step=progress,
                    on_warning=_relay(settings),
                    on_note=report.say,
                )
    except (ProcessFailure, stopping.Stopped) as failure:
        raise parallel_failure(failure, TrainingCheckpoints.steps(files.resume), settings.platform, processes) from (
            None if isinstance(failure, stopping.Stopped) else failure
        )
    _finish(TRAIN_PARALLEL.name, out, TrainingResult.from_json((launch / RESULT).read_text()))


def parallel_failure(
    failure: ProcessFailure | stopping.Stopped, kept: list[int], platform: str, processes: int
) -> TrainingError | stopping.Stopped:
    """What train_parallel's end says: how it ended, and where a rerun goes on from."""
    resume = (
        f"rerun the same command to resume from the checkpoint of step {kept[-1]}"
        if kept
        else "no checkpoint was written yet, so a rerun starts from step 0"
    )
    if isinstance(failure, stopping.Stopped):
        return stopping.Stopped(failure.exit_code - 128, f"{failure} during train_parallel; {resume}")
    if platform == "cpu" and processes == 1 and failure.signalled:  # an abort in a collective between devices
        resume += ", or pass --cpu-devices 1 to train without collectives between emulated devices"
    separator = "; " if "\n" not in str(failure) else "\n"  # a log's last lines stay below the message
    return TrainingError(f"train_parallel failed: {failure}{separator}{resume}")


def _relay(settings: TrainingRequest):
    """A training process's warning, to this stage's log. It is about a tracker (the one
    thing a training process warns of), which is then off here too: one warning, not two."""

    def relay(message: str) -> None:
        report.warning(message)
        tracking.turn_off(settings.report, message)

    return relay


def training_fingerprint(summary: TrainingResult) -> str:
    """What was trained, not how fast: the weights and the loss record without its clock. The
    same weights retrained (say --refresh train_parallel) leave every reader of them cached."""
    outcome = [{k: v for k, v in h.items() if k != "seconds"} for h in summary.history]
    return hashlib.sha256((summary.params_digest + canonical_json(outcome)).encode()).hexdigest()


def _sharded(settings: TrainingRequest) -> str:
    """The label's word for a layout other than one copy a device."""
    return ", fsdp" if settings.train.sharding == "fsdp" else ""


def _finish(stage: str, out: Builder, summary: TrainingResult) -> None:
    """Everything of a training version but its state: history, metrics, fingerprint, UI."""
    metrics, history = summary.metrics, summary.history
    out.path(HISTORY).write_text(json.dumps(history, indent=1))
    out.metrics.update(metrics)
    out.record["devices"] = summary.devices
    out.record["resumed_from_step"] = metrics["resumed_from_step"]
    out.fingerprint = training_fingerprint(summary)
    memory = metrics.get("step_memory") or {}
    if metrics["layout"] == "fsdp" and "argument_bytes" in memory:
        held = memory["argument_bytes"] + (compiled_needs(memory) or 0)
        report.say(
            "%s: fsdp over %d devices, %s a device (the compiled step's state, batch and temporaries; XLA's figure)",
            stage,
            metrics["devices"],
            f"{held / 2**30:.2f} GiB" if held >= 2**30 else f"{held / 2**20:.1f} MiB",
        )
    if metrics["resumed_from_step"] is not None:
        report.log(
            "%s resumed from its checkpoint at step %d (restored in %.1f s)",
            stage,
            metrics["resumed_from_step"],
            metrics["resume_s"],
        )


def trained_model(version: Version):
    """The model at the end of a training version, rebuilt from its own recorded request."""
    request = TrainingRequest.model_validate(version.manifest["params"])
    # Only shapes: initialising op by op only to overwrite the values took seconds a stage.
    graphdef, template = nnx.eval_shape(lambda: init_state(request.model, request.train))
    state = load_train_state(version.file(STATE), template)
    return model_from_state(graphdef, state), request
