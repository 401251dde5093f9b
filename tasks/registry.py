"""The pipeline's stages, in order: the one list that the flow, the command line and the
tests read. Each entry says what decides the stage, what it reads and what it builds; its
work is the ``build`` function of ``tasks/<name>.py``. Adding a stage is one new module and
one entry here (docs/architecture.md, "Stages").

Importing this module is cheap (no JAX, no Prefect): the command line reads it first.
"""

from __future__ import annotations

from ..config.settings import TrainingRequest
from ..config.vocabulary import BPE, BYTES
from .stage import RunPlan, Stage

FETCH = Stage(
    "fetch",
    "1",
    reads=(),
    settings=lambda run: run.config.data,
    recipe=lambda data: {"md5": data.md5},  # the same bytes from a mirror are the same corpus
    builds=("corpus.txt",),
    headline=("bytes", "md5", "distinct_bytes"),
    accept="corpus_identity:accept",
)
# Where data.tokenizer is not bytes: a byte-level BPE trained on a sample of the training
# split (bpe), or a tokenizer.json read and checked (a path, its sha256 in the key).
TOKENIZE = Stage(
    "tokenize",
    "1",
    reads=("fetch",),
    settings=lambda run: run.config.data,
    recipe=lambda data: tokenizer_recipe(data),
    builds=("tokenizer.json",),
    headline=("vocab_size", "val_bytes_per_token"),
    wanted=lambda run: run.config.data.tokenizer != BYTES,
)


def tokenizer_recipe(data) -> dict:
    """What decides a tokenizer: bpe's vocabulary and the split it is trained on, or a file's contents."""
    if data.tokenizer == BPE:
        return {"tokenizer": BPE, "vocab_size": data.vocab_size, "train_fraction": data.train_fraction}
    import hashlib
    from pathlib import Path

    return {"tokenizer_sha256": hashlib.sha256(Path(data.tokenizer).expanduser().read_bytes()).hexdigest()}


# "2": each split is a folder of Arrow shards (train/, val/), the same rows in the same order
# as the one file of "1" each, but for a split of over 16 M windows, shuffled now by a
# permutation computed a slice at a time (model/data/splits.py).
ENCODE = Stage(
    "encode",
    "2",
    reads=("fetch", "tokenize"),  # a bytes run has no tokenize: its keys are as they were
    settings=lambda run: run.config.data,
    recipe=lambda data: {
        "seq_len": data.seq_len,
        "train_fraction": data.train_fraction,
        "shuffle_seed": data.shuffle_seed,
        **({"every_position": True} if data.every_position else {}),
    },  # codelab keys unchanged
    builds=("train", "val"),
    headline=("train_sequences", "val_sequences", "seq_len"),
)
# "4": the model and its optimizer state are made in one compiled program, whose initial
# values differ from the op-by-op ones in the last bits. ("3": the MLP became a module of
# its own, mlp.up and mlp.down, so a state of "2" has other names.)
STATE, HISTORY = "state", "history.json"  # what each training stage builds
# "6": clipping is optax's again (the norm summed a parameter: "5"'s float rounding where
# clipping scales). "5": dropout from an XLA generator's key (a TPU's default) is drawn a byte
# a value.
TRAIN_SINGLE = Stage(
    "train_single",
    "6",
    reads=("encode",),
    settings=RunPlan.single_device_training,
    recipe=TrainingRequest.recipe,
    builds=(STATE, HISTORY),
    headline=("tokens_per_s", "ms_per_step", "compile_s", "final_loss", "val_loss"),
    function="train:build_single",
)
# "8": the clipping of "6" above. "7": the dropout of "5" above. "6": the initial values of
# "4" above. "5": it reads train_single, whose version it takes over when it has one device
# only: the same recipe on the same data, so train_single's own version adds nothing to the
# key, and a shorter or longer train_single (train.single_device_steps) leaves it cached.
TRAIN_PARALLEL = Stage(
    "train_parallel",
    "8",
    reads=("encode", "train_single"),
    keyed_by=("encode",),
    settings=RunPlan.parallel_training,
    recipe=TrainingRequest.recipe,
    builds=(STATE, HISTORY),
    headline=("devices", "tokens_per_s", "ms_per_step", "compile_s", "final_loss", "val_loss"),
    function="train:build_parallel",
)
# "4": an MFU row where the devices' peak is known. "3": both runs timed on the same window
# of steps. "2": its curves include validation loss against tokens and against seconds.
COMPARE = Stage(
    "compare",
    "6",
    reads=("train_single", "train_parallel"),
    settings=lambda run: {},
    builds=("comparison.json", "throughput.png", "curves.png"),
    headline=("speedup", "devices"),
)
CHECKPOINT = Stage(
    "checkpoint",
    "1",
    reads=("train_parallel",),
    settings=lambda run: {},
    builds=("model",),
    headline=("parameters", "bytes"),
)
# "6": the safetensors files' headers in sorted order (the same bytes in any process). "5":
# hf_check.json records the transformers check beside hf/. "4": checksums.json covers the
# transformers folder's files too. "2": the folder holds checksums.json, the sha256 of its
# other files.
HF_CHECKING = "BARDFLOW_HF_CHECK"  # off: hf/ is written but not loaded with transformers


def hf_check_tools() -> str:
    """What checks the export's ``hf/`` here: "transformers X, torch Y", "off" or "not
    installed". Part of the export's key, so that installing (or upgrading) them makes a new
    version, never another content under the same key."""
    import os
    from importlib import metadata

    if os.environ.get(HF_CHECKING, "").lower() == "off":
        return "off"
    try:
        return f"transformers {metadata.version('transformers')}, torch {metadata.version('torch')}"
    except metadata.PackageNotFoundError:
        return "not installed"


EXPORT = Stage(
    "export",
    "7",
    reads=("checkpoint", "tokenize"),  # a bytes run has no tokenize: its keys are as they were
    settings=lambda run: {"hf_check": hf_check_tools()},
    builds=("export",),
    headline=("bytes", "max_abs_diff", "hf_checked"),
)
VERIFY = Stage(
    "verify",
    "1",
    reads=("checkpoint", "train_parallel", "encode"),
    settings=lambda run: run.config.verify,
    builds=("verdict.json",),
    headline=("passed", "max_abs_diff"),
)
GENERATE = Stage(
    "generate",
    "1",
    reads=("checkpoint", "tokenize"),  # a bytes run has no tokenize: its keys are as they were
    settings=lambda run: run.config.generate,
    builds=("samples.json",),
    headline=("samples", "bytes_per_s"),
)

STAGES = (FETCH, TOKENIZE, ENCODE, TRAIN_SINGLE, TRAIN_PARALLEL, COMPARE, CHECKPOINT, EXPORT, VERIFY, GENERATE)
BY_NAME = {stage.name: stage for stage in STAGES}
NAMES = tuple(BY_NAME)
BYTES_RUN = tuple(name for name in NAMES if name != TOKENIZE.name)  # a data.tokenizer=bytes run's stages
