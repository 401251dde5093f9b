"""Configuration as data: one typed home for every knob of the model, the data,
training and generation. Flows use these models as their typed parameters, the
CLI overrides them with ``--set section.field=value``."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    JsonValue,
    PrivateAttr,
    ValidationError,
    field_validator,
    model_validator,
)

from ..errors import BardflowError
from .vocabulary import BYTE_VALUES, BYTES, model_vocabulary

# Settings by dotted name (``train.learning_rate``) and their values as JSON gives them: what
# --set, a config file, a deployment's ``settings`` and a sweep's runs hand to ``build_config``.
Overrides = dict[str, JsonValue]

TINYSHAKESPEARE_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
TINYSHAKESPEARE_MD5 = "6fb458f1232090904fb40fe944165e91"
Kernel = Literal["auto", "xla", "custom"]
AttentionKernel = Literal["auto", "xla", "custom", "cudnn", "splash", "flash"]


class ConfigError(BardflowError, ValueError):
    """A configuration value is invalid; the message names the value and the fix."""


class _Section(BaseModel, frozen=True):
    # No NaN or infinity anywhere: a temperature or learning rate of Infinity is a typo.
    # Frozen, said by every section itself: a type checker then knows each hashable (a
    # section is a cache key of the compiled step).
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


Seed = Annotated[int, Field(ge=0, lt=2**32)]  # what numpy's and JAX's generators take without complaint
# A step count a run can mean: 10 M steps of the smallest preset take weeks on a GPU, and
# counts past 2**31 overflow the int32 step counter of the optimizer state.
MAX_STEPS = 10_000_000


@dataclass(frozen=True)
class CorpusFigures:
    """What a corpus's bytes come to: its checksums, its size and the byte values it holds."""

    md5: str
    sha256: str
    size: int
    seen: bytes  # the distinct byte values, sorted

    @property
    def distinct(self) -> int:
        return len(self.seen)


class DataConfig(_Section, frozen=True):
    corpus: str = Field(
        default=TINYSHAKESPEARE_URL,
        min_length=1,
        description="https URL, file:// URL or local "
        "path: a file or a folder; .gz, .xz, .zst and .zip are decompressed as they are read",
    )
    glob: str | None = Field(
        default=None,
        min_length=1,
        max_length=1_000,
        description="which of a folder's files "
        "are the corpus (e.g. '**/*.md'; ** is any depth); default: .txt files, compressed "
        "or not",
    )
    # None: computed from a local file or folder when the run starts, the known checksum of
    # the default download; any other download needs its own (it is checked against it).
    md5: str | None = Field(
        default=None, pattern=r"^[0-9a-f]{32}$", description="md5 of the corpus (a local one: computed)"
    )
    seq_len: int = Field(default=256, gt=1, description="bytes per training sequence")
    every_position: bool = Field(
        default=False,
        description="store windows of seq_len + 1 bytes, so that each of the model's seq_len "
        "positions learns to predict the next byte; the codelab's windows of seq_len bytes leave the last "
        "position without a target, and sampling from a full context suffers",
    )
    train_fraction: float = Field(default=0.9, gt=0.0, lt=1.0)
    shuffle_seed: Seed = 0
    # What a token is: a byte (the codelab's, and the default), or a byte-level BPE's id,
    # trained on the training split by the tokenize stage or read from a file.
    tokenizer: str = Field(
        default=BYTES,
        min_length=1,
        description="bytes (each byte a token) | bpe (a byte-level BPE trained on the training "
        "split, data.vocab_size ids) | a path to a byte-level BPE's tokenizer.json (yours or Hugging Face's)",
    )
    vocab_size: int = Field(
        default=4096, ge=257, le=1 << 20, description="data.tokenizer=bpe's ids: the 256 bytes and the merges it learns"
    )
    # The figures a run took of a local corpus before its first stage (``tasks/corpus_identity.pin``):
    # they travel with these settings to the fetch stage, which checks its copy and any stored
    # version against them. Never part of a key, a dump or a manifest.
    _figures: CorpusFigures | None = PrivateAttr(default=None)

    @property
    def figures(self) -> CorpusFigures | None:
        return self._figures

    def pinned(self, figures: CorpusFigures) -> DataConfig:
        """These settings for the corpus whose figures those are: its md5, and the figures."""
        copy = self.model_copy(update={"md5": figures.md5})
        # A frozen model's private attributes stay settable (pydantic freezes fields only).
        copy._figures = figures  # pyright: ignore[reportAttributeAccessIssue]
        return copy


class ModelConfig(_Section, frozen=True):
    vocab_size: int = Field(default=256, gt=0)
    d_model: int = Field(default=256, gt=0)
    num_heads: int = Field(default=4, gt=0)
    ffn_dim: int = Field(default=1024, gt=0)
    num_layers: int = Field(default=4, gt=0)
    max_seq_len: int = Field(default=256, gt=0)
    # learned: a table of absolute positions (the codelab). rope: rotary embeddings of the
    # queries and keys, which see only relative positions, so a sampler's cached keys stay
    # valid when its window slides.
    positions: Literal["learned", "rope"] = Field(default="learned", description="learned | rope")
    # Which implementation computes attention and the dense layers. Both compute the same
    # function (tested against each other); they differ in speed, so neither enters a
    # version key. auto: the hand-written gradients of model/network/kernels.py on CPU, where they
    # were measured faster; on a GPU cuDNN's fused attention where the device, dtype and shapes
    # allow, on a TPU Pallas's where the shapes allow (model/training/step_settings.py),
    # jax.nn.dot_product_attention and x @ w + b elsewhere.
    attention: AttentionKernel = Field(
        default="auto",
        description="auto | xla (jax.nn.dot_product_attention) | custom | cudnn (cuDNN's fused "
        "attention: NVIDIA GPUs, bfloat16) | splash | flash (Pallas's fused attention: TPUs, a context "
        "that is a multiple of 128)",
    )
    dense: Kernel = Field(default="auto", description="auto | xla (x @ w + b) | custom")
    # Small-model refinements from the modded-nanogpt speedrun records, each off by default
    # (the codelab's model) and measured alone on the cpu preset (docs/benchmarks.md).
    mlp: Literal["gelu", "relu2"] = Field(
        default="gelu", description="the MLP's activation: gelu | relu2 (ReLU squared)"
    )
    qk_norm: bool = Field(default=False, description="RMS-normalise each head's queries and keys before attention")
    zero_init: bool = Field(default=False, description="start the attention and MLP output projections at zero")
    logit_cap: float | None = Field(default=None, gt=0, description="cap the logits softly: cap * tanh(logits / cap)")
    dropout: float = Field(
        default=0.0,
        ge=0.0,
        lt=1.0,
        description="training's dropout on the embeddings and on what each block's attention and MLP add "
        "(nanoGPT's residual dropout; 0 = none)",
    )

    @model_validator(mode="after")
    def _heads_divide_width(self) -> ModelConfig:
        if self.d_model % self.num_heads:
            raise ValueError(
                f"d_model={self.d_model} is not divisible by num_heads={self.num_heads}; "
                "pick a num_heads that divides d_model"
            )
        if self.positions == "rope" and (self.d_model // self.num_heads) % 2:
            raise ValueError(
                f"positions=rope rotates pairs of features, but the head width d_model/num_heads="
                f"{self.d_model // self.num_heads} is odd; pick an even head width"
            )
        return self


class TrainConfig(_Section, frozen=True):
    steps: int = Field(default=500, gt=0, le=MAX_STEPS, description="timed optimizer steps per training stage")
    single_device_steps: int = Field(
        default=0,
        ge=0,
        description="steps train_single runs, of the same schedule: it measures one device's "
        "throughput for the comparison, which needs far fewer steps than training does. 0 = all of steps",
    )
    per_device_batch: int = Field(default=32, gt=0)
    learning_rate: float = Field(default=3e-4, gt=0.0, description="the peak learning rate")
    schedule: Literal["constant", "cosine"] = Field(
        default="constant",
        description="constant (the codelab), or cosine: linear warmup, then cosine decay to "
        "min_learning_rate_fraction of the peak at the last step",
    )
    warmup_steps: int = Field(
        default=0, ge=0, le=MAX_STEPS, description="steps of linear warmup from 0 to learning_rate"
    )
    min_learning_rate_fraction: float = Field(
        default=0.1, ge=0.0, le=1.0, description="cosine's floor, as a fraction of the peak"
    )
    grad_clip: float = Field(default=0.0, ge=0.0, description="clip the gradient's global norm to this; 0 = off")
    weight_decay: float = Field(default=1e-4, ge=0.0)
    optimizer: Literal["adamw", "muon"] = Field(
        default="adamw",
        description="adamw (the codelab), or muon: Muon (momentum orthogonalised by Newton-Schulz) "
        "for the blocks' weight matrices at muon_learning_rate, AdamW for embeddings, head, norms and biases",
    )
    muon_learning_rate: float = Field(default=0.02, gt=0.0, description="Muon's peak learning rate (same schedule)")
    muon_ns_steps: int = Field(
        default=5,
        ge=1,
        le=10,
        description="Newton-Schulz iterations (optax's 5) that orthogonalise Muon's update; "
        "fewer make a step cheaper and the update less orthogonal",
    )
    beta2: float = Field(
        default=0.999,
        gt=0.0,
        lt=1.0,
        description="AdamW's second-moment decay; 0.99 adapts "
        "faster, which suits short runs with small batches (nanoGPT's shakespeare_char)",
    )
    log_every: int = Field(default=100, gt=0, le=MAX_STEPS, description="record loss every N steps")
    eval_every: int = Field(
        default=0,
        ge=0,
        le=MAX_STEPS,
        description="evaluate the validation rows every N "
        "steps (from step 0) and after the last; 0 = at every record (log_every)",
    )
    eval_rows: int = Field(
        default=0,
        ge=0,
        description="validation rows evaluated, a fixed seeded choice when the "
        "split has more; 0 = auto: the whole split up to 30 global batches (about ten steps' "
        "cost) or a MiB of tokens, whichever is more",
    )
    init_seed: Seed = 1
    checkpoint_every: int = Field(
        default=100, gt=0, le=MAX_STEPS, description="save a resumable checkpoint every N steps"
    )
    keep_checkpoints: int = Field(default=2, gt=0, description="resumable checkpoints kept while training")
    precision: Literal["auto", "float32", "bfloat16"] = Field(
        default="auto",
        description="compute dtype; parameters and optimizer state stay float32. "
        "auto: bfloat16 on GPU/TPU, float32 on CPU (measured no faster in bfloat16, even with avx512_bf16)",
    )
    micro_batch: int = Field(
        default=0,
        ge=0,
        description="rows per forward/backward pass inside a step, gradients summed over "
        "the passes: the same update in cache-sized pieces. 0 = auto: about 512 tokens per pass "
        "on CPU, the whole per-device batch on GPU/TPU",
    )
    sharding: Literal["replicated", "fsdp"] = Field(
        default="replicated",
        description="how data-parallel devices hold the training state: replicated (a "
        "whole copy each) or fsdp (each parameter and its optimizer state split over the devices, gathered "
        "where used: a model larger than one device's memory)",
    )
    remat: bool = Field(
        default=False,
        description="recompute each block's activations in the backward pass "
        "instead of keeping them: less memory for about a third more compute",
    )
    keep: Literal["last", "best"] = Field(
        default="last",
        description="the state the stage delivers to checkpoint, export, verify and generate: last (the "
        "last step's) or best (the evaluated step of lowest validation loss; each better one is saved as "
        "it is found)",
    )
    steps_per_call: int = Field(
        default=0,
        ge=0,
        le=256,
        description="optimizer steps per compiled call, nothing read back between them (the same "
        "updates; hooks land on the same steps): a small step on a GPU otherwise waits on the host. "
        "0 = auto: 1 on a CPU, on GPU/TPU enough steps for ~10 TFLOP a call, at most 16, dividing the "
        "log, eval and checkpoint intervals; one process only",
    )

    layers: Literal["auto", "scanned", "unrolled"] = Field(
        default="auto",
        description="how the step runs the model's blocks: unrolled (one after another: each compiled "
        "apart, the fastest step on an accelerator) or scanned (one loop over their stacked parameters: "
        "compiled once whatever the depth). The same function either way. auto: the one measured faster to "
        "a trained model on the platform (model/training/step_settings.py); remat always scans",
    )
    dropout_generator: Literal["auto", "threefry2x32", "rbg", "unsafe_rbg"] = Field(
        default="auto",
        description="JAX's generator of dropout's random bits (model.dropout > 0): threefry2x32 "
        "(JAX's default), rbg or unsafe_rbg (XLA's RngBitGenerator: a fraction of threefry's cost on a "
        "TPU; a byte decides each value, the rate in 256ths). Each is reproducible from train.init_seed. "
        "auto: rbg on a TPU, threefry2x32 elsewhere",
    )

    @model_validator(mode="after")
    def _warmup_within_steps(self) -> TrainConfig:
        if self.warmup_steps >= self.steps:
            raise ValueError(
                f"warmup_steps={self.warmup_steps} leaves no step of training after it (steps="
                f"{self.steps}); use fewer warmup steps"
            )
        if self.single_device_steps > self.steps:
            raise ValueError(
                f"single_device_steps={self.single_device_steps} is more than steps={self.steps}; "
                "use at most steps, or 0 for all of them"
            )
        return self

    @model_validator(mode="after")
    def _micro_batch_divides_batch(self) -> TrainConfig:
        if self.micro_batch and self.per_device_batch % self.micro_batch:
            raise ValueError(
                f"micro_batch={self.micro_batch} does not divide per_device_batch={self.per_device_batch}; "
                "pick a divisor of per_device_batch, or 0 (auto)"
            )
        return self


MAX_PROMPTS, MAX_PROMPT_CHARS = 1_000, 10_000  # a config file cannot make a run sample for days


class Prompt(_Section, frozen=True):
    text: str = Field(min_length=1, max_length=MAX_PROMPT_CHARS)
    # Logits divided by more than 10 are all but equal (sampling is uniform noise), and a
    # temperature near float32's range overflows it.
    temperature: float = Field(default=0.8, ge=0.0, le=10.0, description="0 means greedy; at most 10")


class GenerateConfig(_Section, frozen=True):
    prompts: tuple[Prompt, ...] = Field(
        min_length=1,
        max_length=MAX_PROMPTS,
        default=(
            Prompt(text="ROMEO:", temperature=0.8),
            Prompt(text="To be, or not", temperature=0.6),
        ),
    )
    max_new_bytes: int = Field(default=300, gt=0, le=1_000_000)
    seed: Seed = 42


class VerifyConfig(_Section, frozen=True):
    tolerance: float = Field(
        default=1e-5, gt=0, description="largest |trained - restored| logit difference that passes"
    )
    init_seed: Seed = Field(default=99, description="seed of the fresh model; differs from training's")
    probe_sequences: int = Field(default=4, gt=0, description="validation sequences in the probe batch")


class TrackConfig(_Section, frozen=True):
    """Where a run reports its configuration and curves while it trains: nowhere by default.
    Never part of a version key: where a run is watched does not change what it builds."""

    mlflow: str | None = Field(
        default=None,
        min_length=1,
        description="MLflow tracking URI (sqlite:///path.db, http://host:5000, ...); the run is one MLflow run",
    )
    tensorboard: str | None = Field(
        default=None,
        min_length=1,
        description="folder for TensorBoard event files, one subfolder per run and training stage",
    )
    experiment: str | None = Field(
        default=None,
        min_length=1,
        description="MLflow experiment (default bardflow; a sweep's children: the sweep's own)",
    )

    @field_validator("mlflow")
    @classmethod
    def _a_database_or_server(cls, value: str | None) -> str | None:
        scheme = value.partition("://")[0].lower() if value is not None and "://" in value else "file"
        if value is not None and scheme == "file":
            raise ValueError(
                f"{value!r} is a folder; MLflow no longer keeps runs in a folder (its file store is refused), "
                "give a database: --track mlflow=sqlite:///PATH/mlflow.db (or an http:// tracking server)"
            )
        return value

    @field_validator("tensorboard")
    @classmethod
    def _local_folder(cls, value: str | None) -> str | None:
        if value is not None and "://" in value:
            raise ValueError(
                f"{value!r} is not a local folder; TensorBoard event files are written to a local "
                "folder (point TensorBoard's --logdir at it)"
            )
        return value


class PipelineConfig(_Section, frozen=True):
    data: DataConfig = DataConfig()
    model: ModelConfig = ModelConfig()
    train: TrainConfig = TrainConfig()
    verify: VerifyConfig = VerifyConfig()
    generate: GenerateConfig = GenerateConfig()
    track: TrackConfig = TrackConfig()

    @model_validator(mode="before")
    @classmethod
    def _vocabulary_of_the_tokenizer(cls, tree: Any) -> Any:
        return model_vocabulary(tree, DataConfig.model_fields["vocab_size"].default)

    @model_validator(mode="after")
    def _sections_agree(self) -> PipelineConfig:
        if self.data.seq_len > self.model.max_seq_len:
            raise ValueError(
                f"data.seq_len={self.data.seq_len} is larger than model.max_seq_len="
                f"{self.model.max_seq_len}; lower data.seq_len or raise model.max_seq_len"
            )
        if self.data.tokenizer != BYTES:
            return self  # the vocabulary is the tokenizer's (above)
        if self.model.vocab_size < BYTE_VALUES:
            raise ValueError(
                f"model.vocab_size={self.model.vocab_size} is smaller than the {BYTE_VALUES} byte values "
                f"the data holds; set model.vocab_size={BYTE_VALUES}"
            )
        if self.model.vocab_size > BYTE_VALUES:  # ids past 255 never occur, and sampling could not print them
            raise ValueError(
                f"model.vocab_size={self.model.vocab_size} is larger than the {BYTE_VALUES} byte values the data "
                f"can hold; set model.vocab_size={BYTE_VALUES}"
            )
        return self


class TrackingTarget(_Section, frozen=True):
    """Where one training stage writes its records as they happen (model/training/trackers.py)."""

    stage: str
    mlflow: str | None = None  # tracking URI
    mlflow_run: str | None = None  # the pipeline run's MLflow run id
    tensorboard: str | None = None  # this stage's event folder


class TrainingRequest(_Section, frozen=True):
    """What a training stage trains, and on what: ``devices`` (of all processes together),
    ``platform`` and ``processes`` are part of the version key, since the same recipe on
    other hardware is another measurement."""

    model: ModelConfig
    train: TrainConfig
    devices: int = Field(gt=0)
    platform: str
    processes: int = Field(default=1, gt=0)
    stop_after: int | None = Field(
        default=None,
        gt=0,
        description="run only the first N steps of train.steps' "
        "schedule (train_single's throughput measurement); None = all",
    )
    report: TrackingTarget | None = None  # where its records go as it trains; not part of the recipe
    # The validation text's bytes per token (the encode stage's figure; 1 for bytes): the loss
    # per token becomes bits per byte, the measure that compares tokenizers. Not part of the
    # recipe: the encode version, which keys the training stages, decides it.
    bytes_per_token: float = Field(default=1.0, gt=0)

    @property
    def steps(self) -> int:
        """The steps this request runs."""
        return min(self.stop_after or self.train.steps, self.train.steps)

    def recipe(self) -> dict[str, Any]:
        """What decides the trained state: not how often it is checkpointed, nor which of
        two equal kernels computes it, nor how far the other training stage runs."""
        # sharding, remat and steps_per_call change where and when a step computes, not what
        # (to float rounding).
        recipe = self.model_dump(
            mode="json",
            exclude={
                "train": {
                    "checkpoint_every",
                    "keep_checkpoints",
                    "single_device_steps",
                    "sharding",
                    "remat",
                    "steps_per_call",
                    "layers",
                    "dropout_generator",
                },
                "model": {"attention", "dense"},
                "report": True,
                "bytes_per_token": True,
            },
        )
        if self.stop_after is None:  # keys of full runs stay what they were
            del recipe["stop_after"]
        for field in (
            "muon_ns_steps",
            "eval_every",
            "eval_rows",
            "keep",
        ):  # at their defaults, keys from before them stay
            if getattr(self.train, field) == TrainConfig.model_fields[field].default:
                del recipe["train"][field]
        if self.model.dropout == ModelConfig.model_fields["dropout"].default:
            del recipe["model"]["dropout"]
        else:  # other random bits, another trained state; keys of JAX's default generator stay
            generator = dropout_generator(self.train, self.platform)
            if generator != DEFAULT_GENERATOR:
                recipe["train"]["dropout_generator"] = generator
        return recipe


DEFAULT_GENERATOR = "threefry2x32"  # JAX's


def dropout_generator(train: TrainConfig, platform: str) -> str:
    """The generator of dropout's bits on ``platform``: ``train.dropout_generator``, or for
    auto rbg on a TPU (threefry's bits cost a TPU a large part of the ``quality`` step and of
    its compile time, docs/tpu-check.md) and JAX's default elsewhere (every CPU and GPU loss
    as before)."""
    if train.dropout_generator != "auto":
        return train.dropout_generator
    return "rbg" if platform == "tpu" else DEFAULT_GENERATOR


# The presets, each a file users copy (presets/NAME.yaml, its reasons in its comments), in
# the order `bardflow presets` lists them.
PRESET_FILES = Path(__file__).with_name("presets")
PRESET_NAMES = ("codelab", "cpu", "quality", "gpt2", "tiny")


def _preset(name: str) -> dict[str, dict[str, Any]]:
    import yaml  # with the presets only: the settings' types load without it

    return yaml.safe_load((PRESET_FILES / f"{name}.yaml").read_text()) or {}


PRESETS: dict[str, dict[str, dict[str, Any]]] = {name: _preset(name) for name in PRESET_NAMES}


def _describe(error: ValidationError) -> str:
    """Each true problem once. A list whose item was refused is also "too short" once that
    item is dropped: that clause is an echo of the item's, not a second problem."""
    items = error.errors()
    locations = [tuple(item["loc"]) for item in items]
    parts = []
    for item, loc in zip(items, locations, strict=True):
        if item["type"] == "too_short" and any(other[: len(loc)] == loc and other != loc for other in locations):
            continue
        where = ".".join(str(p) for p in loc) or "config"
        given = item.get("input")
        shown = f" (given {given!r})" if isinstance(given, str | int | float) and len(repr(given)) <= 40 else ""
        parts.append(f"{where}: {item['msg'].removeprefix('Value error, ')}{shown}")
    return "; ".join(parts)


def _did_you_mean(dotted: str) -> str:
    """``; did you mean train.steps?`` for a setting spelled nearly like one that exists."""
    import difflib

    known = [
        f"{section}.{name}"
        for section, info in PipelineConfig.model_fields.items()
        for name in getattr(info.annotation, "model_fields", {})
    ]
    close = difflib.get_close_matches(dotted, known, n=1, cutoff=0.75)
    return f" (did you mean {close[0]}?)" if close else ""


def build_config(preset: str, overrides: Overrides | None = None) -> PipelineConfig:
    """The preset's config with dotted ``section.field`` overrides applied and validated."""
    if preset not in PRESETS:
        raise ConfigError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    tree = {section: dict(values) for section, values in PRESETS[preset].items()}
    for dotted, value in (overrides or {}).items():
        section, _, field = dotted.partition(".")
        known = PipelineConfig.model_fields.get(section)
        fields = getattr(known.annotation, "model_fields", {}) if known is not None else {}
        if not field or field not in fields:
            raise ConfigError(
                f"unknown setting {dotted!r}{_did_you_mean(dotted)}; settings are section.field with section in "
                f"{', '.join(PipelineConfig.model_fields)} (see `bardflow presets --json`)"
            )
        tree.setdefault(section, {})[field] = value
    try:
        return PipelineConfig.model_validate(tree)
    except ValidationError as error:
        raise ConfigError(f"invalid configuration: {_describe(error)}") from error
