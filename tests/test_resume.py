"""Resumable training: an interrupted run picks up from its last checkpoint and ends
bitwise where an uninterrupted one does; a diverging loss stops at once; the resume folder
has one writer, and a run on another layout takes the checkpoint of the same training
(``artifacts/resume.py``)."""

import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from flax import nnx

from bardflow.artifacts.resume import ResumeFolder, adopt_checkpoints, same_training
from bardflow.config.settings import build_config
from bardflow.errors import StoreError
from bardflow.model.data.splits import Batches, encode
from bardflow.model.training.checkpoint import TrainingCheckpoints
from bardflow.model.training.loop import TrainingSetup, train
from bardflow.model.training.placement import Placement
from bardflow.model.training.step import TrainingError, init_state
from tests.helpers import REPO, play_text, without_seconds

TINY = build_config("tiny")
CFG = TINY.train.model_copy(update={"steps": 30, "log_every": 4, "checkpoint_every": 5})


class Preempted(Exception):
    pass


@pytest.fixture(scope="module")
def batches():
    return Batches(encode(play_text(64_000), TINY.data.seq_len, 0.9, 0).train, 8)


def leaves(state):
    return [np.asarray(x) for x in jax.tree.leaves(nnx.to_pure_dict(state))]


def run(batches, checkpoints=None, stop_at=None, cfg=CFG, model=TINY.model):
    def on_step(done, total):
        if done == stop_at:
            raise Preempted(done)

    graphdef, state = init_state(model, cfg)
    return train(
        TrainingSetup(
            graphdef,
            state,
            batches,
            [],
            Placement.single(jax.devices()[0]),
            cfg,
            on_step=on_step,
            checkpoints=checkpoints,
        )
    )


# The codelab's constant rate, and a schedule with clipping: its step count is optimizer
# state, so the resumed run continues the schedule where it stopped.
SCHEDULED = CFG.model_copy(update={"schedule": "cosine", "warmup_steps": 6, "grad_clip": 0.5})
# Muon's state (momentum of the matrices, AdamW moments of the rest, masked nodes between
# them) goes through the checkpoint as well.
MUON = SCHEDULED.model_copy(update={"optimizer": "muon", "beta2": 0.99})


# Dropout from XLA's generator (a TPU's), the blocks scanned and a loop of steps a call: the
# masks follow from the seed and the step, so the resumed run draws what the whole one drew.
DROPPING = SCHEDULED.model_copy(update={"dropout_generator": "rbg", "layers": "scanned", "steps_per_call": 5})
DROPOUT_MODEL = TINY.model.model_copy(update={"dropout": 0.1, "num_layers": 2})


@pytest.mark.parametrize(
    "cfg, model",
    [(CFG, TINY.model), (SCHEDULED, TINY.model), (MUON, TINY.model), (DROPPING, DROPOUT_MODEL)],
    ids=["constant", "cosine+clip", "muon", "rbg-dropout+scanned"],
)
def test_an_interrupted_run_resumes_and_ends_bitwise_equal(tmp_path, batches, cfg, model):
    reference = run(batches, cfg=cfg, model=model)

    checkpoints = TrainingCheckpoints(tmp_path / "ckpt", keep=2)
    with pytest.raises(Preempted):
        run(batches, checkpoints, stop_at=13, cfg=cfg, model=model)
    checkpoints.close()
    kept = sorted(int(p.name) for p in (tmp_path / "ckpt").iterdir() if p.name.isdigit())
    assert kept == [5, 10]  # the last two, every 5 steps

    checkpoints = TrainingCheckpoints(tmp_path / "ckpt", keep=2)
    resumed = run(batches, checkpoints, cfg=cfg, model=model)
    checkpoints.close()
    assert resumed.resumed_from == 10 and reference.resumed_from is None
    assert without_seconds(resumed.history) == without_seconds(reference.history)
    for a, b in zip(leaves(resumed.state), leaves(reference.state), strict=True):
        np.testing.assert_array_equal(a, b)


def test_a_diverging_loss_stops_at_once_and_keeps_the_last_good_checkpoint(tmp_path, batches):
    checkpoints = TrainingCheckpoints(tmp_path / "ckpt", keep=2)
    run(batches, checkpoints, cfg=CFG.model_copy(update={"steps": 10, "checkpoint_every": 5}))
    checkpoints.close()  # steps 5 is kept; a finished run saves no final checkpoint here

    exploding = CFG.model_copy(update={"learning_rate": 1e30})
    checkpoints = TrainingCheckpoints(tmp_path / "ckpt", keep=2)
    kept = r"(loss became nan|non-finite) at step \d+; the checkpoint of step 5 is kept"
    with pytest.raises(TrainingError, match=kept):
        run(batches, checkpoints, cfg=exploding)
    checkpoints.close()
    graphdef, template = init_state(TINY.model, CFG)
    restored, record = TrainingCheckpoints(tmp_path / "ckpt", keep=2).latest(template)
    assert record["step"] == 5
    assert all(np.isfinite(x).all() for x in leaves(restored) if x.dtype.kind == "f")


def test_a_damaged_checkpoint_is_named_set_aside_and_the_run_resumes_from_an_intact_one(tmp_path, batches):
    """Each checkpoint is sealed with its files' sha256 once complete. One bit flipped in the
    newest one's data: named as damaged, set aside, and the run resumes from the one before
    to the same end as an uninterrupted run. One that Orbax cannot read (and has no seal):
    set aside too, and the run starts over."""
    from bardflow.model.training.checkpoint import SEAL

    reference = run(batches)
    checkpoints = TrainingCheckpoints(tmp_path / "ckpt", keep=2)
    with pytest.raises(Preempted):
        run(batches, checkpoints, stop_at=13)
    checkpoints.close()
    assert all((tmp_path / "ckpt" / step / SEAL).is_file() for step in ("5", "10"))

    newest = tmp_path / "ckpt" / "10"
    data = max((p for p in newest.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    flipped = bytearray(data.read_bytes())
    flipped[len(flipped) // 2] ^= 0x40
    data.write_bytes(bytes(flipped))
    heard = []
    checkpoints = TrainingCheckpoints(tmp_path / "ckpt", keep=2, note=heard.append)
    resumed = run(batches, checkpoints)
    checkpoints.close()
    assert heard == [
        f"the training checkpoint of step 10 in {tmp_path / 'ckpt'} is damaged "
        f"({data.relative_to(newest).as_posix()} changed since it was written); set aside as damaged-10, "
        "resuming from step 5"
    ]
    assert resumed.resumed_from == 5 and (tmp_path / "ckpt" / "damaged-10").is_dir()
    assert without_seconds(resumed.history) == without_seconds(reference.history)
    for a, b in zip(leaves(resumed.state), leaves(reference.state), strict=True):
        np.testing.assert_array_equal(a, b)

    # Unsealed (written before seals were) and unreadable: Orbax's error, then the start.
    kept = TrainingCheckpoints.steps(tmp_path / "ckpt")
    for step in kept:
        (tmp_path / "ckpt" / str(step) / SEAL).unlink()
        for file in (tmp_path / "ckpt" / str(step) / "state").rglob("*METADATA*"):
            file.write_text("{")
    heard.clear()
    checkpoints = TrainingCheckpoints(tmp_path / "ckpt", keep=2, note=heard.append)
    again = run(batches, checkpoints)
    checkpoints.close()
    assert again.resumed_from is None and len(heard) == len(kept)
    assert heard[0].startswith(
        f"the training checkpoint of step {kept[-1]} in {tmp_path / 'ckpt'} is damaged (Orbax cannot read it: "
    ) and heard[-1].endswith("resuming from the start")
    assert without_seconds(again.history) == without_seconds(reference.history)


def test_a_save_cut_off_by_a_kill_leaves_nothing_the_rerun_trips_on(tmp_path, batches, caplog):
    """``kill -9`` during a save leaves Orbax's temporary folder of that step; the rerun's
    save of the same step used to meet it ("Attempted to create temporary directory …
    already exists")."""
    import logging

    checkpoints = TrainingCheckpoints(tmp_path / "ckpt", keep=2)
    with pytest.raises(Preempted):
        run(batches, checkpoints, stop_at=13)
    checkpoints.close()
    leftover = tmp_path / "ckpt" / "15.orbax-checkpoint-tmp"
    (leftover / "state").mkdir(parents=True)
    (leftover / "state" / "half-written").write_bytes(b"\0" * 100)
    with caplog.at_level(logging.INFO):
        checkpoints = TrainingCheckpoints(tmp_path / "ckpt", keep=2)
        resumed = run(batches, checkpoints)
        checkpoints.close()
    assert resumed.resumed_from == 10 and not leftover.exists()
    assert "already exists" not in caplog.text
    assert TrainingCheckpoints.steps(tmp_path / "ckpt")[-1] > 15


def test_a_step_s_time_leaves_the_checkpoints_out(tmp_path, batches, monkeypatch):
    """tiny's summary said 29 ms a step where the step took 1.1: the time of a 20-step run's
    two checkpoints (and the first check's compilation) was counted as the steps'. Here each
    save takes 100 s by the run's clock (the clock moved on, not slept: a busy host cannot
    blur it), so counted, five saves would make the run's training time 500 s."""
    import time
    from types import SimpleNamespace

    from bardflow.model.training import hooks

    moved = [0.0]
    monkeypatch.setattr(hooks, "time", SimpleNamespace(perf_counter=lambda: time.perf_counter() + moved[0]))

    class SlowToSave(TrainingCheckpoints):
        def save(self, step, state, record):
            moved[0] += 100.0  # a slow disk, or a first save's start-up
            super().save(step, state, record)

    checkpoints = SlowToSave(tmp_path / "ckpt", keep=2)
    result = run(batches, checkpoints)
    checkpoints.close()
    assert TrainingCheckpoints.steps(tmp_path / "ckpt") == [20, 25] and moved[0] == 500.0  # five saves
    assert 0 < result.elapsed_s < 100, result.elapsed_s


def test_a_resume_folder_has_one_writer_and_the_next_waits_for_it(tmp_path):
    """What a rerun does while a training process of a killed run still writes its resume
    folder: waits (saying so once), then takes it; past its wait, one line names the writer."""
    folder = ResumeFolder(tmp_path / ".resume-x")
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from pathlib import Path; "
            "from bardflow.artifacts.resume import ResumeFolder\n"
            "with ResumeFolder(Path(sys.argv[1])).writing():\n"
            "    print('held', flush=True); time.sleep(float(sys.argv[2]))",
            str(folder.path),
            "3",
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout.readline().strip() == "held"
    with pytest.raises(
        StoreError,
        match=rf"process {holder.pid} still writes checkpoints into {folder.path} \(the "
        rf"training of an earlier run\); wait for it to end or stop it \(kill "
        rf"{holder.pid}\), then rerun",
    ):
        with folder.writing(wait_s=0.2):
            pass
    heard = []
    started = time.monotonic()
    with folder.writing(say=heard.append, wait_s=30):
        assert 0.5 < time.monotonic() - started < 15  # it waited for the holder's 3 s
    assert holder.wait(timeout=10) == 0
    assert heard == [
        f"waiting for process {holder.pid}, the training of an earlier run, to stop writing into {folder.path}"
    ]
    folder.drop_if_empty()  # its lock file is no reason to keep the folder
    assert not folder.path.exists()


def test_a_run_on_another_device_count_takes_the_checkpoint_of_the_same_training(tmp_path):
    """Interrupted on four devices, rerun on two with the same global batch: the new version's
    resume folder takes the newest checkpoint (Orbax reads it onto the new layout, as the
    four-device tests show); another global batch is another training and is left alone."""
    from bardflow.config.settings import TrainingRequest

    cfg = build_config("cpu", {"train.sharding": "fsdp"})

    def request(devices: int, per_device_batch: int) -> TrainingRequest:
        train = cfg.train.model_copy(update={"per_device_batch": per_device_batch})
        return TrainingRequest(model=cfg.model, train=train, devices=devices, platform="cpu")

    stage = tmp_path / "train_parallel"
    on_four = stage / ".resume-four"
    assert adopt_checkpoints(ResumeFolder(on_four), request(4, 4)) is None  # nothing to take: it trains, and stops
    for step in (100, 200):
        (on_four / str(step)).mkdir()
        (on_four / str(step) / "state").write_text(f"step {step}")
    other = stage / ".resume-other-batch"
    adopt_checkpoints(ResumeFolder(other), request(4, 8))
    (other / "300").mkdir()
    assert same_training(request(2, 8)) == same_training(request(4, 4)) != same_training(request(4, 8))
    on_two = ResumeFolder(stage / ".resume-two")
    assert on_two.siblings() == sorted([on_four, other])  # the store's layout, known to the store alone
    assert adopt_checkpoints(on_two, request(2, 8)) == (200, 4)
    assert (on_two.path / "200" / "state").read_text() == "step 200" and not (on_two.path / "300").exists()
    assert adopt_checkpoints(on_two, request(2, 8)) is None  # it has its own now
    empty = ResumeFolder(stage / ".resume-fresh")
    adopt_checkpoints(empty, request(8, 1))
    empty.drop_if_empty()  # a run that failed before its first checkpoint leaves nothing
    assert not empty.path.exists()
