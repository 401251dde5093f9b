"""Dropout (``model.dropout``) and the state a training stage delivers (``train.keep``):
dropout 0 is the model and program of before it, a rate above 0 drops what it says and a
resumed run draws what the uninterrupted one did; ``keep=best`` delivers the evaluated step of
lowest validation loss, from its own checkpoint when the run was resumed."""

from __future__ import annotations

import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from bardflow.config.settings import TrainingRequest, build_config
from bardflow.model.data.splits import Batches, encode
from bardflow.model.training.checkpoint import TrainingCheckpoints, params_digest
from bardflow.model.training.evaluation import val_batches
from bardflow.model.training.hooks import Hook
from bardflow.model.training.loop import TrainingSetup, train
from bardflow.model.training.placement import Placement
from bardflow.model.training.step import init_state, make_train_step, model_from_state, target_losses
from tests.helpers import play_text

TINY = build_config("tiny")
# A wider tiny model on 8 training rows: it learns, then overfits, its best validation loss at
# step 10 of 40 (3.2 there, 3.9 and rising from step 20).
MODEL = TINY.model.model_copy(update={"d_model": 64, "ffn_dim": 256, "dropout": 0.1})
TRAIN = TINY.train.model_copy(
    update={"steps": 40, "log_every": 10, "learning_rate": 0.01, "checkpoint_every": 15, "keep": "best"}
)


@pytest.fixture(scope="module")
def split():
    return encode(play_text(64_000), TINY.data.seq_len, 0.9, 0)


def test_dropout_zero_is_the_model_and_the_keys_of_before_it():
    tokens = jnp.zeros((4, TINY.data.seq_len), jnp.int32)
    programs = {}
    for rate in (0.0, 0.2):
        model = TINY.model.model_copy(update={"dropout": rate})
        graphdef, state = init_state(model, TINY.train)
        programs[rate] = make_train_step(graphdef, seed=1 if rate else 0).lower(state, tokens).as_text()
        request = TrainingRequest(model=model, train=TINY.train, devices=1, platform="cpu")
        assert ("dropout" in request.recipe()["model"]) == bool(rate)
    assert "threefry" not in programs[0.0] and "threefry" in programs[0.2]
    # XLA's generator where asked (a TPU's auto): its own program, and its own key, since it
    # draws other masks; on a CPU auto keeps JAX's default, and with it every key of before.
    graphdef, state = init_state(model, TINY.train)
    rbg = make_train_step(graphdef, seed=1, generator="rbg").lower(state, tokens).as_text()
    assert "rng_bit_generator" in rbg and "rng_bit_generator" not in programs[0.2]
    dropping = TINY.model.model_copy(update={"dropout": 0.2})
    keys = {
        platform: TrainingRequest(model=m, train=TINY.train, devices=1, platform=platform).recipe()["train"]
        for platform, m in (("tpu", dropping), ("cpu", dropping), ("gpu", dropping), ("tpu-none", TINY.model))
    }
    assert keys["tpu"]["dropout_generator"] == "rbg"
    assert not any("dropout_generator" in keys[p] for p in ("cpu", "gpu", "tpu-none"))
    asked = TINY.train.model_copy(update={"dropout_generator": "unsafe_rbg", "layers": "scanned"})
    recipe = TrainingRequest(model=dropping, train=asked, devices=1, platform="cpu").recipe()["train"]
    assert recipe["dropout_generator"] == "unsafe_rbg" and "layers" not in recipe
    plain = TrainingRequest(model=TINY.model, train=TINY.train, devices=1, platform="cpu")
    assert "keep" not in plain.recipe()["train"]
    assert TrainingRequest(model=MODEL, train=TRAIN, devices=1, platform="cpu").recipe()["train"]["keep"] == "best"


def test_dropout_drops_its_rate_in_training_and_nothing_in_evaluation():
    from bardflow.model.network.transformer import build_model, dropped

    ones = jnp.ones((1000, 100))
    out = dropped(ones, 0.2, jax.random.key(0))
    assert abs(float(jnp.mean(out == 0)) - 0.2) < 0.01 and abs(float(out.mean()) - 1.0) < 0.02
    assert dropped(ones, 0.2, None) is ones
    model = build_model(MODEL, seed=0)
    tokens = jax.random.randint(jax.random.key(1), (4, TINY.data.seq_len), 0, 256)
    losses = nnx.jit(target_losses)
    assert np.array_equal(losses(model, tokens), losses(model, tokens))  # no key: no dropout
    dropping = nnx.jit(lambda m, t, key: target_losses(m, t, dropout_key=key))
    one, other = (dropping(model, tokens, jax.random.key(k)) for k in (0, 1))
    assert not np.allclose(one, other) and not np.allclose(one, losses(model, tokens))


def _run(split, checkpoints=None, best=None, hooks=(), model=MODEL):
    graphdef, state = init_state(model, TRAIN)
    result = train(
        TrainingSetup(
            graphdef,
            state,
            Batches(split.train[:8], 4),
            val_batches(split.val[:64], 16),
            Placement.single(jax.devices()[0]),
            TRAIN,
            checkpoints=checkpoints,
            hooks=hooks,
            best=best,
        )
    )
    return graphdef, result


def test_keep_best_delivers_the_evaluated_step_of_lowest_validation_loss_also_after_a_resume(split, tmp_path):
    graphdef, whole = _run(split)  # no checkpoints: the best state is copied on the device
    evaluated = [(h["val_loss"], h["step"]) for h in whole.history if h["val_loss"] is not None]
    assert whole.kept is not None and (whole.kept["val_loss"], whole.kept["step"]) == min(evaluated)
    assert whole.kept["step"] == 10 < whole.steps - 1 and "lowest validation loss" in whole.kept["why"]
    assert whole.val_loss == whole.kept["val_loss"] < whole.history[-1]["val_loss"]
    delivered = model_from_state(graphdef, whole.state)
    rows = jnp.asarray(split.val[:64], jnp.int32)
    assert float(nnx.jit(target_losses)(delivered, rows).mean()) == pytest.approx(whole.kept["val_loss"], rel=1e-5)

    class Interrupted(Exception):
        pass

    def interrupt(info):
        raise Interrupted

    checkpoints, best = TrainingCheckpoints(tmp_path / "resume", 2), TrainingCheckpoints(tmp_path / "resume/best", 1)
    with pytest.raises(Interrupted):  # after the checkpoint of step 30, its best from step 10 on disk
        _run(split, checkpoints, best, [Hook(interrupt, lambda info: info.done == 32)])
    checkpoints.close(), best.close()
    assert TrainingCheckpoints.steps(tmp_path / "resume") == [15, 30]
    assert TrainingCheckpoints.steps(tmp_path / "resume/best") == [11]  # after step 10
    checkpoints, best = TrainingCheckpoints(tmp_path / "resume", 2), TrainingCheckpoints(tmp_path / "resume/best", 1)
    graphdef, resumed = _run(split, checkpoints, best)
    checkpoints.close(), best.close()
    assert resumed.resumed_from == 30 and resumed.kept == whole.kept
    # Dropout drew the same masks after the resume: the same history and the same parameters.
    assert [h["loss"] for h in resumed.history] == [h["loss"] for h in whole.history]
    assert params_digest(model_from_state(graphdef, resumed.state)) == params_digest(delivered)

    # A best folder that holds an older best than the run's record names (its save of the
    # newer one never finished): not delivered as that step's state, said instead.
    checkpoints, best = TrainingCheckpoints(tmp_path / "again", 2), TrainingCheckpoints(tmp_path / "again/best", 1)
    with pytest.raises(Interrupted):
        _run(split, checkpoints, best, [Hook(interrupt, lambda info: info.done == 32)])
    checkpoints.close(), best.close()
    kept = TrainingCheckpoints(tmp_path / "again/best", 1)
    state, record = kept.latest(init_state(MODEL, TRAIN)[1])  # the best of step 10, saved after it
    kept.close()
    shutil.rmtree(tmp_path / "again/best")
    older = TrainingCheckpoints(tmp_path / "again/best", 1)
    older.save(6, state, {**record, "step": 6, "best": {**record["best"], "step": 5}})
    older.close()
    checkpoints, best = TrainingCheckpoints(tmp_path / "again", 2), TrainingCheckpoints(tmp_path / "again/best", 1)
    _, stale_best = _run(split, checkpoints, best)
    checkpoints.close(), best.close()
    assert stale_best.kept is not None and stale_best.kept["step"] == stale_best.steps - 1
    assert "the state of step 10 was not found" in stale_best.kept["why"]
