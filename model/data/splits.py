"""Byte encoding, the train/val split, and the Arrow IPC shards that hold them.

A split is a folder of shards (``00000.arrow``, …), each at most ``SHARD_BYTES`` of rows,
each row one ``fixed_size_list<uint8>[row]`` value (``uint16`` or ``uint32`` for the ids of a
tokenizer's larger vocabulary), in record batches of at most
``BATCH_BYTES``: every batch maps straight onto a ``(rows, row)`` array without copying,
and nothing is ever held whole. The corpus is read through a memory map, its windows are a
strided view of it, and the shuffle is a seeded permutation of window numbers (an array up
to 16 M windows, computed a slice at a time beyond): writing a split gathers one record
batch of rows at a time (the next two on threads), so encoding a corpus of any size takes
at most 128 MiB and a few batches. A training split's shards go to disk around the page
cache (``DirectFile``): training reads them later, in order.
"""

from __future__ import annotations

import bisect
import errno
import fcntl
import hashlib
import mmap
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import numpy as np
import pyarrow as pa

from ...errors import BardflowError

COLUMN = "tokens"
SHARD_BYTES = 256 << 20  # a shard file, at most: a worker reads or fetches the shards it needs
BATCH_BYTES = 8 << 20  # a record batch: what a writer gathers at once
# A write() at most. Linux serves one large buffered write with large page-cache folios,
# which can cost many times more to find than small pages where memory is tight or, on a
# virtual machine, handed back to its host (docs/benchmarks.md, "Data at any size").
WRITE_BYTES = 256 << 10
# A shard is written around the page cache (O_DIRECT) through a staging buffer of this size,
# aligned for any file system's block size; its last block is padded and cut back.
DIRECT_BYTES = 4 << 20
DIRECT_ALIGN = 4096
T = TypeVar("T")
R = TypeVar("R")


class DataError(BardflowError, ValueError):
    """The corpus or a data file cannot be used; the message says why and what to do."""


@dataclass(frozen=True)
class Split:
    train: np.ndarray  # (num_train, row) uint8, shuffled; row = seq_len, or seq_len + 1
    val: np.ndarray  # (num_val, row) uint8, in corpus order


def windows(tokens: np.ndarray, seq_len: int, every_position: bool = False) -> np.ndarray:
    """Token ids (bytes are ids 0..255) cut into windows every ``seq_len`` tokens: a read-only
    view of ``tokens`` (a memory map stays one). A window is ``seq_len`` tokens (the codelab:
    the last has no target), or with ``every_position`` ``seq_len + 1`` (it overlaps the next
    by one token: that token is the last position's target)."""
    extra, item = int(every_position), tokens.itemsize
    count = max(0, (len(tokens) - extra) // seq_len)
    return np.lib.stride_tricks.as_strided(
        tokens, shape=(count, seq_len + extra), strides=(seq_len * item, item), writeable=False
    )


def split_point(num_windows: int, corpus_bytes: int, seq_len: int, train_fraction: float) -> int:
    """How many windows, from the corpus's start, are for training (the rest validate)."""
    num_train = int(train_fraction * num_windows)
    if num_train < 1 or num_windows - num_train < 1:
        raise DataError(
            f"the corpus has {corpus_bytes:,} bytes, which makes {num_windows} sequences of "
            f"{seq_len} bytes: too few for a train and a validation split; use a longer "
            "corpus or a smaller data.seq_len"
        )
    return num_train


def training_bytes(corpus_bytes: int, seq_len: int, train_fraction: float, every_position: bool = False) -> int:
    """Where the training split's bytes end: the byte the first validation window of a bytes
    run starts at. A tokenizer's run cuts the corpus there too, so that its validation text
    is the bytes run's (and its tokenizer is trained on bytes before it only)."""
    count = max(0, (corpus_bytes - int(every_position)) // seq_len)
    return split_point(count, corpus_bytes, seq_len, train_fraction) * seq_len


PERMUTED_IN_MEMORY = 1 << 24  # windows: up to here a permutation array (128 MiB at most)


def train_order(num_train: int, seed: int) -> np.ndarray | FeistelOrder:
    """The seeded shuffle of the training windows: which window each training row is, sliced
    ``order[a:b]``. Up to ``PERMUTED_IN_MEMORY`` windows (TinyShakespeare has 3,921 to 34,856)
    numpy's seeded permutation, as ever; beyond, a permutation computed a slice at a time."""
    if num_train <= PERMUTED_IN_MEMORY:
        return np.random.default_rng(seed).permutation(num_train)
    return FeistelOrder(num_train, seed)


class FeistelOrder:
    """A seeded permutation of ``range(n)`` in constant memory: a four-round Feistel network
    over the smallest even number of bits that holds ``n`` (a bijection there), walked again
    from any value of ``n`` or more until it lands below (a bijection on ``range(n)``; about
    two rounds trips at most, on average). ``order[a:b]`` computes just those positions.

    A round's function depends on one half alone, so for halves of up to ``TABLE_BITS`` bits
    (splits of up to 2^40 windows) each round is a table of its values: a round is then one
    lookup in a table that stays in the CPU's cache, not a hash computed per window."""

    ROUNDS = 4
    TABLE_BITS = 20  # four tables of 4 MiB at most

    def __init__(self, n: int, seed: int):
        self.n = n
        self.half = max(1, ((n - 1).bit_length() + 1) // 2)
        self.mask = np.uint64((1 << self.half) - 1)
        self.keys = np.random.default_rng(seed).integers(0, 1 << 62, size=self.ROUNDS, dtype=np.uint64)
        # Values of the whole domain fit in 32 bits below 2^32 windows: half the memory traffic.
        self.dtype = np.uint32 if 2 * self.half <= 32 else np.uint64
        self.tables = None
        if self.half <= self.TABLE_BITS:
            halves = np.arange(1 << self.half, dtype=np.uint64)
            with np.errstate(over="ignore"):
                self.tables = [(self._mix(halves ^ key) & self.mask).astype(self.dtype) for key in self.keys]

    def __len__(self) -> int:
        return self.n

    @staticmethod
    def _mix(z: np.ndarray) -> np.ndarray:  # splitmix64's finaliser
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))

    def _permute(self, x: np.ndarray) -> np.ndarray:
        """``x`` (changed in place) through the network."""
        half = self.dtype(self.half)
        left, right = x >> half, np.bitwise_and(x, self.dtype(self.mask), out=x)
        if self.tables is not None:
            spare = np.empty_like(x)  # three arrays in turn, none allocated per round
            for table in self.tables:
                np.take(table, right, out=spare, mode="wrap")  # a half is below the table's size
                spare ^= left
                left, right, spare = right, spare, left
        else:
            with np.errstate(over="ignore"):
                for key in self.keys:
                    left, right = right, left ^ (self._mix(right ^ key) & self.mask)
        left <<= half
        left |= right
        return left

    def __getitem__(self, index: slice) -> np.ndarray:
        start, stop, step = index.indices(self.n)
        x = self._permute(np.arange(start, stop, step, dtype=self.dtype))
        walking = np.flatnonzero(x >= self.n)
        while walking.size:  # the few outside range(n) take another trip through the network
            again = self._permute(x[walking])
            x[walking] = again
            walking = walking[again >= self.n]
        return x.astype(np.int64)


def encode(corpus: bytes, seq_len: int, train_fraction: float, seed: int, every_position: bool = False) -> Split:
    """The splits of a corpus held in memory (tests and benchmarks; the encode stage streams
    the same rows from a file with ``write_split``): train shuffled, val in corpus order."""
    rows = windows(np.frombuffer(corpus, dtype=np.uint8), seq_len, every_position)
    num_train = split_point(len(rows), len(corpus), seq_len, train_fraction)
    return Split(train=rows[:num_train][train_order(num_train, seed)[0:num_train]], val=rows[num_train:].copy())


class ThreadedDigest:
    """A hashlib digest updated on a thread of its own, one chunk behind the caller: hashlib
    lets go of the GIL, so hashing runs beside the caller's next read, gather or write. A
    chunk is hashed where it lies (the caller hands over bytes, or a buffer it no longer
    changes: a written batch), not copied first."""

    def __init__(self, digest):
        from concurrent.futures import ThreadPoolExecutor

        self.digest, self._pool, self._pending = digest, ThreadPoolExecutor(1), None

    def update(self, chunk) -> None:
        if self._pending is not None:
            self._pending.result()
            self._pending = None
        if len(chunk) < 1 << 16:  # a small file's bytes: a thread's hand-off would cost more
            self.digest.update(chunk)
            return
        self._pending = self._pool.submit(self.digest.update, chunk)

    def hexdigest(self) -> str:
        if self._pending is not None:
            self._pending.result()
            self._pending = None
        self._pool.shutdown()
        return self.digest.hexdigest()


def write_all(handle, data) -> None:
    """``data`` (bytes, or any buffer) written to the file ``handle``, ``WRITE_BYTES`` at a time."""
    view = memoryview(data).cast("B")
    for start in range(0, len(view), WRITE_BYTES):
        handle.write(view[start : start + WRITE_BYTES])


class DirectFile:
    """A new file written around the page cache (``O_DIRECT``) where its file system allows
    (and ``direct``), else as usual. A training split is written once and read later, in
    order: keeping its pages cached buys nothing, and on a machine short of free memory (or a
    virtual machine whose host took it back) finding a page-cache page for every written byte
    was most of what encoding a large corpus cost (docs/benchmarks.md, "Data at any size").
    Bytes go to an aligned staging buffer and reach the file a full buffer at a time; the
    last, partial block is padded to the alignment and the file cut back to its size on
    ``close``."""

    def __init__(self, path: Path, direct: bool = True):
        self.direct, self.size, self.filled = direct and hasattr(os, "O_DIRECT"), 0, 0
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0)
        try:
            self.fd = os.open(path, flags | (os.O_DIRECT if self.direct else 0), 0o644)
        except OSError as error:
            if error.errno != errno.EINVAL:  # EINVAL: no direct I/O here (tmpfs); anything else is real
                raise
            self.direct, self.fd = False, os.open(path, flags, 0o644)
        self.stage = mmap.mmap(-1, DIRECT_BYTES) if self.direct else None  # page-aligned

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        written = len(view)
        self.size += written
        while len(view) and self.stage is not None:
            take = min(len(view), DIRECT_BYTES - self.filled)
            self.stage[self.filled : self.filled + take] = view[:take]
            self.filled, view = self.filled + take, view[take:]
            if self.filled == DIRECT_BYTES:
                self._write(memoryview(self.stage))
                self.filled = 0
        if len(view):
            self._write(view)
        return written

    def _write(self, view: memoryview) -> None:
        step = len(view) if self.stage is not None else WRITE_BYTES
        for start in range(0, len(view), step):
            chunk = view[start : start + step]
            while len(chunk):
                try:
                    chunk = chunk[os.write(self.fd, chunk) :]
                except OSError as error:
                    if error.errno != errno.EINVAL or self.stage is None:
                        raise
                    # A file system that opened the file for direct I/O but refuses its
                    # writes: this and the rest as usual.
                    fcntl.fcntl(self.fd, fcntl.F_SETFL, fcntl.fcntl(self.fd, fcntl.F_GETFL) & ~os.O_DIRECT)
                    self.stage = None

    def flush(self) -> None:
        """Nothing to do: bytes reach the file a staging buffer at a time, the rest at ``close``."""

    def close(self) -> None:
        try:
            if self.stage is not None and self.filled:
                padded = -(-self.filled // DIRECT_ALIGN) * DIRECT_ALIGN
                self.stage[self.filled : padded] = bytes(padded - self.filled)
                self._write(memoryview(self.stage)[:padded])
            if self.direct:
                os.ftruncate(self.fd, self.size)
        finally:
            os.close(self.fd)
            self.stage = None


class _Hashing:
    """A file that hashes what is written to it, so a shard's sha256 needs no second read."""

    def __init__(self, handle: DirectFile):
        self.handle, self.sha256 = handle, ThreadedDigest(hashlib.sha256())
        self.closed = False

    @property
    def size(self) -> int:
        return self.handle.size

    def write(self, data) -> int:
        self.sha256.update(data)
        return self.handle.write(data)

    def tell(self) -> int:
        return self.size

    def flush(self) -> None:
        self.handle.flush()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.handle.close()


# The token types a split may hold: bytes, and a tokenizer's ids.
ARROW_TYPES = {np.dtype(np.uint8): pa.uint8(), np.dtype(np.uint16): pa.uint16(), np.dtype(np.uint32): pa.uint32()}
NUMPY_TYPES = {arrow: numpy for numpy, arrow in ARROW_TYPES.items()}


def _batch(rows: np.ndarray, schema: pa.Schema) -> pa.RecordBatch:
    values = pa.Array.from_buffers(ARROW_TYPES[rows.dtype], rows.size, [None, pa.py_buffer(rows)])
    return pa.record_batch([pa.FixedSizeListArray.from_arrays(values, rows.shape[1])], schema=schema)


def write_split(
    folder: Path,
    rows: np.ndarray,
    metadata: dict[str, str],
    order: np.ndarray | FeistelOrder | None = None,
    shard_bytes: int | None = None,
    progress: Callable[[int], None] | None = None,
    cached: bool = False,
) -> list[dict]:
    """Writes ``rows`` (in ``order``, if given: row ``i`` of the split is ``rows[order[i]]``)
    as shards in ``folder``; returns each shard's file name, rows, bytes and sha256 (hashed
    as written). A shard holds ``shard_bytes`` of rows at most (``SHARD_BYTES`` as it is when
    called). ``progress`` hears the bytes of rows written so far. The shards go around
    the page cache unless ``cached``: for a split read at random (the evaluation's rows)."""
    folder.mkdir(parents=True, exist_ok=True)
    count, row = (len(rows) if order is None else len(order)), rows.shape[1]
    row_bytes = row * rows.dtype.itemsize
    per_shard = max(1, (shard_bytes or SHARD_BYTES) // row_bytes)
    per_batch = max(1, min(per_shard, BATCH_BYTES // row_bytes))
    spans = [(first, min(count, first + per_shard)) for first in range(0, count, per_shard)]

    # Batch arrays written and hashed, filled again rather than allocated: memory the process
    # already holds, not fresh pages for every batch.
    spare: list[np.ndarray] = []

    def rows_of(batch: tuple[int, int]) -> np.ndarray:
        try:
            out = spare.pop()
        except IndexError:
            out = np.empty((per_batch, row), rows.dtype)
        return gather(rows, slice(*batch) if order is None else order[batch[0] : batch[1]], out[: batch[1] - batch[0]])

    batches = prefetched(
        rows_of,
        [(start, min(last, start + per_batch)) for first, last in spans for start in range(first, last, per_batch)],
    )
    shards = []
    for number, (first, last) in enumerate(spans):
        schema = pa.schema(
            [pa.field(COLUMN, pa.list_(ARROW_TYPES[rows.dtype], row))],
            metadata={**metadata, "shard": str(number), "first_row": str(first)},
        )
        name = f"{number:05d}.arrow"
        written: np.ndarray | None = None
        sink = _Hashing(DirectFile(folder / name, direct=not cached))
        try:
            with pa.ipc.new_file(pa.PythonFile(sink, mode="w"), schema) as writer:
                for stop in [*range(first + per_batch, last, per_batch), last]:
                    batch = next(batches)
                    writer.write_batch(_batch(batch, schema))
                    if written is not None:  # writing this batch waited for the hash of that one
                        spare.append(written)
                    written = batch.base if batch.base is not None else batch
                    if progress is not None:
                        progress(stop * row_bytes)
        finally:
            sink.close()
        shards.append({"file": name, "rows": last - first, "bytes": sink.size, "sha256": sink.sha256.hexdigest()})
        if written is not None:
            spare.append(written)
    return shards


def prefetched(make: Callable[[T], R], items: Sequence[T], ahead: int = 2) -> Iterator[R]:
    """``make(item)`` for each item in order, the next ``ahead`` made on threads while the
    caller uses this one (numpy's gathers and arithmetic let go of the GIL): a split's next
    batches are gathered while this one is written and hashed."""
    from collections import deque
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(ahead) as pool:
        pending = deque(pool.submit(make, item) for item in items[:ahead])
        for item in items[ahead:]:
            made = pending.popleft().result()
            pending.append(pool.submit(make, item))
            yield made
        while pending:
            yield pending.popleft().result()


def gather(rows: np.ndarray, at: np.ndarray | slice, out: np.ndarray | None = None) -> np.ndarray:
    """``rows[at]`` as a C-contiguous array (``out``, if given), fast for windows:
    ``numpy.take`` where the rows are contiguous; windows that overlap the next by a byte
    (every_position) as their contiguous ``seq_len`` bytes and that byte apart (``take`` on
    the overlapping view would first copy it whole, and copying or indexing it row by row is
    several times slower)."""
    count = len(range(*at.indices(len(rows)))) if isinstance(at, slice) else len(at)
    if out is None:
        out = np.empty((count, rows.shape[1]), rows.dtype)
    if not isinstance(at, slice) and count and not 0 <= at.min() <= at.max() < len(rows):
        raise IndexError(f"row numbers outside 0..{len(rows) - 1}")
    item, width = rows.itemsize, rows.shape[1]
    stride, step = rows.strides[0], rows.strides[0] // item  # a row's start: bytes, tokens
    if not rows.flags.c_contiguous and rows.strides[1] == item and width == step + 1:
        body = np.lib.stride_tricks.as_strided(rows, shape=(len(rows), step), strides=(stride, item), writeable=False)
        last = np.lib.stride_tricks.as_strided(rows[:, step:], shape=(len(rows),), strides=(stride,), writeable=False)
        if isinstance(at, slice) or not body.flags.c_contiguous:
            out[:, :step] = body[at]
        else:  # straight into the wider rows
            np.take(body, at, axis=0, out=out[:, :step], mode="wrap")
        out[:, step] = last[at]
    elif rows.flags.c_contiguous and not isinstance(at, slice):
        np.take(rows, at, axis=0, out=out, mode="wrap")  # "wrap" writes straight to out; checked above
    else:
        out[...] = rows[at]
    return out


class Rows(Sequence):
    """A split's rows across its pieces (record batches, memory-mapped, or shards opened when
    first read) as one read-only sequence: ``rows[a:b]`` reads only those rows (a copy of just
    them), ``take`` a sorted choice of rows; nothing is read whole."""

    def __init__(
        self,
        pieces: Sequence,
        metadata: dict[str, str] | Callable[[], dict[str, str]],
        width: int | None = None,
        dtype: np.dtype | None = None,
    ):
        self.pieces = [p for p in pieces if len(p)]
        self.starts = [int(n) for n in np.cumsum([0] + [len(p) for p in self.pieces])]
        self._metadata = metadata
        self.shape = (self.starts[-1], width if width is not None else pieces[0].shape[1] if pieces else 0)
        self.dtype = dtype if dtype is not None else pieces[0].dtype if pieces else np.dtype(np.uint8)

    @property
    def metadata(self) -> dict[str, str]:
        if callable(self._metadata):
            self._metadata = self._metadata()
        return self._metadata

    def __len__(self) -> int:
        return self.shape[0]

    # A slice of rows, one row, or the rows at sorted indices: numpy arrays each, where the
    # Sequence protocol would have a slice be a Sequence (numpy's own arrays do the same).
    def __getitem__(self, index):  # pyright: ignore[reportIncompatibleMethodOverride]
        if isinstance(index, np.ndarray):
            return self.take(index)
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            if step != 1:
                raise IndexError("rows are read in runs: a slice with a step is not supported")
            return self._run(start, max(start, stop))
        at = range(len(self))[index]
        piece = bisect.bisect_right(self.starts, at) - 1
        return self.pieces[piece][at - self.starts[piece]]

    def _run(self, start: int, stop: int) -> np.ndarray:
        parts, at = [], start
        while at < stop:
            piece = bisect.bisect_right(self.starts, at) - 1
            end = min(stop, self.starts[piece + 1])
            parts.append(self.pieces[piece][at - self.starts[piece] : end - self.starts[piece]])
            at = end
        if len(parts) == 1:
            return parts[0]
        return np.concatenate(parts) if parts else np.zeros((0, self.shape[1]), self.dtype)

    def take(self, indices: np.ndarray) -> np.ndarray:
        """The rows at sorted ``indices``, gathered piece by piece."""
        pieces = np.searchsorted(self.starts, indices, side="right") - 1
        out = np.empty((len(indices), self.shape[1]), self.dtype)
        for piece in np.unique(pieces):
            mine = pieces == piece
            out[mine] = self.pieces[piece][indices[mine] - self.starts[piece]]
        return out

    def __array__(self, dtype=None, copy=None):
        whole = self._run(0, len(self))
        return whole if dtype is None else whole.astype(dtype)


class _Shard:
    """One shard of a known number of rows, opened (and first brought here by ``bring``,
    where it is not yet) when a row of it is read."""

    def __init__(self, path: Path, rows: int, bring: Callable[[Path], None] | None):
        self.path, self.rows, self.bring = path, rows, bring
        self._opened: Rows | None = None

    def opened(self) -> Rows:
        if self._opened is None:
            if self.bring is not None:
                self.bring(self.path)
            pieces, metadata = _mapped(self.path)
            opened = Rows(pieces, metadata)
            if len(opened) != self.rows:
                raise DataError(
                    f"{self.path} holds {len(opened)} rows where its split's record says "
                    f"{self.rows}; rerun the encode stage"
                )
            self._opened = opened
        return self._opened

    def __len__(self) -> int:
        return self.rows

    def __getitem__(self, index):
        return self.opened()[index]


def _mapped(path: Path) -> tuple[list[np.ndarray], dict[str, str]]:
    """A shard's record batches as read-only views of the mapped file, and its metadata."""
    try:
        reader = pa.ipc.open_file(pa.memory_map(str(path), "r"))
        batches = [reader.get_batch(i) for i in range(reader.num_record_batches)]
    except (OSError, pa.ArrowInvalid) as error:
        raise DataError(f"cannot read Arrow file {path}: {error}; rerun the encode stage") from error
    pieces = []
    for batch in batches:
        column = batch.column(0)
        values = column.values if column.offset == 0 else column.flatten()
        # The bytes' buffer viewed in place (Array.to_numpy would import pandas, a fifth of a
        # second of every training process's start, where it is installed).
        tokens = np.frombuffer(values.buffers()[1], NUMPY_TYPES[values.type], len(values), values.offset)
        pieces.append(tokens.reshape(-1, column.type.list_size))
    if not pieces:
        kind = reader.schema.field(COLUMN).type
        pieces = [np.zeros((0, kind.list_size), NUMPY_TYPES[kind.value_type])]
    metadata = {k.decode(): v.decode() for k, v in (reader.schema.metadata or {}).items()}
    return pieces, metadata


def read_split(folder: Path, shards: list[dict] | None = None, bring: Callable[[Path], None] | None = None) -> Rows:
    """A split's shards (a folder), or one Arrow file, as ``Rows``; the metadata is the
    first shard's, less what differs between shards. With ``shards`` (the encode manifest's
    list: file and rows of each), a shard is opened when a row of it is first read, and
    ``bring`` is asked for its file first (an object store's mirror fetches it then)."""
    if shards:
        lazy = [_Shard(folder / shard["file"], int(shard["rows"]), bring) for shard in shards]
        return Rows(lazy, lambda: _shared(lazy[0].opened().metadata), *_row_shape(lazy[0]))
    files = sorted(folder.glob("*.arrow")) if folder.is_dir() else [folder]
    if not files:
        raise DataError(f"{folder} holds no Arrow shards; rerun the encode stage")
    pieces, metadata = [], None
    for file in files:
        mine, found = _mapped(file)
        pieces += mine
        metadata = found if metadata is None else metadata
    return Rows(pieces, _shared(metadata or {}))


def _shared(metadata: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in metadata.items() if k not in ("shard", "first_row")}


def _row_shape(shard: _Shard) -> tuple[int, np.dtype]:
    """The tokens of a row and their type, from the shard's schema (its footer: no row is read)."""
    if shard.bring is not None:
        shard.bring(shard.path)
    try:
        schema = pa.ipc.open_file(pa.memory_map(str(shard.path), "r")).schema
    except (OSError, pa.ArrowInvalid) as error:
        raise DataError(f"cannot read Arrow file {shard.path}: {error}; rerun the encode stage") from error
    kind = schema.field(COLUMN).type
    return kind.list_size, NUMPY_TYPES[kind.value_type]


class Batches:
    """Step ``s`` reads batch ``s mod num_batches``: the data position is the step itself,
    so a run is reproducible and can restart from any step."""

    def __init__(self, sequences: np.ndarray | Rows, batch_size: int, rows: tuple[int, int] | None = None):
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
