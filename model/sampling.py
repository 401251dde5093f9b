"""Sampling bytes from a trained model, with the whole loop compiled.

The context is a fixed ``max_seq_len`` buffer: while it has room the new byte is
appended, once full it slides left by one. That is exactly "condition on the last
``max_seq_len`` bytes", with one compilation for any prompt length.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from model.transformer import Transformer


class PromptError(ValueError):
    """A prompt or sampling setting cannot be used."""


def _one_per_key(loop):
    """``loop`` over a batch of keys: row ``i`` of the result is what ``loop`` makes from
    ``keys[i]`` alone, so a batch is as reproducible as its single samples."""

    def batched(graphdef, params, context, length, temperature, keys, *rest):
        row = partial(loop, graphdef, params)
        if keys.shape[0] == 1:
            # No vmap for a single sample: vmapped, XLA copies every KV cache on every byte.
            one = row(context[0] if context.ndim == 2 else context, length, temperature, keys[0], *rest)
            return jax.tree.map(lambda x: x[None], one)
        per_row_context = 0 if context.ndim == 2 else None  # rows part ways after the first loop
        in_axes = (per_row_context, None, None, 0) + (None,) * len(rest)
        return jax.vmap(row, in_axes=in_axes)(context, length, temperature, keys, *rest)

    return batched


def _sample_one(graphdef, params, context, length, temperature, key, count, max_new):
    model = nnx.merge(graphdef, params)
    window = context.shape[0]

    def one_byte(i, carry):
        context, length, key, out = carry
        logits = model(context[None])[0, length - 1]
        key, sub = jax.random.split(key)
        sampled = jax.random.categorical(sub, logits / jnp.maximum(temperature, 1e-6))
        token = jnp.where(temperature > 0, sampled, jnp.argmax(logits)).astype(context.dtype)
        full = length == window
        slid = jnp.roll(context, -1).at[window - 1].set(token)
        grown = context.at[jnp.minimum(length, window - 1)].set(token)
        context = jnp.where(full, slid, grown)
        return context, jnp.minimum(length + 1, window), key, out.at[i].set(token)

    out = jnp.zeros((max_new,), context.dtype)  # static size; ``count`` of it is filled
    carry = (context, length, key, out)
    return jax.lax.fori_loop(0, count, one_byte, carry)[3]


def _cached_one(graphdef, params, context, length, temperature, key, count):
    """Feeds the context one byte at a time through the blocks, keeping every layer's keys
    and values, then samples ``count`` bytes at one position each: the work per byte is one
    token's, not the whole window's. Requires ``length + count <= window``. ``length`` and
    ``count`` are traced, so one compilation serves every prompt."""
    model = nnx.merge(graphdef, params)
    window = context.shape[0]
    blocks = list(model.blocks)
    heads = blocks[0].attn.num_heads
    head_dim = blocks[0].attn.head_dim
    # One (keys, values) pair per layer, each its own loop variable updated in place, in
    # the heads-first layout the attention products read (no per-byte transposes).
    empty = jnp.zeros((heads, window, head_dim), jnp.float32)
    caches = tuple((empty, empty) for _ in blocks)
    visible_from = jnp.arange(window)

    def attend(q, keys, values, pos):
        # jax.nn.dot_product_attention's own arithmetic, for one query over the cache.
        scores = jnp.einsum("hd,hsd->hs", q, keys) * jnp.float32(1 / np.sqrt(head_dim))
        scores = jnp.where(visible_from <= pos, scores, jnp.finfo(jnp.float32).min)
        return jnp.einsum("hs,hsd->hd", jax.nn.softmax(scores), values)

    def position(pos, carry):
        context, caches, key, out = carry
        x = model.token_embed(context[pos][None, None]) + model.pos_embed(pos[None])[None]
        updated = []
        for block, (keys, values) in zip(blocks, caches):
            h = block.ln1(x)
            q, k, v = (part(h)[0, 0] for part in (block.attn.query, block.attn.key, block.attn.value))
            keys = jax.lax.dynamic_update_slice(keys, k[:, None], (0, pos, 0))
            values = jax.lax.dynamic_update_slice(values, v[:, None], (0, pos, 0))
            updated.append((keys, values))
            x = x + block.attn.out(attend(q, keys, values, pos)[None, None])
            x = x + block.fc_down(jax.nn.gelu(block.fc_up(block.ln2(x))))
        logits = model.lm_head(model.final_norm(x))[0, 0]
        sampling = pos >= length - 1  # the prompt's own bytes are only read, not sampled
        next_key, sub = jax.random.split(key)
        sampled = jax.random.categorical(sub, logits / jnp.maximum(temperature, 1e-6))
        token = jnp.where(temperature > 0, sampled, jnp.argmax(logits)).astype(context.dtype)
        key = jnp.where(sampling, next_key, key)  # the same key sequence as the plain loop
        at = jnp.minimum(pos + 1, window - 1)
        context = context.at[at].set(jnp.where(sampling, token, context[at]))
        slot = jnp.maximum(pos - (length - 1), 0)
        out = out.at[slot].set(jnp.where(sampling, token, out[slot]))
        return context, tuple(updated), key, out

    out = jnp.zeros((window,), context.dtype)  # the first ``count`` entries get filled
    carry = jax.lax.fori_loop(0, length - 1 + count, position, (context, caches, key, out))
    return carry[0], carry[2], carry[3]


_sample_loop = jax.jit(_one_per_key(_sample_one), static_argnums=(0, 7))  # graphdef, max_new
_cached_loop = jax.jit(_one_per_key(_cached_one), static_argnums=0)  # graphdef


def generate(
    model: Transformer,
    prompt: str,
    max_new_bytes: int,
    temperature: float,
    seed: int,
    max_seq_len: int,
) -> bytes:
    """The prompt's bytes followed by ``max_new_bytes`` sampled ones; temperature 0 is greedy."""
    return generate_batch(model, prompt, max_new_bytes, temperature, [seed], max_seq_len)[0]


def generate_batch(
    model: Transformer,
    prompt: str,
    max_new_bytes: int,
    temperature: float,
    seeds: list[int],
    max_seq_len: int,
) -> list[bytes]:
    """One sample per seed, all in one batch; sample ``i`` is exactly ``generate(..., seeds[i])``."""
    encoded = prompt.encode("utf-8")
    if not encoded:
        raise PromptError("the prompt is empty; give at least one character of text")
    if temperature < 0:
        raise PromptError(f"temperature {temperature} is negative; use 0 (greedy) or more")
    kept = encoded[-max_seq_len:]  # a longer prompt keeps only what fits the context
    context = np.zeros((max_seq_len,), np.int32)
    context[: len(kept)] = np.frombuffer(kept, np.uint8)
    graphdef, params = nnx.split(model)
    if not seeds:
        raise PromptError("no seeds given; pass one seed per sample")
    key = jnp.stack([jax.random.key(seed) for seed in seeds])
    length, temperature = jnp.int32(len(kept)), jnp.float32(temperature)
    # While the context has room, each new byte costs one position (a KV cache); once it
    # is full it slides, every position shifts, and each byte needs a whole forward pass.
    cached = min(max_new_bytes, max_seq_len - len(kept))
    pieces = []
    window = jnp.asarray(context)
    if cached > 0:
        window, key, new = _cached_loop(graphdef, params, window, length, temperature, key, jnp.int32(cached))
        pieces.append(np.asarray(new)[:, :cached])
        length = jnp.int32(len(kept) + cached)
    if max_new_bytes > cached:
        rest = max_new_bytes - cached
        new = _sample_loop(graphdef, params, window, length, temperature, key, jnp.int32(rest), max_new_bytes)
        pieces.append(np.asarray(new)[:, :rest])
    rows = np.concatenate(pieces, axis=1).astype(np.uint8)
    return [encoded + row.tobytes() for row in rows]


def as_text(data: bytes) -> str:
    return data.decode("utf-8", errors="replace")
