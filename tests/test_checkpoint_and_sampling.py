import jax.numpy as jnp
import numpy as np
import pytest

from model.checkpoint import CheckpointError, load_config, load_model, max_logit_diff, params_digest, save_model
from model.config import build_config
from model.sampling import PromptError, as_text, generate, last_position_logits
from model.transformer import build_model

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
    kernel = restored.blocks[0].fc_up.kernel
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


def naive_generate(model, prompt: bytes, n: int, window: int) -> bytes:
    """The codelab's loop, greedy: pad to the window, full forward per byte, host loop."""
    tokens = list(prompt)
    for _ in range(n):
        context = tokens[-window:]
        logits = model(jnp.array([context + [0] * (window - len(context))], jnp.int32))
        tokens.append(int(jnp.argmax(logits[0, len(context) - 1])))
    return bytes(tokens)


@pytest.mark.parametrize("prompt", ["ROMEO:", "x" * 40])  # the second slides past the window
def test_compiled_greedy_sampling_matches_the_plain_loop(prompt):
    model = build_model(CFG, seed=3)
    fast = generate(model, prompt, 30, temperature=0.0, seed=0, max_seq_len=CFG.max_seq_len)
    slow = naive_generate(model, prompt.encode(), 30, CFG.max_seq_len)
    assert fast == slow


def test_the_sliding_forward_is_the_full_forward_at_the_last_position():
    model = build_model(CFG, seed=3)
    full = np.asarray(model(jnp.asarray(PROBE))[:, -1])
    np.testing.assert_allclose(np.asarray(last_position_logits(model, jnp.asarray(PROBE))), full, atol=1e-5)
    assert np.abs(full).max() > 0.1  # the logits are not all near zero, so the match means something


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
