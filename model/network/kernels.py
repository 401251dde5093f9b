"""The model's arithmetic kernels: two hand-written gradients (a dense layer and causal
attention), Pallas's fused causal attention for TPUs, and the attention of a few queries
over cached keys and values.

Each computes exactly what its plain JAX version does (``x @ w + b`` and
``jax.nn.dot_product_attention(..., is_causal=True)``, tested against them) but gives
XLA:CPU a backward pass that it compiles well (the figures: docs/benchmarks.md, "Training step").
"""

from __future__ import annotations

import dataclasses
from functools import lru_cache
from typing import cast

import jax
import jax.numpy as jnp


@jax.custom_vjp
def dense(x, kernel, bias):
    """``x @ kernel + bias`` over the last axis of ``x``."""
    return x @ kernel + bias


def _dense_forward(x, kernel, bias):
    return dense(x, kernel, bias), (x, kernel)


def _dense_backward(saved, grad):
    # Autodiff sums the bias gradient over all rows in a separate reduction, which XLA's
    # CPU backend lowers to a slow strided reduce-window. A column of ones appended to the
    # inputs makes the same sum the last row of the kernel's gradient product.
    x, kernel = saved
    rows = x.reshape(-1, x.shape[-1])
    with_ones = jnp.concatenate([rows, jnp.ones((rows.shape[0], 1), rows.dtype)], axis=1)
    both = with_ones.T @ grad.reshape(-1, grad.shape[-1])
    return grad @ kernel.T, both[:-1].astype(kernel.dtype), both[-1].astype(kernel.dtype)


dense.defvjp(_dense_forward, _dense_backward)


def _block_size(length: int) -> int:
    # Two query blocks skip the quarter of the products that lies above the diagonal;
    # measured, four blocks were slower (more, smaller products).
    return length // 2 if length % 2 == 0 else length


@jax.custom_vjp
def causal_attention(query, key, value):
    """Causal softmax attention of (batch, length, heads, head_dim) inputs."""
    return _attention_forward(query, key, value)[0]


def _attention_forward(query, key, value):
    # Heads first, so every product is a plain batched matrix product. The softmax is
    # taken in float32 whatever the inputs, as jax.nn.dot_product_attention does.
    scale = query.shape[-1] ** -0.5
    q, k, v = (x.transpose(0, 2, 1, 3) for x in (query * scale, key, value))
    length, step = q.shape[2], _block_size(q.shape[2])
    outputs, logsumexps = [], []
    for start in range(0, length, step):
        end = start + step  # queries [start, end) see keys [0, end)
        scores = jnp.matmul(q[:, :, start:end], k[:, :, :end].swapaxes(-1, -2), preferred_element_type=jnp.float32)
        visible = jnp.arange(end)[None, :] <= jnp.arange(start, end)[:, None]
        scores = jnp.where(visible, scores, -jnp.inf)
        peak = scores.max(axis=-1, keepdims=True)
        weights = jnp.exp(scores - peak)
        total = weights.sum(axis=-1, keepdims=True)
        outputs.append((weights.astype(v.dtype) @ v[:, :, :end]) / total.astype(v.dtype))
        logsumexps.append(peak[..., 0] + jnp.log(total[..., 0]))
    out = jnp.concatenate(outputs, axis=2)
    return out.transpose(0, 2, 1, 3), (q, k, v, out, jnp.concatenate(logsumexps, axis=2))


def _attention_backward(saved, grad_out):
    # The backward pass works on transposed (key, query) scores, recomputed from the saved
    # log-sum-exp rather than stored: every product then reads its operands in the layout
    # they are in, where autodiff's version transposes a (length x length) matrix per head.
    q, k, v, out, logsumexp = saved
    scale = q.shape[-1] ** -0.5
    dout = grad_out.transpose(0, 2, 1, 3)
    row_dot = jnp.sum(dout.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)  # (batch, heads, queries)
    length, step = q.shape[2], _block_size(q.shape[2])
    dq = jnp.zeros(q.shape, jnp.float32)
    dks, dvs = [], []
    for start in range(0, length, step):
        end = start + step  # keys [start, end) are seen by queries [start, length)
        q_seen, dout_seen = q[:, :, start:], dout[:, :, start:]
        scores_t = jnp.matmul(k[:, :, start:end], q_seen.swapaxes(-1, -2), preferred_element_type=jnp.float32)
        visible = jnp.arange(start, end)[:, None] <= jnp.arange(start, length)[None, :]
        weights_t = jnp.where(visible, jnp.exp(scores_t - logsumexp[:, :, None, start:]), 0.0)
        dvs.append(weights_t.astype(dout.dtype) @ dout_seen)
        dweights_t = jnp.matmul(v[:, :, start:end], dout_seen.swapaxes(-1, -2), preferred_element_type=jnp.float32)
        dscores_t = (weights_t * (dweights_t - row_dot[:, :, None, start:])).astype(q.dtype)
        dks.append(dscores_t @ q_seen)
        dq = dq.at[:, :, start:].add(
            jnp.matmul(dscores_t.swapaxes(-1, -2), k[:, :, start:end], preferred_element_type=jnp.float32)
        )
    grads = (dq * scale, jnp.concatenate(dks, axis=2), jnp.concatenate(dvs, axis=2))
    return tuple(g.astype(x.dtype).transpose(0, 2, 1, 3) for g, x in zip(grads, (q, k, v), strict=True))


causal_attention.defvjp(_attention_forward, _attention_backward)


def attend(query, keys, values, visible, positions_last: bool = False):
    """Softmax attention of a few queries over given keys and values, heads first: query
    (n, queries, head_dim), keys and values (n, length, head_dim), or (n, head_dim, length)
    when ``positions_last``; ``visible`` (queries, length) marks what each query may see.
    -> (n, queries, head_dim). The sampler's counterpart of ``causal_attention``, with the
    same arithmetic in the same order."""
    cached = "nds" if positions_last else "nsd"
    query = query * jnp.float32(query.shape[-1] ** -0.5)
    scores = jnp.where(visible, jnp.einsum(f"nqd,{cached}->nqs", query, keys), -jnp.inf)
    weights = jnp.exp(scores - scores.max(axis=-1, keepdims=True))
    return jnp.einsum(f"nqs,{cached}->nqd", weights, values) / weights.sum(axis=-1, keepdims=True)


# cuDNN's fused (flash) attention: what it takes. Its scores never reach memory.
# Its head-width limits live with the choice (``model/training/step_settings.py``), which a
# machine without jax reads too.
FUSED_DTYPES = (jnp.bfloat16, jnp.float16)


@lru_cache(maxsize=16)
def fused_attention_problem(length: int, heads: int, head_dim: int, dtype: str) -> str | None:
    """Why cuDNN's fused causal attention does not run here at these shapes, in one line; None
    where it does. Its gradient is compiled and run once on the default device: a cuDNN too old
    for the shapes, or a GPU it does not support, fails there and not in a training step."""
    shape = (1, length, heads, head_dim)

    def loss(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn").astype(jnp.float32).sum()

    try:
        q = jnp.ones(shape, dtype)
        jax.block_until_ready(jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, q, q))
    except Exception as error:  # noqa: BLE001 - any failure of the kernel is a reason to take XLA's path
        first = (str(error).strip().splitlines() or [type(error).__name__])[0]
        return f"cuDNN's fused attention failed on {jax.devices()[0].device_kind}: {first[:200]}"
    return None


# Pallas's fused (flash) attention for TPUs: ``flash`` (jax.experimental.pallas.ops.tpu's
# flash_attention) and ``splash`` (its splash_attention, MaxText's choice: it skips the blocks
# above the diagonal). Like cuDNN's, their scores never reach memory; unlike it they take any
# dtype. Their tiles are 128 lanes wide, so the context must be a multiple of this.
PALLAS_TILE = 128


def pallas_blocks(length: int, largest: int = 512) -> int:
    """The kernels' tile length for a context of ``length``: the largest power of two up to
    ``largest`` that divides it (their defaults, 128, halved the speed of a 1,024-byte context
    on a TPU v5e: docs/tpu-check.md)."""
    block = largest
    while block > PALLAS_TILE and length % block:
        block //= 2
    return block


def pallas_attention(query, key, value, kernel: str, block: int | None = None):
    """Causal softmax attention of (batch, length, heads, head_dim) inputs by a Pallas TPU
    kernel (``kernel``: "flash" or "splash") with ``block``-long tiles (``pallas_blocks``).
    Off a TPU (slowly: for tests) splash runs in its own interpreter, flash only where its
    whole trace, gradient included, is inside ``jax.experimental.pallas.tpu.force_tpu_interpret_mode``."""
    length, head_dim = query.shape[1], query.shape[-1]
    block = block or pallas_blocks(length)
    q, k, v = (x.transpose(0, 2, 1, 3) for x in (query, key, value))  # heads before positions
    if kernel == "splash":
        interpret = jax.devices()[0].platform != "tpu"
        out = jax.vmap(_splash(length, q.shape[1], block, interpret))(q * jnp.asarray(head_dim**-0.5, q.dtype), k, v)
    else:
        from jax.experimental.pallas.ops.tpu import flash_attention as tpu_flash

        sizes = _every_tile(tpu_flash.BlockSizes, block, block_b=1)  # one row at a time
        out = tpu_flash.flash_attention(q, k, v, causal=True, sm_scale=head_dim**-0.5, block_sizes=sizes)
    return cast(jax.Array, out).transpose(0, 2, 1, 3)  # one array: no residuals were asked for


def _every_tile(block_sizes, block: int, **others):
    """A kernel's ``BlockSizes`` dataclass with every tile field (``block_*``) ``block`` long,
    but those ``others`` set."""
    tiles = {field.name: block for field in dataclasses.fields(block_sizes) if field.name.startswith("block_")}
    return block_sizes(**{**tiles, **others})


def _splash(length: int, heads: int, block: int, interpret: bool):
    """Splash attention's kernel for one row. Made anew at each trace: it holds arrays of its
    mask's blocks, which a kernel kept from another trace would carry in as that trace's."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks

    # The fused backward kernel computes dq with dk and dv: it takes no tiles of its own for it.
    sizes = _every_tile(splash.BlockSizes, block, block_q_dq=None, block_kv_dq=None, use_fused_bwd_kernel=True)
    mask = masks.MultiHeadMask([masks.CausalMask((length, length)) for _ in range(heads)])
    return splash.make_splash_mha(mask, block_sizes=sizes, head_shards=1, q_seq_shards=1, interpret=interpret)
