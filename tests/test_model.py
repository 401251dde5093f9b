import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from bardflow.config.settings import ModelConfig, build_config
from bardflow.model.network.transformer import build_model, count_params
from tests.helpers import jitted


def test_codelab_config_has_the_codelab_parameter_count():
    # The shapes alone (nothing drawn, nothing compiled): the count is the same on every device.
    abstract = nnx.eval_shape(lambda: build_model(build_config("codelab").model, seed=0))
    assert count_params(abstract) == 3_356_160


@pytest.mark.parametrize("preset", ["tiny", "cpu"])
def test_logits_have_one_distribution_per_position(preset):
    cfg = build_config(preset).model
    logits, cache = jitted(build_model(cfg, seed=0))(jnp.zeros((3, 16), jnp.int32))
    assert cache is None
    assert logits.shape == (3, 16, cfg.vocab_size)
    assert bool(jnp.all(jnp.isfinite(logits)))


def test_changing_a_later_token_never_changes_earlier_logits():
    cfg = ModelConfig(d_model=32, num_heads=2, ffn_dim=64, num_layers=2, max_seq_len=24)
    model = jitted(build_model(cfg, seed=0))
    tokens = jax.random.randint(jax.random.key(0), (2, 24), 0, 256)
    base = np.asarray(model(tokens)[0])
    for position in (5, 17, 23):
        changed = tokens.at[:, position].set((tokens[:, position] + 1) % 256)
        out = np.asarray(model(changed)[0])
        np.testing.assert_array_equal(out[:, :position], base[:, :position])
        assert np.abs(out[:, position:] - base[:, position:]).max() > 0  # the change is seen later


def test_different_seeds_give_different_models():
    cfg = build_config("tiny").model
    tokens = jnp.arange(8)[None]
    assert not np.allclose(jitted(build_model(cfg, 0))(tokens)[0], jitted(build_model(cfg, 1))(tokens)[0])


REFINEMENTS = [{"mlp": "relu2"}, {"qk_norm": True}, {"zero_init": True}, {"logit_cap": 2.0}]


@pytest.mark.parametrize("refinement", REFINEMENTS, ids=lambda r: next(iter(r)))
def test_each_refinement_changes_what_the_model_computes_and_keeps_it_causal(refinement):
    cfg = ModelConfig(d_model=32, num_heads=2, ffn_dim=64, num_layers=2, max_seq_len=24, positions="rope")
    tokens = jax.random.randint(jax.random.key(0), (2, 24), 0, 256)
    plain = np.asarray(jitted(build_model(cfg, seed=0))(tokens)[0])
    model = jitted(build_model(cfg.model_copy(update=refinement), seed=0))
    refined = np.asarray(model(tokens)[0])
    assert np.abs(refined - plain).max() > 1e-3
    changed = np.asarray(model(tokens.at[:, 9].set((tokens[:, 9] + 1) % 256))[0])
    np.testing.assert_array_equal(changed[:, :9], refined[:, :9])
    if "logit_cap" in refinement:
        assert np.abs(refined).max() < 2.0 and np.abs(plain).max() > 2.0  # capped, where the plain model is not
    if "zero_init" in refinement:
        # Every block starts as the identity: a position's logits depend on its own byte alone.
        assert np.abs(changed[:, 10:] - refined[:, 10:]).max() == 0
    else:
        assert np.abs(changed[:, 10:] - refined[:, 10:]).max() > 0
