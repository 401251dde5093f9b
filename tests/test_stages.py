"""Stages called as plain functions (``task.fn``) over a real store: no Prefect server."""

import socket
from pathlib import Path
import time

import jax
import pytest

from artifacts.store import Store
from model.config import DataConfig, build_config
from model.checkpoint import save_model
from tasks.checkpoint import MODEL, checkpoint
from tasks.encode import encode
from tasks.fetch import FetchError, _download, fetch
from tasks.train import TrainingRequest, trained_model, train_parallel
from tasks.verify import VerificationError, VerifyParams, verify


def entries(root):
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if ".lock-" not in p.name)


def test_md5_mismatch_names_both_checksums_and_the_source_and_leaves_nothing(tmp_path, small_corpus):
    path, real_md5 = small_corpus
    store = tmp_path / "store"
    wrong = "0" * 32
    with pytest.raises(FetchError) as error:
        fetch.fn(DataConfig(corpus=str(path), md5=wrong), store=str(store))
    message = str(error.value)
    assert wrong in message and real_md5 in message and str(path) in message and "--set data.md5=" in message
    assert entries(store) == ["fetch"]  # only the (empty) stage folder


def test_path_and_file_url_sources_give_the_same_version(tmp_path, small_corpus):
    path, md5 = small_corpus
    first = fetch.fn(DataConfig(corpus=str(path), md5=md5), store=str(tmp_path / "a"))
    second = fetch.fn(DataConfig(corpus=path.as_uri(), md5=md5), store=str(tmp_path / "b"))
    assert first["ran"] and second["ran"]
    assert first["key"] == second["key"] and first["fingerprint"] == second["fingerprint"]
    assert Store(tmp_path / "a").require(first).file("corpus.txt").read_bytes() == path.read_bytes()


def test_a_fetched_corpus_is_not_fetched_again(tmp_path, small_corpus):
    path, md5 = small_corpus
    store = str(tmp_path / "store")
    fetch.fn(DataConfig(corpus=str(path), md5=md5), store=store)
    path.unlink()  # the source is gone: only the store can answer now
    again = fetch.fn(DataConfig(corpus=str(path), md5=md5), store=store)
    assert not again["ran"] and again["metrics"]["bytes"] == 64_000


def test_the_real_corpus_matches_the_default_checksum(tmp_path, shakespeare):
    out = fetch.fn(DataConfig(corpus=str(shakespeare)), store=str(tmp_path))
    assert out["metrics"] == {"bytes": 1_115_394, "md5": "6fb458f1232090904fb40fe944165e91"}


def test_a_missing_file_and_an_unreachable_url_fail_fast_and_clearly(tmp_path):
    with pytest.raises(FetchError, match="does not exist; check --corpus"):
        fetch.fn(DataConfig(corpus=str(tmp_path / "nope.txt")), store=str(tmp_path / "s"))
    with socket.socket() as sock:  # a port that nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    started = time.monotonic()
    with pytest.raises(FetchError, match=r"after 2 attempt\(s\); check the network"):
        _download(f"http://127.0.0.1:{port}/input.txt", tmp_path / "x", attempts=2, timeout_s=2)
    assert time.monotonic() - started < 10


def test_verify_passes_on_the_real_checkpoint_and_fails_on_a_perturbed_one(tmp_path, small_corpus):
    path, md5 = small_corpus
    store = str(tmp_path / "store")
    cfg = build_config("tiny", {"train.steps": 3})
    corpus = fetch.fn(DataConfig(corpus=str(path), md5=md5), store=store)
    data = encode.fn(cfg.data, upstream={"fetch": corpus}, store=store)
    request = TrainingRequest(model=cfg.model, train=cfg.train, devices=len(jax.devices()), platform="cpu")
    trained = train_parallel.fn(request, upstream={"encode": data}, store=store)
    saved = checkpoint.fn({}, upstream={"train_parallel": trained}, store=store)
    upstream = {"checkpoint": saved, "train_parallel": trained, "encode": data}
    verdict = verify.fn(VerifyParams(), upstream=upstream, store=store)
    assert verdict["metrics"]["passed"] and verdict["metrics"]["max_abs_diff"] < 1e-5

    # A checkpoint version with one parameter nudged, published like any other.
    model, _ = trained_model(Store(store).require(trained))
    kernel = model.lm_head.kernel
    kernel.set_value(kernel.get_value().at[0, 0].add(0.05))
    bad, _ = Store(store).produce("checkpoint", "f" * 20, {}, {}, lambda out: save_model(out.path(MODEL), model, cfg.model))
    with pytest.raises(VerificationError, match="differ .* --refresh checkpoint"):
        verify.fn(VerifyParams(), upstream={**upstream, "checkpoint": bad.describe()}, store=store)
    assert len(Store(store).versions("verify")) == 1  # the failed verdict was not published


def test_a_damaged_input_is_refused_before_use(tmp_path, small_corpus):
    from artifacts.store import StoreError
    from tasks.train import train_single

    path, md5 = small_corpus
    store = str(tmp_path / "store")
    cfg = build_config("tiny")
    corpus = fetch.fn(DataConfig(corpus=str(path), md5=md5), store=store)
    data = encode.fn(cfg.data, upstream={"fetch": corpus}, store=store)
    arrow = Store(store).require(data).file("train.arrow")
    raw = bytearray(arrow.read_bytes())
    raw[-100] ^= 0x01  # one flipped bit, same size
    arrow.write_bytes(bytes(raw))
    request = TrainingRequest(model=cfg.model, train=cfg.train, devices=1, platform="cpu")
    with pytest.raises(StoreError, match="missing or damaged; rerun with --refresh encode"):
        train_single.fn(request, upstream={"encode": data}, store=store)
    assert not Store(store).versions("train_single")


def test_a_write_that_fails_midway_publishes_nothing(tmp_path, small_corpus, monkeypatch):
    import errno

    import tasks.encode

    path, md5 = small_corpus
    store = str(tmp_path / "store")
    cfg = build_config("tiny")
    corpus = fetch.fn(DataConfig(corpus=str(path), md5=md5), store=store)
    real_write = tasks.encode.write_sequences

    def disk_full(target, rows, metadata):
        real_write(target, rows[: len(rows) // 2], metadata)  # half a file is on disk...
        raise OSError(errno.ENOSPC, "No space left on device")  # ...when the disk fills up

    monkeypatch.setattr(tasks.encode, "write_sequences", disk_full)
    with pytest.raises(OSError, match="No space left"):
        encode.fn(cfg.data, upstream={"fetch": corpus}, store=store)
    assert entries(Path(store) / "encode") == []  # no version, no half-built folder
    monkeypatch.setattr(tasks.encode, "write_sequences", real_write)
    assert encode.fn(cfg.data, upstream={"fetch": corpus}, store=store)["ran"]
