"""Per-device memory of a training step: what XLA measured for the compiled step
(``step_memory``), and what a configuration will need before anything is built
(``estimate``), so that a run that cannot fit is refused in one line before any work.

The estimate imports no JAX (the run's own process decides before JAX loads). Its
activation coefficients were fitted to XLA's own ``memory_analysis`` of the compiled step
on a CPU, over the codelab, cpu and gpt2 shapes, with and without remat (docs/benchmarks.md,
"Memory per device"); the bytes each value takes are the backend's (``_widths``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...config.settings import ConfigError, ModelConfig, TrainConfig
from ..network.parameters import Parameter, parameters
from .sharding import DATA_AXIS, is_split

GIB = 1 << 30
# Values kept per token and block for the backward pass, in the compute dtype, by attention
# kernel: (per attention score, heads x context: scores, probabilities, their gradients;
# per model feature, with the MLP's four-times-wider hidden layer folded in: its input and
# output, the attention's queries, keys and values, norms, residuals). The hand-written CPU
# kernel (model/network/kernels.py) keeps fewer scores; cuDNN's fused kernel keeps none, only
# its output and a float32 log-sum-exp per head and token (unmeasured: no GPU figure yet).
# Pallas's TPU kernels (splash, flash) keep what cuDNN's does.
ACTIVATION_TERMS = {
    "xla": (2.36, 30.6),
    "custom": (0.865, 32.1),
    "cudnn": (0.0, 30.6),
    "splash": (0.0, 30.6),
    "flash": (0.0, 30.6),
}
# With remat, the block being recomputed holds its own activations again while its gradient
# is taken (a little more than one block's worth), beside the blocks' parameters stacked
# for the loop.
RECOMPUTED_BLOCKS = 1.25
# XLA:TPU keeps fewer of them (it fuses more of a block's elementwise work into its products)
# and more while a block is recomputed: fitted to its memory_analysis of the gpt2 step on a TPU
# v5e, batch 16 and 32, with and without remat (docs/tpu-check.md).
TPU_ACTIVATION_TERMS = {"xla": (1.05, 14.2), "splash": (0.0, 14.2), "flash": (0.0, 22.9)}
TPU_RECOMPUTED_BLOCKS = 2.7


def _moments(parameter: Parameter, optimizer: str) -> int:
    """Optimizer moments kept per parameter: AdamW's two, or Muon's one for a block's matrix."""
    return 1 if optimizer == "muon" and len(parameter.shape) == 2 and parameter.in_block else 2


@dataclass(frozen=True)
class Estimate:
    parameters: int
    state_bytes: int  # parameters and optimizer state on one device
    gradient_bytes: int
    activation_bytes: int
    devices: int
    layout: str
    remat: bool
    gathered_bytes: int = 0  # FSDP: the split parameters gathered whole for the step

    @property
    def fixed_bytes(self) -> int:
        """What no batch, micro-batch or remat shrinks."""
        return self.state_bytes + self.gradient_bytes + self.gathered_bytes

    @property
    def total_bytes(self) -> int:
        return self.fixed_bytes + self.activation_bytes

    def as_json(self) -> dict[str, Any]:
        return {
            "parameters": self.parameters,
            "devices": self.devices,
            "layout": self.layout,
            "remat": self.remat,
            **{
                f"{name}_gib": round(getattr(self, f"{name}_bytes") / GIB, 2)
                for name in ("state", "gradient", "gathered", "activation", "total")
            },
        }


def estimate(  # noqa: PLR0913 - each argument a term of the estimate, as the pre-flight check has them
    model: ModelConfig,
    train: TrainConfig,
    devices: int,
    seq_len: int,
    rows_per_pass: int,
    precision: str,
    remat: bool | None = None,
    sharding: str | None = None,
    attention: str = "xla",
    platform: str = "cpu",
) -> Estimate:
    """What one device holds during a training step of ``model`` and ``train`` on
    ``devices`` data-parallel devices: parameters and optimizer state (split by the rule
    table under FSDP, ``model/training/sharding.py``, and then gathered whole for the step),
    the float32 gradient, and the activations kept for the backward
    pass of one ``rows_per_pass`` x ``seq_len`` pass in the compute dtype with the
    ``attention`` kernel (``remat``: only each block's input, and one block's activations at
    a time) on ``platform``."""
    remat = train.remat if remat is None else remat
    layout = "fsdp" if (train.sharding if sharding is None else sharding) == "fsdp" and devices > 1 else None
    layout = layout or ("replicated" if devices > 1 else "single")
    mesh = {DATA_AXIS: devices}
    state = 0
    every = parameters(model).values()
    for parameter in every:
        split = is_split(parameter.name, parameter.shape, layout, mesh)
        state += 4 * parameter.size * (1 + _moments(parameter, train.optimizer)) // (devices if split else 1)
    count = sum(parameter.size for parameter in every)
    width = 2 if precision == "bfloat16" else 4
    score_width, feature_width = _widths(platform, width)
    tokens = rows_per_pass * seq_len
    terms = TPU_ACTIVATION_TERMS if platform == "tpu" else ACTIVATION_TERMS
    scores, features = terms.get(attention, terms["xla"])
    per_block = tokens * (score_width * scores * model.num_heads * seq_len + feature_width * features * model.d_model)
    if remat:
        block_parameters = sum(parameter.size for parameter in every if parameter.in_block)
        activations = (
            model.num_layers * tokens * model.d_model * feature_width
            + (TPU_RECOMPUTED_BLOCKS if platform == "tpu" else RECOMPUTED_BLOCKS) * per_block
            + block_parameters * width
        )
    else:
        activations = model.num_layers * per_block
    gradients = 4 * count + (2 * count if width == 2 else 0)  # and the compute-dtype copy
    # Split parameters are gathered whole for the step (XLA's partitioned step, and the
    # micro-batch loop's per-device copies, ``model/training/step.py``): one float32 copy.
    gathered = 4 * count if layout == "fsdp" else 0
    return Estimate(count, state, gradients, int(activations), devices, layout, remat, gathered)


def _widths(platform: str, width: int) -> tuple[int, int]:
    """Bytes of an attention score and of any other kept value, for a compute dtype of
    ``width`` bytes. The softmax's scores are float32 whatever the compute dtype
    (``jax.nn.dot_product_attention`` and the hand-written kernel both take it in float32).
    XLA:CPU computes bfloat16 elementwise work in float32 and keeps it so (its temporaries in
    bfloat16 were measured equal to float32's); a GPU keeps the rest in the compute dtype
    (docs/benchmarks.md, "Memory per device")."""
    return 4, 4 if platform == "cpu" else width


def state_bytes_per_device(state) -> int:
    """What a placed state holds on its first device: parameters and optimizer state."""
    total = 0
    for leaf in _leaves(state):
        shards = leaf.addressable_shards
        total += shards[0].data.nbytes if shards else leaf.nbytes
    return total


def _leaves(tree):
    import jax

    return jax.tree.leaves(tree)


def step_memory(compiled, state) -> dict[str, int]:
    """The compiled step's memory on one device, as XLA reports it (``memory_analysis``):
    arguments (the state and a batch), outputs, temporaries (activations, gradients, the
    gathered parameters of FSDP), and the placed state alone."""
    figures = {"state_bytes": state_bytes_per_device(state)}
    analysis = compiled.memory_analysis()
    if analysis is None:  # a backend that does not say
        return figures
    for name in ("argument", "output", "temp", "alias", "generated_code"):
        value = getattr(analysis, f"{name}_size_in_bytes", None)
        if value is not None:
            figures[f"{name}_bytes"] = int(value)
    return figures


def compiled_needs(memory: dict[str, int]) -> int | None:
    """What a compiled step (``step_memory``'s figures) allocates on a device beyond its
    arguments, which are already there: temporaries and the outputs not written over a
    donated argument. None where XLA does not say."""
    if "temp_bytes" not in memory:
        return None
    return memory["temp_bytes"] + max(0, memory.get("output_bytes", 0) - memory.get("alias_bytes", 0))


def free_bytes(device) -> int | None:
    """What ``device`` has free now: its allocator's limit less what is in use (GPU, TPU), or
    for a CPU the host's available memory; None where neither is known."""
    try:
        stats = device.memory_stats()
    except Exception:  # noqa: BLE001 - a backend that cannot say raises its own error type
        stats = None
    if stats and "bytes_limit" in stats:
        return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
    try:
        for line in open("/proc/meminfo").read().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def check_compiled_fits(
    memory: dict[str, int], free: int | None, device: str, layout: str, remat: bool, passes: int, sharing: int = 1
) -> None:
    """A ``ConfigError`` in one line, naming what to lower, when the compiled step needs more
    than is ``free`` on ``device``: asked of the executable that will run, before its first
    step. ``sharing``: devices that draw on the same memory (emulated CPU devices share the host's)."""
    needed = compiled_needs(memory)
    if needed is None or free is None or needed * sharing <= free:
        return
    needed *= sharing
    fixes = [] if remat else ["train.remat=true"]
    fixes += ["train.sharding=fsdp"] if layout == "replicated" else []
    lower = "lower train.per_device_batch" + (" or train.micro_batch" if passes == 1 else "")
    raise ConfigError(
        f"the compiled training step needs {needed / GIB:.2f} GiB on {device} beyond its state and batch "
        f"(XLA's figure: temporaries and outputs), and {free / GIB:.2f} GiB is free: "
        + (f"set {' or '.join(fixes)}, or {lower}" if fixes else lower)
    )


def check_fits(
    model: ModelConfig, train: TrainConfig, devices: int, platform: str, seq_len: int, free_bytes: int | None
) -> Estimate:
    """The estimate of a training run on ``devices`` of ``platform``; a ``ConfigError`` naming
    the figure and the fix when it exceeds ``free_bytes`` (one device's; None: unknown)."""
    from .step_settings import resolve

    step = resolve(model, train, seq_len, platform, devices=devices)
    found = estimate(
        model, train, devices, seq_len, step.rows_per_pass, step.precision, attention=step.attention, platform=platform
    )
    if free_bytes is None or found.total_bytes <= free_bytes:
        return found
    if found.fixed_bytes > free_bytes:  # no batch, micro-batch or remat shrinks these
        raise ConfigError(_too_large(model, train, found, devices, platform, seq_len, step, free_bytes))
    fixes = []
    if devices > 1 and found.layout != "fsdp":
        fixes.append("train.sharding=fsdp")
    if not found.remat:
        fixes.append("train.remat=true")
    lower = "lower train.per_device_batch" + (" or train.micro_batch" if step.rows_per_pass > 1 else "")
    fix = f"set {' or '.join(fixes)}, or {lower}" if fixes else lower
    raise ConfigError(
        f"training needs about {found.total_bytes / GIB:.1f} GiB per device ({devices} {platform} device"
        f"{'s' if devices > 1 else ''}, {found.layout}{', remat' if found.remat else ''}: state "
        f"{found.state_bytes / GIB:.1f}, activations {found.activation_bytes / GIB:.1f} GiB), "
        f"{free_bytes / GIB:.1f} GiB free: {fix}"
    )


def _too_large(
    model: ModelConfig,
    train: TrainConfig,
    found: Estimate,
    devices: int,
    platform: str,
    seq_len: int,
    step,
    free_bytes: int,
) -> str:
    """The refusal of a model whose state and gradients alone exceed a device: what shrinks
    them (FSDP splits the state over devices; a smaller model all of it)."""
    fixed = found.fixed_bytes
    ways = []
    if found.gradient_bytes < free_bytes:  # the state is what FSDP splits; the gradient stays whole here
        sharded = estimate(
            model,
            train,
            devices,
            seq_len,
            step.rows_per_pass,
            step.precision,
            sharding="fsdp",
            attention=step.attention,
            platform=platform,
        )
        fits = devices > 1 and found.layout != "fsdp" and sharded.fixed_bytes < free_bytes
        ways.append("train.sharding=fsdp" if fits else "train.sharding=fsdp over more devices")
    ways.append("a smaller model (lower model.d_model or model.num_layers)")
    return (
        f"training needs about {found.total_bytes / GIB:.1f} GiB per device ({devices} {platform} device"
        f"{'s' if devices > 1 else ''}, {found.layout}): the model's state ({found.state_bytes / GIB:.1f} GiB) "
        f"and gradients{' with the parameters gathered whole' if found.gathered_bytes else ''} "
        f"({(found.gradient_bytes + found.gathered_bytes) / GIB:.1f} GiB) alone take {fixed / GIB:.1f} GiB, "
        f"more than the "
        f"{free_bytes / GIB:.1f} GiB free whatever the batch; use {' or '.join(ways)}"
    )
