import jax.numpy as jnp
import numpy as np
import pytest

from bardflow.config.settings import build_config
from bardflow.model.inference.sampling import PromptError, as_text, generate
from bardflow.model.network.transformer import build_model
from bardflow.model.training.checkpoint import (
    CheckpointError,
    load_config,
    load_model,
    max_logit_diff,
    params_digest,
    save_model,
)
from tests.helpers import jitted

CFG = build_config("tiny").model
PROBE = (np.arange(4 * CFG.max_seq_len).reshape(4, -1) * 7 % 256).astype(np.int32)


def test_restore_into_a_fresh_model_gives_identical_logits(tmp_path):
    trained = build_model(CFG, seed=1)
    save_model(tmp_path / "ckpt", trained, CFG)
    assert load_config(tmp_path / "ckpt") == CFG
    restored = load_model(tmp_path / "ckpt", init_seed=99)
    assert max_logit_diff(trained, restored, PROBE) == 0.0
    assert params_digest(restored) == params_digest(trained)
    assert max_logit_diff(trained, build_model(CFG, seed=99), PROBE) > 1e-3  # the restore mattered


def test_one_perturbed_parameter_is_detected(tmp_path):
    trained = build_model(CFG, seed=1)
    save_model(tmp_path / "ckpt", trained, CFG)
    restored = load_model(tmp_path / "ckpt")
    kernel = restored.blocks[0].mlp.up.kernel
    kernel.set_value(kernel.get_value().at[0, 0].add(1e-2))
    assert max_logit_diff(trained, restored, PROBE) > 1e-5
    assert params_digest(restored) != params_digest(trained)


def test_a_damaged_checkpoint_is_a_clear_error(tmp_path):
    save_model(tmp_path / "ckpt", build_model(CFG, seed=1), CFG)
    for file in (tmp_path / "ckpt" / "params").rglob("*"):
        if file.is_file() and file.stat().st_size > 100:
            file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])
    with pytest.raises(CheckpointError, match="cannot restore"):
        load_model(tmp_path / "ckpt")


SHAPES = [("tiny", "learned"), ("cpu", "learned"), ("cpu", "rope")]


@pytest.mark.parametrize("preset, positions", SHAPES)
def test_the_last_position_forward_is_the_full_forward_at_the_last_position(preset, positions):
    cfg = build_config(preset).model.model_copy(update={"positions": positions})
    model = jitted(build_model(cfg, seed=3))
    probe = (np.arange(4 * cfg.max_seq_len).reshape(4, -1) * 7 % 256).astype(np.int32)
    full = np.asarray(model(jnp.asarray(probe))[0][:, -1])
    last, cache = model(jnp.asarray(probe), last_only=True)
    assert cache is None and last.shape == (4, 1, cfg.vocab_size)
    np.testing.assert_allclose(np.asarray(last[:, 0]), full, atol=1e-5)
    assert np.abs(full).max() > 0.1  # the logits are not all near zero, so the match means something


@pytest.mark.parametrize("preset, positions", SHAPES)
def test_feeding_one_byte_at_a_time_through_the_cache_is_the_full_forward(preset, positions):
    """Every layer's cache is written and read: with two layers, the lower one's cached keys
    feed the upper one's."""
    cfg = build_config(preset).model.model_copy(update={"positions": positions})
    built = build_model(cfg, seed=3)
    model, length = jitted(built), 20
    tokens = (np.arange(2 * length).reshape(2, -1) * 11 % 256).astype(np.int32)  # sliced on the host
    full = np.asarray(model(tokens)[0])
    cache = built.init_cache(2, cfg.max_seq_len)
    for pos in range(length):
        logits, cache = model(tokens[:, pos : pos + 1], np.asarray([pos], np.int32), cache)
        np.testing.assert_allclose(np.asarray(logits[:, 0]), full[:, pos], atol=1e-5, err_msg=f"position {pos}")
    assert len(cache) == cfg.num_layers and all(np.abs(np.asarray(layer.keys[:, :length])).max() > 0 for layer in cache)


def test_sampling_is_reproducible_per_seed():
    model = build_model(CFG, seed=3)
    a, b, c = (generate(model, "To be", 40, 1.0, seed, CFG.max_seq_len) for seed in (7, 7, 8))
    assert a == b and a != c
    assert a.startswith(b"To be") and len(a) == len(b"To be") + 40
    assert isinstance(as_text(b"\xff\xfeok"), str)  # invalid UTF-8 is replaced, never raised


@pytest.mark.parametrize("prompt, temperature, match", [("", 0.8, "prompt is empty"), ("hi", -1.0, "negative")])
def test_bad_prompts_are_refused(prompt, temperature, match):
    with pytest.raises(PromptError, match=match):
        generate(build_model(CFG, seed=3), prompt, 5, temperature, 0, CFG.max_seq_len)


def test_with_rotary_positions_the_cache_wraps_and_still_equals_the_window_recomputed():
    """One layer: past the window, the newest key replaces the oldest, and each position's
    logits equal a forward pass over the window that ends there, positions from 0."""
    cfg = build_config("tiny").model.model_copy(update={"positions": "rope"})
    built, window, length = build_model(cfg, seed=3), cfg.max_seq_len, cfg.max_seq_len * 3
    model = jitted(built)
    tokens = (np.arange(2 * length).reshape(2, -1) * 11 % 256).astype(np.int32)  # sliced on the host
    cache = built.init_cache(2, window)
    for pos in range(length):
        logits, cache = model(tokens[:, pos : pos + 1], np.asarray([pos], np.int32), cache)
        if pos in (window - 1, window, 2 * window + 5, length - 1):
            recomputed = model(tokens[:, max(0, pos - window + 1) : pos + 1])[0][:, -1]
            np.testing.assert_allclose(np.asarray(logits[:, 0]), np.asarray(recomputed), atol=2e-5, err_msg=f"{pos}")


def test_with_more_layers_the_wrapped_cache_is_sliding_window_attention():
    """Two layers: the cache computes the whole text's forward pass with every position
    attending to its last ``window`` (the lower layer's keys carry older context up)."""
    cfg = build_config("cpu").model.model_copy(update={"positions": "rope", "max_seq_len": 16, "zero_init": False})
    built, window, length = build_model(cfg, seed=3), 16, 50
    model = jitted(built)
    tokens = (np.arange(length)[None] * 11 % 256).astype(np.int32)  # sliced on the host
    spanned = np.asarray(model(tokens, span=window)[0][0])
    cache = built.init_cache(1, window)
    for pos in range(length):
        logits, cache = model(tokens[:, pos : pos + 1], np.asarray([pos], np.int32), cache)
        np.testing.assert_allclose(np.asarray(logits[0, 0]), spanned[pos], atol=2e-5, err_msg=f"{pos}")
    recomputed = np.asarray(model(tokens[:, -window:])[0][0, -1])
    assert np.abs(spanned[-1] - recomputed).max() > 1e-3  # not the recomputed window
