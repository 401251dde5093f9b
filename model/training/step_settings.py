"""How a training step runs, with every ``auto`` decided: the one place where a configuration
and a platform become concrete settings. They change the speed of a step, never what it
computes (to float rounding), so none of them enters a version key; the training manifest
records them (``step_settings``)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from ...config.settings import ConfigError, ModelConfig, TrainConfig, dropout_generator
from .run_records import StepChoice

# Runs cuDNN's fused attention once at a run's shapes: (length, heads, head_dim, dtype) -> why
# it failed, or None (``model/network/kernels.py``: fused_attention_problem).
AttentionProbe = Callable[[int, int, int, str], str | None]
# cuDNN's fused kernel takes a head width that is a multiple of this, up to the maximum.
FUSED_HEAD_WIDTH = 8
FUSED_MAX_HEAD_DIM = 128
# Pallas's fused attention kernels for TPUs (model/network/kernels.py), and the one ``auto``
# takes there: measured against each other and XLA's on a TPU v5e (docs/tpu-check.md).
PALLAS_KERNELS = ("splash", "flash")
TPU_ATTENTION = "splash"
PALLAS_TILE = 128  # their tiles' length: the context must be a multiple (kernels.PALLAS_TILE)
# Below this context XLA's attention was as fast as splash's on a TPU v5e (docs/tpu-check.md).
PALLAS_MIN_CONTEXT = 1024

# XLA:CPU's YNNPACK fusions made the step's matrix products slower than its default dot
# emitter on the CPUs measured (bench/profile.py; docs/benchmarks.md): off by default there.
XLA_CPU_TUNED = {"xla_cpu_experimental_ynn_fusion_type": ""}
# On a CPU a step runs fastest when each forward/backward pass covers only a few hundred
# tokens: a pass's activations then stay in cache (docs/benchmarks.md, "Training step").
CPU_TOKENS_PER_PASS = 512
# Accelerators: enough steps in one compiled call that its arithmetic (about 10 ms at an
# H100's bfloat16 peak) dwarfs the host's cost of launching it, and no more than this many.
FLOPS_PER_CALL = 10e12
MAX_STEPS_PER_CALL = 16
# train.layers=auto by platform, with the reason the manifest records (the figures:
# docs/tpu-check.md and docs/benchmarks.md).
LAYERS_BY_PLATFORM = {
    "tpu": (
        "unrolled",
        "auto: on a TPU scanned blocks compiled faster but stepped about half again slower, more than a "
        "run's compile time wins back",
    ),
    "gpu": ("unrolled", "auto: unrolled blocks, the step measured on GPUs"),
    "cpu": ("unrolled", "auto: on a CPU scanned blocks compiled no faster and stepped slower"),
}


@dataclass(frozen=True)
class StepSettings:
    attention: (
        str  # "xla" (jax.nn.dot_product_attention), "custom" (model/network/kernels.py), "cudnn", "splash", "flash"
    )
    dense: str  # "xla" (x @ w + b) or "custom"
    precision: str  # the compute dtype: "float32" or "bfloat16"; parameters stay float32
    rows_per_pass: int  # rows of each device's batch per forward/backward pass
    xla_options: dict[str, Any] = field(default_factory=dict)  # compiler options of the step
    sharding: str = "replicated"  # train.sharding: replicated or fsdp (model/training/placement.py)
    remat: bool = False  # train.remat: each block's activations recomputed in the backward pass
    attention_note: str | None = None  # on a GPU or TPU: why its fused attention did not serve
    steps_per_call: int = 1  # optimizer steps per compiled call (train.steps_per_call)
    unroll: bool = False  # those steps written out one after another (a GPU), or a loop
    layers: str = "unrolled"  # train.layers resolved: the model's blocks "unrolled" or "scanned"
    layers_note: str = ""  # why, for auto
    generator: str = "threefry2x32"  # dropout's random bits (train.dropout_generator resolved)

    @property
    def scanned(self) -> bool:
        return self.layers == "scanned"

    def passes(self, per_device_batch: int) -> int:
        return per_device_batch // self.rows_per_pass

    def model(self, cfg: ModelConfig) -> ModelConfig:
        """``cfg`` with the kernels these settings chose: the model is built from this."""
        return cfg.model_copy(update={"attention": self.attention, "dense": self.dense})

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


def default_rows_per_pass(per_device_batch: int, seq_len: int, platform: str) -> int:
    if platform != "cpu":
        return per_device_batch  # accelerators want the largest matrices they can get
    rows = max(1, min(per_device_batch, CPU_TOKENS_PER_PASS // seq_len))
    while per_device_batch % rows:
        rows -= 1
    return rows


def resolve(
    model_cfg: ModelConfig | None,
    train_cfg: TrainConfig,
    seq_len: int,
    platform: str,
    choice: StepChoice | None = None,
    probe: AttentionProbe | None = None,
    processes: int = 1,
    devices: int = 1,
) -> StepSettings:
    """The concrete settings for ``platform``: what the user set, and for each ``auto`` the
    platform's default — the hand-written kernels, float32, ~512 tokens per pass and YNNPACK
    fusions off on a CPU; bfloat16, one pass, cuDNN's fused attention on a GPU where it can
    serve (``fused_attention_obstacle``; ``probe``: run it once on the device to be sure),
    Pallas's on a TPU where it can (``pallas_attention_obstacle``; ``devices``: the run's) and
    XLA's kernels elsewhere — or, where given, the CPU step tuner's measured ``choice``
    (``model/training/cpu_tuning.py``)."""
    default_kernel = choice["kernels"] if choice else "custom" if platform == "cpu" else "xla"
    kernels = {
        name: (default_kernel if model_cfg is None or getattr(model_cfg, name) == "auto" else getattr(model_cfg, name))
        for name in ("attention", "dense")
    }
    precision = (
        train_cfg.precision if train_cfg.precision != "auto" else ("float32" if platform == "cpu" else "bfloat16")
    )
    note = None
    asked = None if model_cfg is None else model_cfg.attention
    if asked in PALLAS_KERNELS and platform != "tpu":
        raise ConfigError(
            f"model.attention={asked} is Pallas's attention for TPUs, and this run trains on {platform}; "
            "set model.attention=auto"
        )
    if model_cfg is not None and platform == "tpu" and asked in ("auto", *PALLAS_KERNELS):
        note = pallas_attention_obstacle(model_cfg, seq_len, devices)
        if asked != "auto" and note:
            raise ConfigError(f"model.attention={asked} cannot serve: {note}; set model.attention=auto")
        kernels["attention"] = "xla" if note else (TPU_ATTENTION if asked == "auto" else asked)
    elif model_cfg is not None and platform not in ("cpu", "tpu") and asked in ("auto", "cudnn"):
        note = fused_attention_obstacle(model_cfg, precision, seq_len, platform, probe)
        if model_cfg.attention == "cudnn" and note:
            raise ConfigError(f"model.attention=cudnn cannot serve: {note}; set model.attention=auto")
        kernels["attention"] = "xla" if note else "cudnn"
    elif asked == "cudnn":
        raise ConfigError(
            f"model.attention=cudnn is cuDNN's attention for NVIDIA GPUs, and this run trains on {platform}; "
            "set model.attention=auto"
        )
    rows = (
        train_cfg.micro_batch
        or (choice["rows_per_pass"] if choice else None)
        or default_rows_per_pass(train_cfg.per_device_batch, seq_len, platform)
    )
    tuned = platform == "cpu" and (choice["xla"] if choice else "tuned") == "tuned"
    per_call = steps_per_call(model_cfg, train_cfg, seq_len, platform, processes)
    return StepSettings(
        kernels["attention"],
        kernels["dense"],
        precision,
        rows,
        dict(XLA_CPU_TUNED) if tuned else {},
        train_cfg.sharding,
        train_cfg.remat,
        note,
        per_call,
        # A GPU launches written-out steps as one graph; on a TPU a loop of them compiled
        # several times faster for a few percent of step time (docs/tpu-check.md).
        platform == "gpu" and per_call > 1,
        *layers_choice(train_cfg, platform),  # layers and why
        dropout_generator(train_cfg, platform),
    )


def layers_choice(train_cfg: TrainConfig, platform: str) -> tuple[str, str]:
    """``train.layers`` resolved, and why: remat's loop, the user's choice, or for auto what
    was measured on the platform (docs/benchmarks.md, docs/tpu-check.md)."""
    if train_cfg.remat:
        return "scanned", "train.remat: the blocks recomputed in one loop"
    if train_cfg.layers != "auto":
        return train_cfg.layers, f"train.layers={train_cfg.layers}"
    return LAYERS_BY_PLATFORM.get(platform, LAYERS_BY_PLATFORM["gpu"])


def steps_per_call(
    model_cfg: ModelConfig | None, train_cfg: TrainConfig, seq_len: int, platform: str, processes: int = 1
) -> int:
    """``train.steps_per_call``, or for 0 (auto): 1 on a CPU (its step is bound by arithmetic,
    not by launching it), elsewhere enough steps for ``FLOPS_PER_CALL`` (at most
    ``MAX_STEPS_PER_CALL``), lowered to a divisor of the intervals at which the loop needs the
    state, so that calls fill them. Several processes take one step a call: they agree on a
    stop at any step (``jax.experimental.multihost_utils``)."""
    if processes > 1:
        if train_cfg.steps_per_call > 1:
            raise ConfigError(
                f"train.steps_per_call={train_cfg.steps_per_call} runs in one process, and this run has "
                f"{processes}; set train.steps_per_call=0 (auto) or 1"
            )
        return 1
    if train_cfg.steps_per_call:
        return train_cfg.steps_per_call
    if platform == "cpu" or model_cfg is None:
        return 1
    from .utilization import flops_per_token

    per_step = flops_per_token(model_cfg, min(seq_len, model_cfg.max_seq_len)) * train_cfg.per_device_batch * seq_len
    wanted = max(1, min(MAX_STEPS_PER_CALL, int(FLOPS_PER_CALL // per_step)))
    intervals = math.gcd(train_cfg.log_every, train_cfg.eval_every or train_cfg.log_every, train_cfg.checkpoint_every)
    return max(k for k in range(1, wanted + 1) if intervals % k == 0)


def fused_attention_obstacle(
    model_cfg: ModelConfig, precision: str, seq_len: int, platform: str, probe: AttentionProbe | None = None
) -> str | None:
    """Why cuDNN's fused attention cannot compute this model's attention on ``platform``, in
    one line; None where it can (by its documented limits, then by ``probe``'s run)."""
    head_dim = model_cfg.d_model // model_cfg.num_heads
    if platform != "gpu":
        return f"cuDNN's fused attention runs on NVIDIA GPUs, not on {platform}"
    if precision != "bfloat16":
        return f"cuDNN's fused attention takes bfloat16 or float16, and the step computes in {precision}"
    if head_dim % FUSED_HEAD_WIDTH or head_dim > FUSED_MAX_HEAD_DIM:
        return (
            f"cuDNN's fused attention takes a head width that is a multiple of {FUSED_HEAD_WIDTH} up to "
            f"{FUSED_MAX_HEAD_DIM}, and model.d_model / model.num_heads = {head_dim}"
        )
    return probe(min(seq_len, model_cfg.max_seq_len), model_cfg.num_heads, head_dim, precision) if probe else None


def pallas_attention_obstacle(model_cfg: ModelConfig, seq_len: int, devices: int = 1) -> str | None:
    """Why Pallas's TPU attention does not serve this model's attention on a TPU, in one line;
    None where it does."""
    length = min(seq_len, model_cfg.max_seq_len)
    if length % PALLAS_TILE:
        return (
            f"Pallas's TPU attention takes a context that is a multiple of {PALLAS_TILE} bytes, and this run's "
            f"is {length} (data.seq_len)"
        )
    if length < PALLAS_MIN_CONTEXT:
        return (
            f"at a context under {PALLAS_MIN_CONTEXT} bytes XLA's attention is as fast as Pallas's, and this "
            f"run's is {length}"
        )
    if devices > 1:
        # XLA cannot split a Pallas kernel over devices: it would need the step's shard_map.
        return f"Pallas's TPU attention runs on one device, and this run trains on {devices}"
    return None
