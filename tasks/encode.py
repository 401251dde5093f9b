"""Stage 2: bytes to token ids, fixed-length windows, a 90/10 split, a seeded shuffle of the
training windows, stored as memory-mappable Arrow IPC shards (``train/``, ``val/``).

The corpus is read through a memory map and the splits are written a record batch at a time
(``model/data/splits.py``): the stage's memory does not grow with the corpus. Each shard's sha256
is computed as it is written, and the store takes it from there rather than reading the
shards again."""

from __future__ import annotations

import numpy as np

from ..artifacts.store import Builder, Version
from ..config.settings import DataConfig
from ..config.vocabulary import BYTE_VALUES
from ..errors import require_space
from ..model.data.splits import (
    SHARD_BYTES,
    DataError,
    Rows,
    read_split,
    split_point,
    train_order,
    training_bytes,
    windows,
    write_split,
)
from ..model.data.tokenizer import TOKENIZER_FILE, encode_to_file
from . import report
from .fetch import CORPUS
from .registry import ENCODE

TRAIN, VAL = ENCODE.builds


def build(settings: DataConfig, out: Builder, fetch: Version, tokenize: Version | None = None) -> None:
    corpus = fetch.file(CORPUS)
    size = corpus.stat().st_size
    data = np.memmap(corpus, np.uint8, mode="r") if size else np.zeros(0, np.uint8)
    if tokenize is None:  # bytes: the windows are the corpus's
        rows = windows(data, settings.seq_len, settings.every_position)
        num_train = split_point(len(rows), size, settings.seq_len, settings.train_fraction)
        train_rows, val_rows, vocab = rows[:num_train], rows[num_train:], BYTE_VALUES
        figures = {}
    else:
        train_rows, val_rows, figures = _token_windows(settings, out, data, tokenize)
        num_train, vocab = len(train_rows), figures.pop("vocab_size")
    counts = {"train_sequences": num_train, "val_sequences": len(val_rows)}
    metadata = {
        "seq_len": str(settings.seq_len),
        "shuffle_seed": str(settings.shuffle_seed),
        "source_md5": fetch.metrics["md5"],
        **({"tokenizer_sha256": figures["tokenizer_sha256"]} if figures else {}),
        **{k: str(v) for k, v in counts.items()},
    }
    row_bytes = train_rows.shape[1] * train_rows.itemsize
    total = (len(train_rows) + len(val_rows)) * row_bytes
    # Before a byte is written; each shard adds its Arrow schema and footer, a few KB.
    require_space(out.dir, total, "the encoded splits (train/, val/)", overhead=(total // SHARD_BYTES + 2) << 13)
    with report.progress(ENCODE.name, total, "encode", in_bytes=True) as progress:
        train = write_split(
            out.path(TRAIN),
            train_rows,
            {**metadata, "split": "train"},
            order=train_order(num_train, settings.shuffle_seed),
            progress=progress,
        )
        val = write_split(
            out.path(VAL),
            val_rows,
            {**metadata, "split": "val"},
            progress=lambda done: progress(num_train * row_bytes + done),
            cached=True,
        )
    for scratch in out.dir.glob(f"{SCRATCH}*"):
        scratch.unlink()
    # The windows are the corpus's bytes: readable by no one its stored copy keeps out.
    mode = corpus.stat().st_mode & 0o666 | 0o600
    for name, shards in ((TRAIN, train), (VAL, val)):
        out.path(name).chmod(mode | (mode & 0o444) >> 2)  # a folder: entered by whoever may read it
        for shard in shards:
            path = out.path(f"{name}/{shard['file']}")
            path.chmod(mode)
            out.digests[f"{name}/{shard['file']}"] = {"bytes": shard["bytes"], "sha256": shard["sha256"]}
    out.record["shards"] = {TRAIN: train, VAL: val}
    out.on_demand = [TRAIN, VAL]  # a worker reading from a bucket fetches the shards it reads
    out.metrics.update(
        {
            "bytes": size,
            "seq_len": settings.seq_len,
            "vocab_size": vocab,
            **counts,
            "shards": len(train) + len(val),
            **figures,
        }
    )


SCRATCH = ".tokens-"  # the encoded tokens while the splits are written; removed after


def _token_windows(settings: DataConfig, out: Builder, data: np.ndarray, tokenize: Version):
    """A tokenizer's run: the training bytes and the validation bytes (cut where a bytes run
    cuts them) each encoded whole, a chunk of the host's cores at a time, into a file of ids
    beside the version (constant memory), and cut into windows of ``seq_len`` tokens. Returns
    the windows of each, and the figures the split adds: the tokens, bytes per token."""
    from .tokenize import load

    tokenizer = load(tokenize)
    cut = training_bytes(len(data), settings.seq_len, settings.train_fraction, settings.every_position)
    parts = {}
    with report.progress(ENCODE.name, len(data), "tokenize", in_bytes=True) as progress:
        for name, start, stop in (("train", 0, cut), ("val", cut, len(data))):
            path = out.dir / f"{SCRATCH}{name}"
            count = encode_to_file(tokenizer, data[start:stop], path, lambda done, at=start: progress(at + done))
            parts[name] = (
                np.memmap(path, tokenizer.dtype, mode="r", shape=(count,)) if count else np.zeros(0, tokenizer.dtype)
            )
    train_rows = windows(parts["train"], settings.seq_len, settings.every_position)
    val_rows = windows(parts["val"], settings.seq_len, settings.every_position)
    if len(train_rows) < 1 or len(val_rows) < 1:
        raise DataError(
            f"the corpus's {len(parts['train']):,} training and {len(parts['val']):,} validation tokens make "
            f"{len(train_rows)} and {len(val_rows)} sequences of {settings.seq_len} tokens: too few for both "
            "splits; use a longer corpus or a smaller data.seq_len"
        )
    return (
        train_rows,
        val_rows,
        {
            "vocab_size": tokenizer.vocab_size,
            "tokenizer_sha256": tokenize.manifest["files"][TOKENIZER_FILE]["sha256"],
            "train_tokens": len(parts["train"]),
            "val_tokens": len(parts["val"]),
            "val_bytes": len(data) - cut,
            "val_bytes_per_token": round((len(data) - cut) / max(1, len(parts["val"])), 4),
        },
    )


def split_rows(encode: Version, name: str) -> Rows:
    """The split ``name`` (TRAIN or VAL) of an encode version, each shard opened (and fetched,
    from a bucket) when a row of it is first read."""
    return read_split(encode.file(name), encode.manifest.get("shards", {}).get(name), encode.bring)
