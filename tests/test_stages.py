"""Stages run through the stage contract (``tasks.stage.produce``) over a real store:
no Prefect server."""

import hashlib
import json
import socket
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from bardflow.artifacts.store import Store
from bardflow.config.settings import ConfigError, DataConfig, TrainingRequest, VerifyConfig, build_config
from bardflow.model.data.download import download
from bardflow.model.training.checkpoint import save_model
from bardflow.tasks.checkpoint import MODEL
from bardflow.tasks.corpus_identity import pin
from bardflow.tasks.fetch import FetchError
from bardflow.tasks.registry import CHECKPOINT, ENCODE, EXPORT, FETCH, TRAIN_PARALLEL, TRAIN_SINGLE, VERIFY
from bardflow.tasks.stage import produce
from bardflow.tasks.train import trained_model
from bardflow.tasks.verify import VerificationError
from tests.helpers import md5_bytes, play_text


def make(stage, settings, store, **upstream):
    """The stage's version (built, or found in the store) and whether it was built."""
    return produce(stage, settings, upstream, Store(store))


def fetch(data: DataConfig, store):
    return make(FETCH, data, store)[0]


def entries(root):
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if ".lock-" not in p.name)


def test_md5_mismatch_names_both_checksums_and_the_source_and_leaves_nothing(tmp_path, small_corpus):
    path, real_md5 = small_corpus
    store = tmp_path / "store"
    wrong = "0" * 32
    with pytest.raises(FetchError) as error:
        fetch(DataConfig(corpus=str(path), md5=wrong), store)
    message = str(error.value)
    assert wrong in message and real_md5 in message and str(path) in message and "--set data.md5=" in message
    assert entries(store) == ["fetch"]  # only the (empty) stage folder


def test_path_and_file_url_sources_give_the_same_version(tmp_path, small_corpus):
    path, md5 = small_corpus
    first, ran_first = make(FETCH, DataConfig(corpus=str(path), md5=md5), tmp_path / "a")
    second, ran_second = make(FETCH, DataConfig(corpus=path.as_uri(), md5=md5), tmp_path / "b")
    assert ran_first and ran_second
    assert first.key == second.key and first.fingerprint == second.fingerprint
    assert Store(tmp_path / "a").require(first).file("corpus.txt").read_bytes() == path.read_bytes()


def test_a_fetched_corpus_is_not_fetched_again(tmp_path, small_corpus):
    path, md5 = small_corpus
    store = tmp_path / "store"
    fetch(DataConfig(corpus=str(path), md5=md5), store)
    path.unlink()  # the source is gone: only the store can answer now
    again, ran = make(FETCH, DataConfig(corpus=str(path), md5=md5), store)
    assert not ran and again.metrics["bytes"] == 64_000


def test_the_real_corpus_matches_the_default_checksum(tmp_path, shakespeare):
    out = fetch(DataConfig(corpus=str(shakespeare), md5="6fb458f1232090904fb40fe944165e91"), tmp_path)
    assert {k: out.metrics[k] for k in ("bytes", "md5", "sha256", "distinct_bytes")} == {
        "bytes": 1_115_394,
        "md5": "6fb458f1232090904fb40fe944165e91",
        "distinct_bytes": 65,
        "sha256": hashlib.sha256(shakespeare.read_bytes()).hexdigest(),
    }
    assert out.manifest["files"]["corpus.txt"]["sha256"] == out.metrics["sha256"]  # taken as it streamed
    assert pin(DataConfig()).md5 == "6fb458f1232090904fb40fe944165e91"  # the default download's known sum


def test_your_own_text_needs_no_checksum_and_a_folder_is_one_corpus(tmp_path, small_corpus):
    """A local file's md5 is computed when the run starts and keys its version as a given one
    would; a folder's .txt files are one corpus, in sorted order, listed in the manifest."""
    path, md5 = small_corpus
    assert pin(DataConfig(corpus=str(path))).md5 == md5 == pin(DataConfig(corpus=path.as_uri())).md5
    given, _ = make(FETCH, DataConfig(corpus=str(path), md5=md5), tmp_path / "a")
    computed, ran = make(FETCH, pin(DataConfig(corpus=str(path))), tmp_path / "b")
    assert ran and computed.key == given.key and computed.metrics["md5"] == md5

    books = tmp_path / "books"
    (books / "b").mkdir(parents=True)
    parts = {"b/second.txt": b"To be, or not to be.\n", "a.txt": b"ROMEO:\nBut soft!\n", "z.txt": b"Exeunt.\n"}
    for name, text in parts.items():
        (books / name).write_bytes(text)
    (books / "notes.md").write_text("not text of the corpus")
    (books / ".hidden.txt").write_text("nor this")
    folder, _ = make(FETCH, pin(DataConfig(corpus=str(books))), tmp_path / "c")
    whole = parts["a.txt"] + parts["b/second.txt"] + parts["z.txt"]
    assert folder.file("corpus.txt").read_bytes() == whole and folder.metrics["md5"] == md5_bytes(whole)
    assert [f["name"] for f in folder.manifest["corpus_files"]] == ["a.txt", "b/second.txt", "z.txt"]

    with pytest.raises(FetchError, match="gone.txt does not exist; check --corpus"):
        pin(DataConfig(corpus=str(tmp_path / "gone.txt")))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FetchError, match="holds no .txt files"):
        pin(DataConfig(corpus=str(tmp_path / "empty")))
    with pytest.raises(ConfigError, match=r"has none; pass it with --set data.md5="):
        pin(DataConfig(corpus="https://example.com/my-text.txt"))  # a download: checked against a known sum
    assert pin(DataConfig(corpus="https://example.com/my-text.txt", md5=md5)).md5 == md5


def test_a_missing_file_and_an_unreachable_url_fail_fast_and_clearly(tmp_path):
    with pytest.raises(FetchError, match="does not exist; check --corpus"):
        fetch(DataConfig(corpus=str(tmp_path / "nope.txt"), md5="0" * 32), tmp_path / "s")
    with socket.socket() as sock:  # a port that nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    # Refused, or a host with no address (offline, every host): said at once, not after four
    # attempts and their back-off.
    for url in (f"http://127.0.0.1:{port}/input.txt", "http://bardflow-test.invalid/input.txt"):
        started = time.monotonic()
        with pytest.raises(FetchError, match=r"after 1 attempt\(s\); check the network"):
            download(url, tmp_path / "x", timeout_s=2)
        assert time.monotonic() - started < 5


def test_verify_and_export_pass_on_the_real_checkpoint_and_fail_on_a_perturbed_one(tmp_path, small_corpus, monkeypatch):
    path, md5 = small_corpus
    store = tmp_path / "store"
    cfg = build_config("tiny", {"train.steps": 3})
    corpus = fetch(DataConfig(corpus=str(path), md5=md5), store)
    data, _ = make(ENCODE, cfg.data, store, fetch=corpus)
    request = TrainingRequest(model=cfg.model, train=cfg.train, devices=len(jax.devices()), platform="cpu")
    single, _ = make(TRAIN_SINGLE, request.model_copy(update={"devices": 1}), store, encode=data)
    trained, _ = make(TRAIN_PARALLEL, request, store, encode=data, train_single=single)
    assert "reused_from" not in trained.metrics and trained.metrics["devices"] == 2
    saved, _ = make(CHECKPOINT, {}, store, train_parallel=trained)
    upstream = {"checkpoint": saved, "train_parallel": trained, "encode": data}
    verdict, _ = make(VERIFY, VerifyConfig(), store, **upstream)
    assert verdict.metrics["passed"] and verdict.metrics["max_abs_diff"] < 1e-5

    # A checkpoint version with one parameter nudged, published like any other.
    model, _ = trained_model(Store(store).require(trained))
    kernel = model.lm_head.kernel
    kernel.set_value(kernel.get_value().at[0, 0].add(0.05))
    bad, _ = Store(store).produce(
        "checkpoint", "f" * 20, {}, {}, lambda out: save_model(out.path(MODEL), model, cfg.model)
    )
    with pytest.raises(VerificationError, match="differ .* --refresh checkpoint"):
        make(VERIFY, VerifyConfig(), store, **{**upstream, "checkpoint": bad})
    assert len(Store(store).versions("verify")) == 1  # the failed verdict was not published

    # The export: safetensors by path name that numpy alone reads, and a forward pass that a
    # fresh interpreter without bardflow ran (the stage checked it), for CPU and CUDA.
    from safetensors.numpy import load_file

    from bardflow.model.inference.export import flat_params
    from bardflow.tasks import export

    exported, _ = make(EXPORT, {"hf_check": "off"}, store, checkpoint=saved)
    folder = exported.file("export")
    assert sorted(p.name for p in folder.iterdir()) == [
        "checksums.json",
        "config.json",
        "forward.jax",
        "hf",
        "hf_check.json",
        "model.safetensors",
    ]
    # The transformers folder beside it (tests/test_hf_export.py loads such folders with
    # transformers; this session leaves that check off, BARDFLOW_HF_CHECK): said so.
    assert sorted(p.name for p in (folder / "hf").iterdir()) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    assert exported.manifest["hf"]["status"].startswith("not checked") and exported.metrics["hf_checked"] is False
    # ... in a file of the version too, so that a refresh whose check runs is a new output.
    assert json.loads((folder / "hf_check.json").read_text())["status"] == exported.manifest["hf"]["status"]
    sums = json.loads((folder / "checksums.json").read_text())["sha256"]  # every file, hf/'s too
    assert sorted(sums) == sorted(
        p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file() and p.name != "checksums.json"
    )
    weights = load_file(str(folder / "model.safetensors"))
    ours = flat_params(trained_model(Store(store).require(trained))[0])
    assert sorted(weights) == sorted(ours) and "blocks.0.attn.qkv.kernel" in weights
    assert all(np.array_equal(weights[name], ours[name]) for name in ours)
    assert exported.metrics["max_abs_diff"] <= 1e-5 and exported.metrics["platforms"] == "cpu,cuda"
    assert json.loads((folder / "config.json").read_text())["max_seq_len"] == cfg.model.max_seq_len

    # The same settings again: the same bytes, so the stored version stays as it is. Another
    # check (here: transformers missing, where the first had the check off; after `pip
    # install`, checked) is another key: a new version beside the first, which is untouched.
    again, built = produce(EXPORT, {"hf_check": "off"}, {"checkpoint": saved}, Store(store), force=True)
    assert built and again.same_as_stored and again.key == exported.key
    before = {p: p.read_bytes() for p in folder.rglob("*") if p.is_file()}
    missing, built = produce(EXPORT, {"hf_check": "not installed"}, {"checkpoint": saved}, Store(store))
    assert built and missing.key != exported.key
    assert "pip install" in Store(store).require(missing).manifest["hf"]["status"]
    assert {p: p.read_bytes() for p in folder.rglob("*") if p.is_file()} == before
    assert Store(store).lookup("export", exported.key) is not None

    def nudged(folder, model, cfg):  # an export whose weights are not the checkpoint's
        held = write(folder, model, cfg)
        tensors = load_file(str(folder / "model.safetensors"))
        tensors["lm_head.kernel"] = tensors["lm_head.kernel"] + 0.05
        save_file(tensors, str(folder / "model.safetensors"))
        return held

    from safetensors.numpy import save_file

    write = export.write_export
    monkeypatch.setattr(export, "write_export", nudged)
    with pytest.raises(export.ExportError, match=r"differ from the checkpoint's by .* --refresh export"):
        produce(EXPORT, {"hf_check": "off"}, {"checkpoint": saved}, Store(store), force=True)
    assert len(Store(store).versions("export")) == 2  # the two above: nothing half-written was published


def test_with_one_device_train_parallel_takes_over_train_single_instead_of_training_again(tmp_path, small_corpus):
    path, md5 = small_corpus
    store = tmp_path / "store"
    cfg = build_config("tiny", {"train.steps": 3})
    data, _ = make(ENCODE, cfg.data, store, fetch=fetch(DataConfig(corpus=str(path), md5=md5), store))
    one = TrainingRequest(model=cfg.model, train=cfg.train, devices=1, platform="cpu")
    single, _ = make(TRAIN_SINGLE, one, store, encode=data)
    parallel, built = make(TRAIN_PARALLEL, one, store, encode=data, train_single=single)
    assert built and parallel.metrics["reused_from"] == single.key and parallel.fingerprint == single.fingerprint
    assert parallel.file("history.json").read_text() == single.file("history.json").read_text()
    from bardflow.model.training.checkpoint import params_digest

    assert params_digest(trained_model(parallel)[0]) == params_digest(trained_model(single)[0])


def test_a_damaged_input_is_refused_before_use(tmp_path, small_corpus):
    from bardflow.artifacts.store import StoreError

    path, md5 = small_corpus
    store = tmp_path / "store"
    cfg = build_config("tiny")
    corpus = fetch(DataConfig(corpus=str(path), md5=md5), store)
    data, _ = make(ENCODE, cfg.data, store, fetch=corpus)
    arrow = Store(store).require(data).file("train/00000.arrow")
    raw = bytearray(arrow.read_bytes())
    raw[-100] ^= 0x01  # one flipped bit, same size
    arrow.write_bytes(bytes(raw))
    request = TrainingRequest(model=cfg.model, train=cfg.train, devices=1, platform="cpu")
    with pytest.raises(StoreError, match="missing or damaged; rerun with --refresh encode"):
        make(TRAIN_SINGLE, request, store, encode=data)
    assert not Store(store).versions("train_single")


def test_a_write_that_fails_midway_publishes_nothing(tmp_path, small_corpus, monkeypatch):
    import errno

    from bardflow.tasks import encode as encode_stage

    path, md5 = small_corpus
    store = tmp_path / "store"
    cfg = build_config("tiny")
    corpus = fetch(DataConfig(corpus=str(path), md5=md5), store)
    real_write = encode_stage.write_split

    def disk_full(target, rows, metadata, **kwargs):
        real_write(target, rows[: len(rows) // 2], metadata)  # half a split is on disk...
        raise OSError(errno.ENOSPC, "No space left on device")  # ...when the disk fills up

    monkeypatch.setattr(encode_stage, "write_split", disk_full)
    with pytest.raises(OSError, match="No space left"):
        make(ENCODE, cfg.data, store, fetch=corpus)
    assert entries(Path(store) / "encode") == []  # no version, no half-built folder
    monkeypatch.setattr(encode_stage, "write_split", real_write)
    assert make(ENCODE, cfg.data, store, fetch=corpus)[1]


def test_the_registry_is_the_pipeline_in_order():
    import inspect

    from bardflow.tasks.registry import STAGES

    names = [stage.name for stage in STAGES]
    assert len(set(names)) == len(names)
    for index, stage in enumerate(STAGES):
        assert set(stage.reads) <= set(names[:index]), f"{stage.name} reads a later stage"
        parameters = list(inspect.signature(stage.build()).parameters)
        assert parameters[:2] == ["settings", "out"] and set(parameters[2:]) == set(stage.reads), stage.name
        assert stage.builds and stage.headline


def count_words(settings: dict, out, fetch) -> None:
    """A stage added by a test: one function, and the entry below."""
    import json

    words = fetch.file("corpus.txt").read_text().split()
    kept = sorted({w for w in words if len(w) >= settings["min_length"]})
    out.path("words.json").write_text(json.dumps(kept))
    out.metrics["words"] = len(kept)


def test_a_new_stage_is_one_function_and_one_entry(tmp_path, small_corpus):
    import json

    from bardflow.tasks.stage import Stage

    path, md5 = small_corpus
    corpus = fetch(DataConfig(corpus=str(path), md5=md5), tmp_path)
    stage = Stage(
        "words",
        "1",
        reads=("fetch",),
        settings=lambda run: {"min_length": 5},
        builds=("words.json",),
        headline=("words",),
        function=count_words,
    )
    version, ran = make(stage, {"min_length": 5}, tmp_path, fetch=corpus)
    assert ran and version.metrics["words"] == len(json.loads(version.file("words.json").read_text())) > 0
    assert version.manifest["inputs"]["fetch"]["fingerprint"] == corpus.fingerprint
    assert make(stage, {"min_length": 5}, tmp_path, fetch=corpus) == (version, False)  # found, not rebuilt
    assert make(stage, {"min_length": 6}, tmp_path, fetch=corpus)[0].key != version.key
    broken = Stage(
        "words",
        "2",
        reads=("fetch",),
        settings=lambda run: {"min_length": 5},
        builds=("words.json", "letters.json"),
        headline=(),
        function=count_words,
    )
    with pytest.raises(RuntimeError, match="did not write letters.json"):
        make(broken, {"min_length": 5}, tmp_path, fetch=corpus)


def test_the_kernel_choice_and_checkpoint_cadence_are_not_part_of_the_training_key(small_corpus, tmp_path):
    """They change how fast training runs, not what it produces: a run that switches them
    finds its training cached."""
    path, md5 = small_corpus
    corpus = fetch(DataConfig(corpus=str(path), md5=md5), tmp_path)
    cfg = build_config("tiny")
    base = TrainingRequest(model=cfg.model, train=cfg.train, devices=1, platform="cpu")
    faster = TrainingRequest(
        model=cfg.model.model_copy(update={"attention": "xla", "dense": "custom"}),
        train=cfg.train.model_copy(update={"checkpoint_every": 3, "keep_checkpoints": 5}),
        devices=1,
        platform="cpu",
    )
    other = TrainingRequest(
        model=cfg.model, train=cfg.train.model_copy(update={"steps": 21}), devices=1, platform="cpu"
    )
    upstream = {"encode": corpus}  # any version: only its fingerprint enters the key
    assert TRAIN_SINGLE.key(base, upstream) == TRAIN_SINGLE.key(faster, upstream)
    assert TRAIN_SINGLE.key(base, upstream) != TRAIN_SINGLE.key(other, upstream)
    assert TRAIN_SINGLE.key(base, upstream) != TRAIN_PARALLEL.key(base, {**upstream, "train_single": corpus})


def test_a_corpus_folder_reads_only_its_own_regular_files_and_its_copies_keep_their_permissions(tmp_path):
    """A link out of the folder would publish another file (``/etc/shadow``, run as root) into
    the store: refused, naming the link and where it leads. A link within the folder is read.
    What the store keeps of the corpus (its copy, the encoded windows) is no more readable
    than the files it came from."""
    import os

    secret = tmp_path / "secret.txt"
    secret.write_bytes(play_text(4_000, seed=3))
    books = tmp_path / "books"
    books.mkdir()
    (books / "a.txt").write_bytes(play_text(40_000))
    (books / "a.txt").chmod(0o640)
    (books / "x.txt").symlink_to(secret)
    with pytest.raises(FetchError, match=r"books: x.txt is a symbolic link to .*secret.txt, outside the folder"):
        pin(DataConfig(corpus=str(books)))
    (books / "x.txt").unlink()
    (books / "y.txt").symlink_to(books / "a.txt")  # within the folder: read
    data = pin(DataConfig(corpus=str(books), seq_len=32))
    fetched, _ = make(FETCH, data, tmp_path / "store")
    assert fetched.file("corpus.txt").read_bytes() == 2 * play_text(40_000)
    assert fetched.file("corpus.txt").stat().st_mode & 0o777 == 0o640
    encoded, _ = make(ENCODE, data, tmp_path / "store", fetch=fetched)
    assert {p.stat().st_mode & 0o777 for name in ENCODE.builds for p in encoded.file(name).iterdir()} == {0o640}
    assert {encoded.file(name).stat().st_mode & 0o777 for name in ENCODE.builds} == {0o750}
    os.chmod(books / "a.txt", 0o644)


@pytest.mark.parametrize("kind", ["device", "fifo", "fifo in a folder", "socket"])
def test_a_corpus_that_is_not_a_regular_file_is_refused_at_once(tmp_path, kind):
    """``/dev/zero`` was read for ever and a FIFO blocked, deaf to SIGTERM."""
    import os
    import socket

    if kind == "device":
        source, words = "/dev/zero", "is a character device, not a regular file"
    elif kind == "socket":
        source, words = str(tmp_path / "s.txt"), "is a socket, not a regular file"
        listening = socket.socket(socket.AF_UNIX)
        listening.bind(source)
    else:
        os.mkfifo(tmp_path / "f.txt")
        source = str(tmp_path if kind == "fifo in a folder" else tmp_path / "f.txt")
        words = "f.txt is a FIFO (named pipe), not a regular file"
    started = time.monotonic()
    with pytest.raises(FetchError, match=words.replace("(", r"\(").replace(")", r"\)")):
        pin(DataConfig(corpus=source))
    with pytest.raises(FetchError, match="not a regular file"):  # as the command line checks it, reading nothing
        from bardflow.model.data.sources import check_local

        check_local(source)
    assert time.monotonic() - started < 5  # refused, not read for ever: a loaded host takes ~1 s


def test_overfitting_is_named_when_validation_loss_rises_as_training_loss_falls():
    """84 KB of text gave training loss 0.045 against validation loss 4.31 without a word."""
    from bardflow.tasks.compare import overfitting

    def history(pairs):
        return [{"step": 10 * i, "loss": loss, "val_loss": val} for i, (loss, val) in enumerate(pairs)]

    line = overfitting(history([(4.0, 3.9), (2.0, 2.6), (0.5, 3.2), (0.045, 4.31)]))
    assert (
        line.startswith(
            "overfitting: validation loss rose from 2.600 (step 10) to 4.310 while training loss fell to 0.045"
        )
        and "more text" in line
        and "train.steps" in line
    )
    assert overfitting(history([(4.0, 3.9), (2.0, 2.6), (1.5, 2.0)])) is None  # still learning
    assert overfitting(history([(4.0, 3.9), (2.0, 2.6), (1.9, 2.62)])) is None  # within noise
    assert overfitting(history([(4.0, 3.9), (2.0, 2.0), (2.1, 2.3)])) is None  # both rose: diverging, not this
    assert overfitting([{"step": 0, "loss": 4.0, "val_loss": None}]) is None


def test_the_comparison_times_both_runs_on_the_same_steps():
    """The cpu preset's single-device run (30 steps) and its data-parallel run (460) were each
    timed over all their steps, warm-up included: a speedup of 2.3 on 2 devices. Timed on the
    same steps, after the first, twice the batch at the same ms/step is 2x."""
    from bardflow.tasks.compare import comparison, timed_window

    def run(steps: int, tokens_per_step: int, first_ms: float = 2000.0, ms: float = 10.0):
        history, clock = [], 0.0
        for step in range(steps):
            clock += (first_ms if step == 0 else ms) / 1e3
            if step % 10 == 0 or step == steps - 1:
                history.append(
                    {"step": step, "tokens": (step + 1) * tokens_per_step, "seconds": round(clock, 3), "loss": 1.0}
                )
        metrics = {
            "tokens_per_s": steps * tokens_per_step / clock,
            "ms_per_step": 1e3 * clock / steps,
            "steps": steps,
            "global_batch": tokens_per_step // 100,
            "per_device_batch": 1,
            "devices": 2,
        }
        return metrics, history

    (single, single_history), (parallel, parallel_history) = run(30, 100), run(460, 200)
    assert parallel["tokens_per_s"] / single["tokens_per_s"] > 10  # the whole runs' misleading ratio
    assert timed_window(single_history, parallel_history) == (0, 20)
    result = comparison(single, parallel, single_history, parallel_history)
    assert result["speedup"] == 2.0 and result["tokens_per_s"] == [10_000.0, 20_000.0]
    rows = {row[0]: row[1:] for row in result["rows"]}
    assert rows["Timed steps"] == ["1 to 20", "1 to 20", "same"] and rows["ms/step"] == ["10.00", "10.00", "1.00x"]
    assert "same steps, 1 to 20" in result["note"] and "ideally give 2x" in result["note"]
    assert "MFU" not in rows  # no peak known (a CPU): no row, rather than a wrong figure
    peaks = {"peak_tflops": 989.0, "flops_per_token": 50_000_000_000}
    with_peaks = comparison({**single, **peaks}, {**parallel, **peaks}, single_history, parallel_history)
    mfu = {row[0]: row[1:] for row in with_peaks["rows"]}["MFU"]  # the timed steps: 10,000 and 20,000 tokens/s
    assert mfu == [f"{100 * 1e4 * 5e10 / (2 * 989e12):.1f} %", f"{100 * 2e4 * 5e10 / (2 * 989e12):.1f} %", "2.00x"]

    # A single-device run of one step shares no window with the other: whole runs, and said so.
    (one, one_history) = run(1, 100)
    result = comparison(one, parallel, one_history, parallel_history)
    assert result["window"] is None and "all its steps" in result["note"]
    assert result["speedup"] == round(parallel["tokens_per_s"] / one["tokens_per_s"], 3)


def test_the_throughput_chart_s_tick_labels_never_overlap():
    """Tokens/s written out ("100000", "120000") ran into each other on the compare stage's
    chart (0.9 px apart at 130,000): at any scale its tick labels stand a word's width apart."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from bardflow.tasks.compare import throughput_figure

    for fastest in (812.0, 61_234.5, 130_000.0, 250_000.0, 3_830_141.0, 2.4e9):
        fig = throughput_figure([("train_single", [], fastest / 3), ("train_parallel", [], fastest)])
        fig.set_dpi(100)  # as the stage saves it
        renderer = fig.canvas.get_renderer()  # pyright: ignore[reportAttributeAccessIssue] - Agg's canvas
        boxes = [t.get_window_extent(renderer) for t in fig.axes[0].get_xticklabels() if t.get_text()]
        assert len(boxes) >= 3
        texts = [t.get_text() for t in fig.axes[0].get_xticklabels()]
        assert all(b.x0 - a.x1 >= 20 for a, b in zip(boxes, boxes[1:], strict=False)), (fastest, texts)
        plt.close(fig)
