"""The hand-written gradients give what autodiff of the plain formulas gives."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bardflow.model.network import decode_kernels
from bardflow.model.network.kernels import attend, causal_attention, dense


def value_and_grads(fn, *args):
    weights = jax.random.normal(jax.random.key(9), jax.eval_shape(fn, *args).shape)  # a non-uniform cotangent
    weighted = lambda *a: jnp.sum(fn(*a).astype(jnp.float32) * weights)  # noqa: E731 - one line, read as math
    return jax.value_and_grad(weighted, argnums=tuple(range(len(args))))(*args)


def float32_tolerance(on_cpu: float) -> float:
    """A float32 comparison's tolerance here: a TPU's float32 exp, tanh and erf (in the softmax
    and gelu, and their gradients) keep four to five digits even at 'highest' precision (the
    splash kernel's gradients against XLA's on a chip, whose largest difference moved from run
    to run: docs/tpu-check.md); a CPU's keep six."""
    return on_cpu if jax.default_backend() == "cpu" else 3e-4


def assert_close(got, want, tolerance):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("dtype, tolerance", [(jnp.float32, 1e-5), (jnp.bfloat16, 5e-2)])
def test_dense_matches_autodiff_of_x_times_kernel_plus_bias(dtype, tolerance):
    keys = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(keys[0], (3, 7, 16), dtype)
    kernel = jax.random.normal(keys[1], (16, 24), dtype)
    bias = jax.random.normal(keys[2], (24,), dtype)
    assert_close(
        jax.jit(lambda *a: value_and_grads(dense, *a))(x, kernel, bias),
        jax.jit(lambda *a: value_and_grads(lambda x, k, b: x @ k + b, *a))(x, kernel, bias),
        tolerance,
    )


@pytest.mark.parametrize("length", [16, 9])  # two query blocks, and one
@pytest.mark.parametrize("dtype, tolerance", [(jnp.float32, 2e-5), (jnp.bfloat16, 5e-2)])
def test_causal_attention_matches_autodiff_of_dot_product_attention(length, dtype, tolerance):
    q, k, v = (jax.random.normal(key, (2, length, 3, 8), dtype) for key in jax.random.split(jax.random.key(1), 3))
    reference = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
    assert_close(
        jax.jit(lambda *a: value_and_grads(causal_attention, *a))(q, k, v),
        jax.jit(lambda *a: value_and_grads(reference, *a))(q, k, v),
        tolerance,
    )


def test_causal_attention_never_looks_ahead():
    q, k, v = (jax.random.normal(key, (1, 12, 2, 4)) for key in jax.random.split(jax.random.key(2), 3))
    changed = v.at[:, 7:].set(0.0)  # later values change; outputs at positions before 7 must not
    attention = jax.jit(causal_attention)
    np.testing.assert_array_equal(attention(q, k, v)[:, :7], attention(q, k, changed)[:, :7])
    assert not np.allclose(attention(q, k, v)[:, 7:], attention(q, k, changed)[:, 7:])


def test_the_model_computes_the_same_with_either_kernel():
    """``model.attention`` and ``model.dense``: the hand-written gradients (CPU's ``auto``) and
    XLA's own (``auto`` elsewhere) give the same logits, loss and gradients."""
    from flax import nnx

    from bardflow.config.settings import build_config
    from bardflow.model.network.transformer import build_model
    from bardflow.model.training.step import next_byte_loss

    base = build_config("tiny").model.model_copy(update={"num_layers": 2})
    tokens = jax.random.randint(jax.random.key(3), (4, base.max_seq_len), 0, 256)
    results = {}
    for kernel in ("custom", "xla"):
        model = build_model(base.model_copy(update={"attention": kernel, "dense": kernel}), seed=0)
        blocks = model.blocks
        assert blocks[0].attn.custom is blocks[1].mlp.up.custom is (kernel == "custom")
        # Compiled whole, as training runs it (op by op, each operation compiles on its own).
        loss, grads = nnx.jit(nnx.value_and_grad(next_byte_loss))(model, tokens)
        results[kernel] = (nnx.jit(lambda m, t: m(t)[0])(model, tokens), loss, nnx.to_pure_dict(grads))
    assert_close(results["custom"], results["xla"], float32_tolerance(1e-5))
    # cuDNN's fused attention serves bfloat16 on a GPU; a float32 pass (an evaluation) of a
    # model built for it takes XLA's attention, the same function.
    fused = build_model(base.model_copy(update={"attention": "cudnn"}), seed=0)
    assert fused.blocks[0].attn.fused
    np.testing.assert_array_equal(nnx.jit(lambda m, t: m(t)[0])(fused, tokens), results["xla"][0])
    # The model never asks JAX for the platform: left to auto it takes the plain operations,
    # and a training run builds it from the settings resolved for this CPU (the hand-written ones).
    assert not build_model(base, seed=0).blocks[0].attn.custom
    from bardflow.model.training.step_settings import resolve

    resolved = resolve(base, build_config("tiny").train, base.max_seq_len, "cpu").model(base)
    assert build_model(resolved, seed=0).blocks[0].attn.custom


@pytest.mark.parametrize("kernel", ["splash", "flash"])
def test_pallas_tpu_attention_matches_autodiff_of_dot_product_attention(kernel):
    """Pallas's TPU kernels, run here by Pallas's interpreter: the values and gradients of XLA's
    causal attention, over two 128-long tiles (one tile sees the other, one does not)."""
    from contextlib import nullcontext

    from jax.experimental.pallas import tpu as pltpu

    from bardflow.model.network.kernels import pallas_attention

    q, k, v = (jax.random.normal(key, (1, 256, 2, 64)) for key in jax.random.split(jax.random.key(4), 3))
    reference = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
    interpreted = (
        pltpu.force_tpu_interpret_mode() if kernel == "flash" and jax.default_backend() != "tpu" else nullcontext()
    )
    with interpreted:
        got = jax.jit(lambda *a: value_and_grads(lambda q, k, v: pallas_attention(q, k, v, kernel, 128), *a))(q, k, v)
    assert_close(got, jax.jit(lambda *a: value_and_grads(reference, *a))(q, k, v), float32_tolerance(2e-5))


def test_pallas_blocks_are_the_largest_tile_that_divides_the_context():
    from bardflow.model.network.kernels import pallas_blocks

    assert [pallas_blocks(n) for n in (128, 256, 384, 1024, 1536)] == [128, 256, 128, 512, 512]
    assert pallas_blocks(1024, largest=1024) == 1024


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("slots", [8, 3])  # eight slots a grid step, and one
def test_the_decode_kernel_stores_each_key_in_place_and_attends_as_the_sampler_s_attention(slots, dtype):
    """Each slot's new key and value land at its own position of the cache all slots share and
    nowhere else: not in the slots past the call's, and not at all for a slot whose position
    lies past the part read (a slot no sequence holds). Each slot's query over its cache up to
    its own position gives ``attend``'s result to float32 rounding (one-pass bfloat16 products
    of each float32 value's three parts). Mapped over the slots with the cache unmapped, as the
    engine calls it, the one-slot kernel gives the same."""
    heads, head_dim, window, fill, shared = 2, 16, 64, 32, 10
    width = heads * head_dim
    keys = jax.random.split(jax.random.key(3), 6)
    cache, values = (jax.random.normal(k, (shared, window, width)).astype(dtype) for k in keys[:2])
    new_keys, new_values, query = (jax.random.normal(k, (slots, 1, width)) for k in keys[2:5])
    at = (jnp.arange(slots, dtype=jnp.int32) * 5 % fill).at[-1].set(fill + 3)
    upto = jnp.minimum(at, fill - 1)
    slot = jnp.arange(slots, dtype=jnp.int32)

    mixed, *stored = decode_kernels.attend_all(
        query, new_keys, new_values, cache, values, at, upto, slot, fill, head_dim
    )
    kept = np.asarray(at < fill)
    for got, old, new in zip(stored, (cache, values), (new_keys, new_values), strict=True):
        np.testing.assert_array_equal(got, old.at[slot[kept], at[kept]].set(new[kept, 0].astype(dtype)))
    by_heads = lambda x: x.reshape(x.shape[0], heads, head_dim).swapaxes(0, 1).astype(jnp.float32)  # noqa: E731 - (heads, positions, head_dim)
    for one in range(slots):
        visible = jnp.arange(fill)[None, :] <= upto[one]
        want = attend(by_heads(query[one]), *(by_heads(half[one, :fill]) for half in stored), visible)
        np.testing.assert_allclose(mixed[one, 0], want.swapaxes(0, 1).reshape(width), rtol=2e-6, atol=2e-6)

    attend_one = functools.partial(decode_kernels.attend, fill=fill, head_dim=head_dim)
    rows = (query[:, 0], new_keys[:, 0], new_values[:, 0])
    mapped = jax.vmap(attend_one, (0, 0, 0, None, None, 0, 0, 0), (0, None, None))(*rows, cache, values, at, upto, slot)
    np.testing.assert_allclose(mapped[0], mixed[:, 0], rtol=1e-6, atol=1e-6)
    for got, want in zip(mapped[1:], stored, strict=True):
        np.testing.assert_array_equal(got, want)
    one = slots - 2  # one slot alone, not the first
    alone, *written = attend_one(*(row[one] for row in rows), cache, values, at[one], upto[one], slot[one])
    np.testing.assert_allclose(alone, mixed[one, 0], rtol=1e-6, atol=1e-6)
    for got, old, new in zip(written, (cache, values), (new_keys, new_values), strict=True):
        np.testing.assert_array_equal(got, old.at[one, at[one]].set(new[one, 0].astype(dtype)))
