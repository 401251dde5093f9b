"""The records a training run hands on, typed: what crosses the process boundary and lands
in manifests, history files and trackers. Plain Python (no JAX): the stages, flows and
command line read them without loading the ML stack."""

from __future__ import annotations

from typing import NotRequired, TypedDict

from pydantic import JsonValue


class HistoryEntry(TypedDict):
    """One logged step of the loss record (``history.json``, the trackers, the plots)."""

    step: int
    loss: float
    perplexity: float
    tokens: int  # trained on so far
    val_loss: float | None  # the whole validation split, at an evaluation step
    val_bpb: float | None  # bits per byte
    seconds: float  # trained so far, evaluations left out


class StepChoice(TypedDict):
    """A CPU step's settings, as the tuner measures and keeps them (``cpu_tuning.py``)."""

    kernels: str  # "custom" (model/network/kernels.py) or "xla"
    rows_per_pass: int
    xla: str  # "tuned" (YNNPACK fusions off) or "default"


class MeasuredChoice(StepChoice):
    ms_per_step: float


class Tuning(TypedDict):
    """The CPU step's settings of a run: the one used, what was measured, and where it came from."""

    chosen: StepChoice
    measured: list[MeasuredChoice]
    source: str  # measured now, measured before (the cache file), or why nothing was measured
    note: NotRequired[str]


class Layout(TypedDict):
    """The devices a training state lies on and how (single, replicated or fsdp)."""

    devices: int
    layout: str


class KeptState(TypedDict):
    """``train.keep=best``: the step whose state a training stage delivers, and why."""

    step: int  # 0-based, as the history counts
    val_loss: float
    why: str


class StepMetrics(TypedDict):
    """What the training loop measured (``TrainResult.metrics``)."""

    tokens_per_s: float
    ms_per_step: float
    final_loss: float
    val_loss: float  # the whole validation split
    val_bpb: float  # bits per byte
    steps: int
    global_batch: int
    devices: int
    compile_s: float  # from lowering the step to its programs and the evaluation's compiled, ahead
    compile_each_s: dict[str, float]  # each of those programs' own seconds, compiled side by side
    compiled: dict[str, float | int]  # programs XLA compiled in the run, their seconds, persistent-cache hits
    elapsed_s: float
    resumed_from_step: int | None
    resume_s: float
    precision: str
    rows_per_pass: int
    layout: str
    step_memory: NotRequired[dict[str, int]]  # the compiled step's bytes per device
    resumed_layout: NotRequired[Layout | None]  # where the checkpoint resumed from was written
    kept: NotRequired[KeptState]  # train.keep=best: the step delivered (val_loss is its)


class Utilization(TypedDict):
    """How much of the devices' peak the training's arithmetic used (``utilization.py``)."""

    flops_per_token: int
    mfu: float | None  # a fraction of the peak; None where the peak is unknown
    peak_tflops: float | None  # one device's, in the compute dtype
    mfu_formula: str
    device_kind: str
    mfu_note: NotRequired[str]  # why there is no MFU


class TrainingMetrics(StepMetrics, Utilization):
    """A training version's figures (its manifest's ``metrics``): the loop's, the step's
    settings and the run's shape."""

    step_settings: dict[str, JsonValue]
    cpu_tuning: Tuning | None
    per_device_batch: int
    seq_len: int
    platform: str
    processes: int
    eval_rows: int
    val_split_rows: int
    reused_from: NotRequired[str]  # train_parallel on one device: train_single's version
