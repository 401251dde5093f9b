"""How a training step runs, with every ``auto`` decided: the one place where a configuration
and a platform become concrete settings. They change the speed of a step, never what it
computes (to float rounding), so none of them enters a version key; the training manifest
records them (``step_settings``)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from ...config.settings import ModelConfig, TrainConfig
from .run_records import StepChoice

# XLA:CPU's YNNPACK fusions made the step's matrix products slower than its default dot
# emitter on the CPUs measured (bench/profile.py; docs/benchmarks.md): off by default there.
XLA_CPU_TUNED = {"xla_cpu_experimental_ynn_fusion_type": ""}
# On a CPU a step runs fastest when each forward/backward pass covers only a few hundred
# tokens: a pass's activations then stay in cache (docs/benchmarks.md, "Training step").
CPU_TOKENS_PER_PASS = 512


@dataclass(frozen=True)
class StepSettings:
    attention: str  # "xla" (jax.nn.dot_product_attention) or "custom" (model/network/kernels.py)
    dense: str  # "xla" (x @ w + b) or "custom"
    precision: str  # the compute dtype: "float32" or "bfloat16"; parameters stay float32
    rows_per_pass: int  # rows of each device's batch per forward/backward pass
    xla_options: dict[str, Any] = field(default_factory=dict)  # compiler options of the step
    sharding: str = "replicated"  # train.sharding: replicated or fsdp (model/training/placement.py)
    remat: bool = False  # train.remat: each block's activations recomputed in the backward pass

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
) -> StepSettings:
    """The concrete settings for ``platform``: what the user set, and for each ``auto`` the
    platform's default — the hand-written kernels, float32, ~512 tokens per pass and YNNPACK
    fusions off on a CPU; XLA's kernels, bfloat16 and one pass elsewhere — or, where given,
    the CPU step tuner's measured ``choice`` (``model/training/cpu_tuning.py``)."""
    default_kernel = choice["kernels"] if choice else "custom" if platform == "cpu" else "xla"
    kernels = {
        name: (default_kernel if model_cfg is None or getattr(model_cfg, name) == "auto" else getattr(model_cfg, name))
        for name in ("attention", "dense")
    }
    precision = (
        train_cfg.precision if train_cfg.precision != "auto" else ("float32" if platform == "cpu" else "bfloat16")
    )
    rows = (
        train_cfg.micro_batch
        or (choice["rows_per_pass"] if choice else None)
        or default_rows_per_pass(train_cfg.per_device_batch, seq_len, platform)
    )
    tuned = platform == "cpu" and (choice["xla"] if choice else "tuned") == "tuned"
    return StepSettings(
        kernels["attention"],
        kernels["dense"],
        precision,
        rows,
        dict(XLA_CPU_TUNED) if tuned else {},
        train_cfg.sharding,
        train_cfg.remat,
    )
