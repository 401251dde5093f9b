"""The fast paths against the codelab-style baselines kept in bench/: same numbers."""

import numpy as np
import optax
import pytest
from flax import nnx

from bardflow.config.settings import build_config
from bardflow.model.inference.sampling import generate
from bardflow.model.network.transformer import build_model
from bardflow.model.training.step import init_state, make_train_step
from bardflow.model.training.step_settings import XLA_CPU_TUNED, default_rows_per_pass
from bench.codelab import codelab_generate, codelab_train_step

TINY = build_config("tiny")


def model_config(preset: str, positions: str):
    """The preset's layers and widths, its window at most 48 bytes: sliding past a window
    is the same code at any length, and the cpu preset's 128 costs three times the bytes.
    Output projections are drawn at random: started at zero, an untrained model's blocks
    would add nothing and every position would see only its own byte."""
    cfg = build_config(preset).model
    return cfg.model_copy(update={"positions": positions, "max_seq_len": min(cfg.max_seq_len, 48), "zero_init": False})


@pytest.mark.parametrize("passes", [8 // default_rows_per_pass(8, TINY.data.seq_len, "cpu"), 4])
def test_fast_step_tracks_the_codelab_step_for_50_steps(passes):
    from bardflow.model.data.splits import encode
    from tests.helpers import play_text

    rows = encode(play_text(64_000), TINY.data.seq_len, 0.9, 0).train[: 50 * 8]
    stream = rows.reshape(50, 8, -1).astype(np.int32)
    model = build_model(TINY.model, TINY.train.init_seed)
    optimizer = nnx.Optimizer(
        model, optax.adamw(TINY.train.learning_rate, weight_decay=TINY.train.weight_decay), wrt=nnx.Param
    )
    graphdef, state = init_state(TINY.model, TINY.train)
    # Compiled as the training stages compile it (in one pass and in several).
    step = make_train_step(graphdef, passes=passes).lower(state, stream[0]).compile(compiler_options=XLA_CPU_TUNED)
    for tokens in stream:
        baseline = codelab_train_step(model, optimizer, tokens)
        state, fast = step(state, tokens)
    assert abs(float(fast) - float(baseline)) < 1e-3
    assert float(fast) < 0.8 * float(np.log(256))  # it trained, so the match means something


# One layer and two (the cache of every layer); learned positions (the cached loop, then
# the sliding one) and rotary ones (the cache wraps around: never a whole-window pass).
@pytest.mark.parametrize(
    "preset, positions", [("tiny", "learned"), ("cpu", "learned"), ("tiny", "rope"), ("cpu", "rope")]
)
def test_generator_matches_the_codelab_loop_greedy_and_sampled(preset, positions):
    cfg = model_config(preset, positions)
    model = build_model(cfg, seed=5)
    window = cfg.max_seq_len
    new = window + 13 - 5  # "KING:" + new > window: slides (or wraps) for 13 bytes
    for temperature in (0.0, 0.8):
        ours = generate(model, "KING:", new, temperature, 42, window)
        if positions == "rope" and cfg.num_layers > 1:
            # Past the window a cache's lower-layer keys carry older context up: the
            # reference is the whole text's forward pass with each position attending to
            # the last ``window`` (sliding-window attention), for every byte.
            theirs = spanned_generate(model, b"KING:", new, temperature, 42, window)
        else:
            # The window recomputed for every byte; a rotary model's at the positions its
            # cache holds (the same function as from 0; the float32 angles then agree too).
            theirs = codelab_generate(model, b"KING:", new, temperature, 42, window, absolute=positions == "rope")
        assert ours == theirs, temperature


def test_a_long_sample_drawn_in_several_calls_is_the_codelab_loop_s(monkeypatch):
    """Past ``SEGMENT`` bytes the sampler continues in a further call with the cache, the keys
    and the window where the last one stopped: the bytes are those of one loop."""
    from bardflow.model.inference import sampling

    cfg = model_config("tiny", "rope")  # one layer: the wrapped cache is the window recomputed
    model = build_model(cfg, seed=5)
    window = cfg.max_seq_len
    monkeypatch.setattr(sampling, "SEGMENT", 1)  # calls of one window's bytes each
    new = 3 * window + 5
    assert generate(model, "KING:", new, 0.8, 42, window) == codelab_generate(
        model, b"KING:", new, 0.8, 42, window, absolute=True
    )


def spanned_generate(model, prompt: bytes, new: int, temperature: float, seed: int, span: int) -> bytes:
    import jax
    import jax.numpy as jnp

    from bench.codelab import host_sampling_loop

    graphdef, state = nnx.split(model)
    logits_at = jax.jit(lambda tokens, at: nnx.merge(graphdef, state)(tokens, span=span)[0][0, at])
    total = len(prompt) + new
    return host_sampling_loop(
        lambda tokens: logits_at(jnp.asarray([tokens + [0] * (total - len(tokens))], jnp.int32), len(tokens) - 1),
        prompt,
        new,
        temperature,
        seed,
    )


@pytest.mark.parametrize("preset", ["tiny", "cpu"])
def test_a_batch_of_samples_is_each_seeds_own_sample_and_the_codelab_batch(preset):
    from bardflow.model.inference.sampling import generate_batch
    from bench.codelab import codelab_generate_batch

    # Learned positions: past the window the codelab batch recomputes it, as the sampler does.
    cfg = model_config(preset, "learned")
    model = build_model(cfg, seed=5)
    window, seeds = cfg.max_seq_len, list(range(3, 11))  # a batch of 8
    new = window + 13 - 5
    batch = generate_batch(model, "KING:", new, 0.8, seeds, window)
    assert batch == [generate(model, "KING:", new, 0.8, seed, window) for seed in seeds]
    assert batch == codelab_generate_batch(model, b"KING:", new, 0.8, seeds, window)
    assert generate_batch(model, "KING:", new, 0.0, seeds[:2], window) == codelab_generate_batch(
        model, b"KING:", new, 0.0, seeds[:2], window
    )
    assert len(set(batch)) == 8  # the seeds really differ


def test_every_timed_round_comes_after_an_untimed_warm_up_call():
    """`python -m bench` times rounds with `alternating`: the first call of each run (where a
    program compiles) is made and dropped before the rounds."""
    from bench.report import alternating

    calls = {"a": 0, "b": 0}

    def run(name):
        def timed() -> float:
            calls[name] += 1
            return 100.0 if calls[name] == 1 else 1.0  # the first call: a compilation's figure

        return timed

    a, b = alternating([run("a"), run("b")], 3)
    assert (a, b) == ([1.0] * 3, [1.0] * 3) and calls == {"a": 4, "b": 4}
