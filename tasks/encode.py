"""Stage 2: bytes to token ids, fixed-length windows, a 90/10 split, a seeded shuffle of the
training windows, stored as memory-mappable Arrow IPC shards (``train/``, ``val/``).

The corpus is read through a memory map and the splits are written a record batch at a time
(``model/data/splits.py``): the stage's memory does not grow with the corpus. Each shard's sha256
is computed as it is written, and the store takes it from there rather than reading the
shards again."""

from __future__ import annotations

import numpy as np

from ..artifacts.store import Builder, Version
from ..config.settings import BYTE_VALUES, DataConfig
from ..errors import require_space
from ..model.data.splits import SHARD_BYTES, Rows, read_split, split_point, train_order, windows, write_split
from . import report
from .fetch import CORPUS
from .registry import ENCODE

TRAIN, VAL = ENCODE.builds


def build(settings: DataConfig, out: Builder, fetch: Version) -> None:
    corpus = fetch.file(CORPUS)
    size = corpus.stat().st_size
    tokens = np.memmap(corpus, np.uint8, mode="r") if size else np.zeros(0, np.uint8)
    rows = windows(tokens, settings.seq_len, settings.every_position)
    num_train = split_point(len(rows), size, settings.seq_len, settings.train_fraction)
    counts = {"train_sequences": num_train, "val_sequences": len(rows) - num_train}
    metadata = {
        "seq_len": str(settings.seq_len),
        "shuffle_seed": str(settings.shuffle_seed),
        "source_md5": fetch.metrics["md5"],
        **{k: str(v) for k, v in counts.items()},
    }
    row_bytes = rows.shape[1]
    total = len(rows) * row_bytes
    # Before a byte is written; each shard adds its Arrow schema and footer, a few KB.
    require_space(out.dir, total, "the encoded splits (train/, val/)", overhead=(total // SHARD_BYTES + 2) << 13)
    with report.progress(ENCODE.name, total, "encode", in_bytes=True) as progress:
        train = write_split(
            out.path(TRAIN),
            rows[:num_train],
            {**metadata, "split": "train"},
            order=train_order(num_train, settings.shuffle_seed),
            progress=progress,
        )
        val = write_split(
            out.path(VAL),
            rows[num_train:],
            {**metadata, "split": "val"},
            progress=lambda done: progress(num_train * row_bytes + done),
            cached=True,
        )
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
            "vocab_size": BYTE_VALUES,
            **counts,
            "shards": len(train) + len(val),
        }
    )


def split_rows(encode: Version, name: str) -> Rows:
    """The split ``name`` (TRAIN or VAL) of an encode version, each shard opened (and fetched,
    from a bucket) when a row of it is first read."""
    return read_split(encode.file(name), encode.manifest.get("shards", {}).get(name), encode.bring)
