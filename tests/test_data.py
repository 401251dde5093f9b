import hashlib

import numpy as np
import pyarrow as pa
import pytest

from bardflow.model.data import splits as data
from bardflow.model.data.splits import Batches, DataError, encode, read_split, train_order, windows, write_split


def test_encoding_is_the_bytes_cut_into_windows(small_corpus):
    path, _ = small_corpus
    raw = path.read_bytes()
    split = encode(raw, seq_len=64, train_fraction=0.9, seed=0)
    windows = np.frombuffer(raw, np.uint8)[: (len(raw) // 64) * 64].reshape(-1, 64)
    # validation keeps corpus order; training holds exactly the other windows, reordered
    np.testing.assert_array_equal(split.val, windows[len(split.train) :])
    assert sorted(map(bytes, split.train)) == sorted(map(bytes, windows[: len(split.train)]))
    assert bytes(split.val[0]).decode() in raw.decode()


def test_split_sizes_are_ninety_ten():
    split = encode(b"x" * (256 * 1000 + 17), seq_len=256, train_fraction=0.9, seed=0)
    assert (len(split.train), len(split.val)) == (900, 100)
    codelab = encode(b"y" * 1_115_394, seq_len=256, train_fraction=0.9, seed=0)
    assert (len(codelab.train), len(codelab.val)) == (3921, 436)


def test_shuffle_is_deterministic_per_seed(small_corpus):
    raw = small_corpus[0].read_bytes()
    a, b, c = (encode(raw, 32, 0.9, seed).train for seed in (0, 0, 1))
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)


def test_too_short_a_corpus_is_refused_with_the_fix():
    with pytest.raises(DataError, match="too few .* smaller data.seq_len"):
        encode(b"short text", seq_len=256, train_fraction=0.9, seed=0)


def test_arrow_shards_keep_shape_schema_and_metadata(tmp_path, small_corpus):
    split = encode(small_corpus[0].read_bytes(), 32, 0.9, 0)
    folder = tmp_path / "train"
    write_split(folder, split.train, {"seq_len": "32", "shuffle_seed": "0", "split": "train"})
    schema = pa.ipc.open_file(pa.memory_map(str(folder / "00000.arrow"))).schema
    assert schema.field("tokens").type == pa.list_(pa.uint8(), 32)
    rows = read_split(folder)
    np.testing.assert_array_equal(np.asarray(rows), split.train)
    assert rows.metadata == {"seq_len": "32", "shuffle_seed": "0", "split": "train"}
    assert not rows[0:5].flags.writeable  # a view of the mapped file, not a copy


def test_a_split_is_bounded_shards_hashed_as_written_and_read_as_one(tmp_path, small_corpus):
    raw = small_corpus[0].read_bytes()
    split = encode(raw, 32, 0.9, 0)
    # The stage's way: windows of a memory map, written in the seeded order, a batch at a time.
    (tmp_path / "corpus").write_bytes(raw)
    mapped = windows(np.memmap(tmp_path / "corpus", np.uint8, mode="r"), 32)
    written = []
    shards = write_split(
        tmp_path / "train",
        mapped[: len(split.train)],
        {},
        order=train_order(len(split.train), 0),
        shard_bytes=20_000,
        progress=written.append,
    )
    assert len(shards) == 3 and all(s["bytes"] <= 20_000 + 2_000 for s in shards)  # rows, plus Arrow's framing
    assert sum(s["rows"] for s in shards) == len(split.train) and written[-1] == split.train.size
    for shard in shards:
        data = (tmp_path / "train" / shard["file"]).read_bytes()
        assert (len(data), hashlib.sha256(data).hexdigest()) == (shard["bytes"], shard["sha256"])
    rows = read_split(tmp_path / "train")
    np.testing.assert_array_equal(np.asarray(rows), split.train)  # the in-memory encode's rows, in its order
    boundary = shards[0]["rows"]
    np.testing.assert_array_equal(rows[boundary - 3 : boundary + 4], split.train[boundary - 3 : boundary + 4])
    np.testing.assert_array_equal(rows[boundary], split.train[boundary])
    chosen = np.array([0, boundary - 1, boundary, len(split.train) - 1])
    np.testing.assert_array_equal(rows.take(chosen), split.train[chosen])
    assert len(rows[len(rows) - 2 : len(rows) + 5]) == 2
    # With the manifest's list, a shard is opened, and asked for first, only when read.
    asked = []
    lazy = read_split(tmp_path / "train", shards, bring=lambda path: asked.append(path.name))
    assert (len(lazy), lazy.shape[1], asked) == (len(split.train), 32, ["00000.arrow"])  # its schema: the width
    np.testing.assert_array_equal(lazy[boundary - 3 : boundary + 4], split.train[boundary - 3 : boundary + 4])
    assert asked == ["00000.arrow", "00000.arrow", "00001.arrow"]
    np.testing.assert_array_equal(lazy.take(chosen), split.train[chosen])
    assert asked[-1] == "00002.arrow" and lazy.metadata == {}
    miscounted = [{**shards[0], "rows": shards[0]["rows"] + 1}, *shards[1:]]
    with pytest.raises(DataError, match="00000.arrow holds .* rows where its split's record says"):
        read_split(tmp_path / "train", miscounted)[0]


def test_a_truncated_arrow_file_is_a_clear_error(tmp_path):
    folder = tmp_path / "train"
    write_split(folder, np.zeros((10, 8), np.uint8), {})
    shard = folder / "00000.arrow"
    shard.write_bytes(shard.read_bytes()[:-40])
    with pytest.raises(DataError, match="rerun the encode stage"):
        read_split(folder)


def test_batches_cycle_by_step():
    rows = np.arange(10 * 4, dtype=np.uint8).reshape(10, 4)
    batches = Batches(rows, batch_size=3)
    assert batches.num_batches == 3
    np.testing.assert_array_equal(batches(0), rows[0:3])
    np.testing.assert_array_equal(batches(4), rows[3:6])  # step 4 -> batch 1
    assert batches(0).dtype == np.int32
    with pytest.raises(DataError, match="fewer than one batch"):
        Batches(rows, batch_size=11)


def test_a_large_split_is_shuffled_in_constant_memory_by_a_seeded_bijection(monkeypatch):
    from bardflow.model.data import splits as data

    for n in (1, 2, 3, 1_000, 12_345):
        order = data.FeistelOrder(n, seed=7)
        whole = order[0:n]
        assert np.array_equal(np.sort(whole), np.arange(n))  # every window once
        assert np.array_equal(order[n // 3 : n // 2], whole[n // 3 : n // 2])  # a slice is its part of the whole
    # Its rounds' tables hold the values the round function computes (so the order is the one
    # any earlier encode wrote), for splits that fit 32 bits and beyond.
    for n in (12_345, 1 << 33):
        tabled = data.FeistelOrder(n, seed=3)
        monkeypatch.setattr(data.FeistelOrder, "TABLE_BITS", 0)
        computed = data.FeistelOrder(n, seed=3)
        monkeypatch.undo()
        assert tabled.tables is not None and computed.tables is None
        assert np.array_equal(tabled[n - 5_000 : n], computed[n - 5_000 : n])
    assert not np.array_equal(data.FeistelOrder(1_000, 1)[0:1_000], data.FeistelOrder(1_000, 2)[0:1_000])
    assert np.array_equal(data.FeistelOrder(1_000, 1)[0:1_000], data.FeistelOrder(1_000, 1)[0:1_000])
    # TinyShakespeare-sized splits keep numpy's permutation; larger ones switch.
    assert isinstance(data.train_order(34_856, 0), np.ndarray)
    monkeypatch.setattr(data, "PERMUTED_IN_MEMORY", 100)
    assert isinstance(data.train_order(101, 0), data.FeistelOrder)


@pytest.mark.parametrize("every_position", [False, True])
def test_writing_a_split_allocates_a_batch_not_the_corpus(tmp_path, every_position, monkeypatch):
    import tracemalloc

    from bardflow.model.data import splits as data

    monkeypatch.setattr(data, "BATCH_BYTES", 1 << 20)  # many batches, gathered ahead while written
    corpus = tmp_path / "corpus"
    corpus.write_bytes(np.random.default_rng(0).integers(0, 256, 64 << 20, dtype=np.uint8).tobytes())
    rows = windows(np.memmap(corpus, np.uint8, mode="r"), 64, every_position)
    order = data.FeistelOrder(len(rows), 0)  # the order of a split too large for an array
    tracemalloc.start()
    try:
        shards = write_split(tmp_path / "train", rows, {}, order=order, shard_bytes=24 << 20)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # The batch being written, the one being hashed and two gathered ahead, and their indices.
    assert peak < 8 * data.BATCH_BYTES, f"{peak / 2**20:.1f} MiB for a 64 MiB corpus"
    assert len(shards) == 3 and sum(shard["rows"] for shard in shards) == len(rows)
    for shard in shards:  # each hashed as written, while its batch arrays were filled again
        assert hashlib.sha256((tmp_path / "train" / shard["file"]).read_bytes()).hexdigest() == shard["sha256"]
    written = read_split(tmp_path / "train", shards)
    # Rows from every batch where they belong: no batch array was filled again while in use.
    sample = np.sort(np.random.default_rng(1).choice(len(rows), 20_000, replace=False))
    np.testing.assert_array_equal(written.take(sample), rows[order[0 : len(rows)][sample]])


def test_a_file_written_around_the_page_cache_holds_exactly_its_bytes(tmp_path, monkeypatch):
    """Staged, aligned writes, a padded last block cut back, pieces of any size; and the same
    bytes where the file system refuses direct writes after opening the file for them."""
    monkeypatch.setattr(data, "DIRECT_BYTES", 64 << 10)  # several stagings in a small file
    rng = np.random.default_rng(0)
    for size in (0, 1, 4095, 4096, (64 << 10) - 1, 64 << 10, (64 << 10) + 1, 3 * (64 << 10) + 12_345):
        content = rng.integers(0, 256, size, dtype=np.uint8).tobytes()
        out = data.DirectFile(tmp_path / f"{size}.bin")
        start = 0
        while start < size:  # pieces of uneven sizes, as Arrow's writer hands them over
            piece = int(rng.integers(1, 20_000))
            assert out.write(memoryview(content)[start : start + piece]) == len(content[start : start + piece])
            start += piece
        out.close()
        assert (tmp_path / f"{size}.bin").read_bytes() == content, size

    # Direct writes refused once open: the file falls back to ordinary writes, losing nothing.
    real_write = data.os.write

    def refusing(fd, chunk):
        if data.fcntl.fcntl(fd, data.fcntl.F_GETFL) & getattr(data.os, "O_DIRECT", 0):
            raise OSError(data.errno.EINVAL, "Invalid argument")
        return real_write(fd, chunk)

    monkeypatch.setattr(data.os, "write", refusing)
    content = rng.integers(0, 256, 200_000, dtype=np.uint8).tobytes()
    out = data.DirectFile(tmp_path / "refused.bin")
    out.write(content[:70_000])
    out.write(content[70_000:])
    out.close()
    assert (tmp_path / "refused.bin").read_bytes() == content
