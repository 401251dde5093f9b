"""A corpus's identity (``tasks/corpus_identity.py``): its md5 pinned into the configuration
(it keys the versions), remembered on this machine by its files' stat and sealed, never
trusted over the bytes, and a stated md5 that never hands a run another corpus's bytes."""

import hashlib
import json
from pathlib import Path

import pytest

from bardflow.config.settings import DataConfig
from bardflow.tasks import corpus_identity
from bardflow.tasks.corpus_identity import pin
from bardflow.tasks.fetch import CORPUS, FetchError
from bardflow.tasks.registry import FETCH
from tests.helpers import md5_bytes, play_text
from tests.test_stages import make


def test_a_local_corpus_s_checksum_is_remembered_until_one_of_its_files_changes(tmp_path, monkeypatch):
    """A run whose stages are cached reads nothing of a local corpus: this machine keeps its
    figures by its files' stat. A changed file is read again; a record that lies is caught by
    fetch's sha256 and forgotten."""
    from bardflow.tasks import fetch as fetch_module

    monkeypatch.setenv("BARDFLOW_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(corpus_identity, "SETTLED_NS", 0)  # these files were written a moment ago
    text = play_text(60_000)
    folder = tmp_path / "plays"
    folder.mkdir()
    (folder / "a.txt").write_bytes(text[:20_000])
    (folder / "b.txt").write_bytes(text[20_000:])
    reads = []  # how many files each full read of the corpus took
    real = fetch_module.decoded_chunks
    for module in (fetch_module, corpus_identity):  # the stage's reads and the checksum's
        monkeypatch.setattr(
            module, "decoded_chunks", lambda files, progress=None: reads.append(len(files)) or real(files, progress)
        )

    def pinned(**options) -> DataConfig:
        return pin(DataConfig(corpus=str(folder)), **options)

    first = pinned()
    assert first.md5 == md5_bytes(text) and reads == [2]
    assert pinned() == first and reads == [2]  # remembered: nothing read
    version = make(FETCH, first, tmp_path / "store")[0]  # the copy still checked by its sha256
    assert reads == [2, 2] and version.file(CORPUS).read_bytes() == text
    assert (version.metrics["sha256"], version.metrics["distinct_bytes"]) == (
        hashlib.sha256(text).hexdigest(),
        len(set(text)),
    )
    assert pinned(remembered=False) == first and reads == [2, 2, 2]

    (folder / "b.txt").write_bytes(text[20_000:].swapcase())  # same size, other bytes
    changed = pinned()
    assert changed.md5 == md5_bytes(text[:20_000] + text[20_000:].swapcase()) and reads == [2, 2, 2, 2]
    assert pinned() == changed and len(reads) == 4

    monkeypatch.setattr(corpus_identity, "SETTLED_NS", 60 * 10**9)  # written within the clock's tick
    (folder / "a.txt").write_bytes(text[:20_000].swapcase())
    assert pinned() == pinned() and len(reads) == 6  # not remembered: read each time
    monkeypatch.setattr(corpus_identity, "SETTLED_NS", 0)

    # A record that lies (a file system whose times did not move): fetch finds other bytes,
    # refuses in one line, and the record is gone; the next run reads the corpus again. (A
    # record edited by hand is not believed at all: see the next test.)
    truth = pinned()
    record, _, key = corpus_identity._figures_file(folder, None, sorted(folder.iterdir()))
    lie = {**json.loads(record.read_text())["figures"], "md5": "0" * 32, "sha256": "0" * 64}
    record.write_text(json.dumps({"figures": lie, "seal": corpus_identity._seal(record.parent, key, lie)}))
    with pytest.raises(FetchError, match="changed since its md5 was taken"):
        make(FETCH, pinned(), tmp_path / "store")
    assert not record.exists() and pinned() == truth

    monkeypatch.setattr(corpus_identity, "KEPT_FIGURES", 2)  # the newest records are kept, no more
    for n in range(3):
        (folder / "a.txt").write_bytes(text[n:20_000])
        pinned()
    assert len(list(record.parent.glob("*.json"))) == 2


def test_a_stated_md5_or_a_record_never_hands_a_run_another_corpus_s_bytes(tmp_path, monkeypatch):
    """The store holds corpus Y. Corpus X with Y's md5 stated (a config file reused), or X's
    record on this machine edited to Y's md5 and figures: refused, or read again; a sealed
    record that names Y is caught by the cached version's own sha256 and forgotten."""
    import os

    from bardflow.tasks import fetch as fetch_module

    monkeypatch.setenv("BARDFLOW_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(corpus_identity, "SETTLED_NS", 0)
    store = tmp_path / "store"
    y_text, x_text = play_text(70_000, seed=1), play_text(50_000, seed=2)
    (tmp_path / "y.txt").write_bytes(y_text)
    (tmp_path / "x.txt").write_bytes(x_text)
    y = pin(DataConfig(corpus=str(tmp_path / "y.txt")))
    make(FETCH, y, store)
    x = str(tmp_path / "x.txt")

    with pytest.raises(
        FetchError,
        match=rf"md5 mismatch for {x}: expected {y.md5}, got {md5_bytes(x_text)}; fetch "
        rf"it again or fix the source, .* --set data.md5={md5_bytes(x_text)}$",
    ):
        pin(DataConfig(corpus=x, md5=y.md5))
    assert pin(DataConfig(corpus=x, md5=md5_bytes(x_text))).md5 == md5_bytes(x_text)  # stated rightly: fine
    gone = DataConfig(corpus=str(tmp_path / "gone.txt"), md5=y.md5)
    assert pin(gone) == gone  # nothing to contradict it: the stored corpus by its md5

    # X's record, edited to Y's figures with its file's times put back: not believed.
    def pinned() -> DataConfig:
        return pin(DataConfig(corpus=x))

    assert pinned().md5 == md5_bytes(x_text)
    record, _, key = corpus_identity._figures_file(Path(x), None, [Path(x)])
    y_figures = {
        "md5": y.md5,
        "sha256": hashlib.sha256(y_text).hexdigest(),
        "size": len(y_text),
        "seen": bytes(sorted(set(y_text))).hex(),
    }
    sealed = json.loads(record.read_text())
    times = os.stat(record)
    record.write_text(json.dumps({**sealed, "figures": y_figures}))
    os.utime(record, ns=(times.st_atime_ns, times.st_mtime_ns))
    reads = []
    real = fetch_module.decoded_chunks
    for module in (fetch_module, corpus_identity):  # the stage's reads and the checksum's
        monkeypatch.setattr(
            module, "decoded_chunks", lambda files, progress=None: reads.append(len(files)) or real(files, progress)
        )
    assert pinned().md5 == md5_bytes(x_text) and reads == [1]  # read again
    version, built = make(FETCH, pinned(), store)
    assert built and version.file(CORPUS).read_bytes() == x_text

    # Records sealed as this machine seals them (what a bug would write): one of Y's figures
    # whole is not X's size, so not believed; one with Y's md5 and X's other figures selects
    # the stored version of that md5, whose bytes are not X's: one line, and the record goes.
    def sealed_record(figures: dict) -> None:
        record.write_text(json.dumps({"figures": figures, "seal": corpus_identity._seal(record.parent, key, figures)}))

    sealed_record(y_figures)
    read_before = len(reads)
    assert pinned().md5 == md5_bytes(x_text) and len(reads) == read_before + 1
    sealed_record({**json.loads(record.read_text())["figures"], "md5": y.md5})
    lied = pinned()
    assert lied.md5 == y.md5
    with pytest.raises(
        FetchError,
        match=rf"the stored corpus with md5 {y.md5} \(\w+\) is not the one at {x} "
        r"\(70,000 bytes there, 50,000 here, other sha256\).*rerun to read",
    ):
        make(FETCH, lied, store)
    assert not record.exists() and pinned().md5 == md5_bytes(x_text)
