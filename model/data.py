"""Byte encoding, the train/val split, and the Arrow IPC files that hold them.

Sequences are stored as one ``fixed_size_list<uint8>[seq_len]`` column, so a file
maps straight onto a ``(num_sequences, seq_len)`` array without copying.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from .errors import BardflowError

COLUMN = "tokens"


class DataError(BardflowError, ValueError):
    """The corpus or a data file cannot be used; the message says why and what to do."""


@dataclass(frozen=True)
class Split:
    train: np.ndarray  # (num_train, row) uint8, shuffled; row = seq_len, or seq_len + 1
    val: np.ndarray  # (num_val, row) uint8, in corpus order


def encode(corpus: bytes, seq_len: int, train_fraction: float, seed: int, every_position: bool = False) -> Split:
    """Bytes are token ids 0..255; cut into windows every ``seq_len`` bytes, split, shuffle
    train. A window is ``seq_len`` bytes (the codelab: the last has no target), or with
    ``every_position`` ``seq_len + 1`` (it overlaps the next by one byte: that byte is the
    last position's target)."""
    tokens = np.frombuffer(corpus, dtype=np.uint8)
    extra = int(every_position)
    num_sequences = (len(tokens) - extra) // seq_len
    num_train = int(train_fraction * num_sequences)
    if num_train < 1 or num_sequences - num_train < 1:
        raise DataError(
            f"the corpus has {len(tokens):,} bytes, which makes {num_sequences} sequences of "
            f"{seq_len} bytes: too few for a train and a validation split; use a longer "
            "corpus or a smaller data.seq_len"
        )
    starts = np.arange(num_sequences)[:, None] * seq_len
    windows = tokens[starts + np.arange(seq_len + extra)[None, :]]
    train = windows[:num_train][np.random.default_rng(seed).permutation(num_train)]
    return Split(train=train, val=windows[num_train:].copy())


def write_sequences(path: Path, sequences: np.ndarray, metadata: dict[str, str]) -> None:
    seq_len = sequences.shape[1]
    values = pa.array(np.ascontiguousarray(sequences).reshape(-1), type=pa.uint8())
    column = pa.FixedSizeListArray.from_arrays(values, seq_len)
    schema = pa.schema([pa.field(COLUMN, column.type)], metadata=metadata)
    table = pa.Table.from_arrays([column], schema=schema)
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, schema) as writer:
        writer.write_table(table)


def read_sequences(path: Path) -> tuple[np.ndarray, dict[str, str]]:
    """Memory-maps an Arrow file; returns a read-only ``(N, seq_len)`` uint8 view and its metadata."""
    try:
        table = pa.ipc.open_file(pa.memory_map(str(path), "r")).read_all()
    except (OSError, pa.ArrowInvalid) as error:
        raise DataError(f"cannot read Arrow file {path}: {error}; rerun the encode stage") from error
    column = table.column(COLUMN).combine_chunks()
    seq_len = column.type.list_size
    values = column.flatten()
    # The bytes' buffer viewed in place (Array.to_numpy would import pandas, a fifth of a
    # second of every training process's start, where it is installed).
    tokens = np.frombuffer(values.buffers()[1], np.uint8, len(values), values.offset).reshape(-1, seq_len)
    tokens.setflags(write=False)
    metadata = {k.decode(): v.decode() for k, v in (table.schema.metadata or {}).items()}
    return tokens, metadata


class Batches:
    """Step ``s`` reads batch ``s mod num_batches``: the data position is the step itself,
    so a run is reproducible and can restart from any step."""

    def __init__(self, sequences: np.ndarray, batch_size: int, rows: tuple[int, int] | None = None):
        self.rows = rows or (0, batch_size)  # the part of each batch this process reads
        self.num_batches = len(sequences) // batch_size
        if self.num_batches < 1:
            raise DataError(
                f"the train split has {len(sequences)} sequences, fewer than one batch of "
                f"{batch_size}; lower train.per_device_batch or data.seq_len, or use a longer corpus"
            )
        self.sequences = sequences
        self.batch_size = batch_size

    def __call__(self, step: int) -> np.ndarray:
        start = (step % self.num_batches) * self.batch_size
        return self.sequences[start + self.rows[0] : start + self.rows[1]].astype(np.int32)
