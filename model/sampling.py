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


@partial(jax.jit, static_argnames=("graphdef", "max_new"))
def _sample_loop(graphdef, params, context, length, temperature, key, count, max_new):
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


@partial(jax.jit, static_argnames=("graphdef",))
def _cached_loop(graphdef, params, context, length, temperature, key, count):
    """Feeds the context one byte at a time through the blocks, keeping every layer's keys
    and values, then samples ``count`` bytes at one position each: the work per byte is one
    token's, not the whole window's. Requires ``length + count <= window``. ``length`` and
    ``count`` are traced, so one compilation serves every prompt."""
    model = nnx.merge(graphdef, params)
    window = context.shape[0]
    blocks = list(model.blocks)
    heads = blocks[0].attn.num_heads
    head_dim = blocks[0].attn.head_dim
    cache = jnp.zeros((len(blocks), 2, window, heads, head_dim), jnp.float32)
    visible_from = jnp.arange(window)

    def position(pos, carry):
        context, cache, key, out = carry
        x = model.token_embed(context[pos][None, None]) + model.pos_embed(pos[None])[None]
        for layer, block in enumerate(blocks):
            h = block.ln1(x)
            q, k, v = block.attn.query(h), block.attn.key(h), block.attn.value(h)
            cache = cache.at[layer, 0, pos].set(k[0, 0]).at[layer, 1, pos].set(v[0, 0])
            mask = (visible_from <= pos)[None, None, None, :]
            att = jax.nn.dot_product_attention(q, cache[layer, 0][None], cache[layer, 1][None], mask=mask)
            x = x + block.attn.out(att)
            x = x + block.fc_down(jax.nn.gelu(block.fc_up(block.ln2(x))))
        logits = model.lm_head(model.final_norm(x))[0, 0]
        sampling = pos >= length - 1  # the prompt's own bytes are only read, not sampled
        next_key, sub = jax.random.split(key)
        sampled = jax.random.categorical(sub, logits / jnp.maximum(temperature, 1e-6))
        token = jnp.where(temperature > 0, sampled, jnp.argmax(logits)).astype(context.dtype)
        key = jnp.where(sampling, next_key, key)  # the same key sequence as the plain loop
        context = jnp.where(sampling, context.at[jnp.minimum(pos + 1, window - 1)].set(token), context)
        out = jnp.where(sampling, out.at[pos - (length - 1)].set(token), out)
        return context, cache, key, out

    out = jnp.zeros((window,), context.dtype)  # the first ``count`` entries get filled
    carry = jax.lax.fori_loop(0, length - 1 + count, position, (context, cache, key, out))
    return carry[0], carry[2], carry[3]


def generate(
    model: Transformer,
    prompt: str,
    max_new_bytes: int,
    temperature: float,
    seed: int,
    max_seq_len: int,
) -> bytes:
    """The prompt's bytes followed by ``max_new_bytes`` sampled ones; temperature 0 is greedy."""
    encoded = prompt.encode("utf-8")
    if not encoded:
        raise PromptError("the prompt is empty; give at least one character of text")
    if temperature < 0:
        raise PromptError(f"temperature {temperature} is negative; use 0 (greedy) or more")
    kept = encoded[-max_seq_len:]  # a longer prompt keeps only what fits the context
    context = np.zeros((max_seq_len,), np.int32)
    context[: len(kept)] = np.frombuffer(kept, np.uint8)
    graphdef, params = nnx.split(model)
    length, key, temperature = jnp.int32(len(kept)), jax.random.key(seed), jnp.float32(temperature)
    # While the context has room, each new byte costs one position (a KV cache); once it
    # is full it slides, every position shifts, and each byte needs a whole forward pass.
    cached = min(max_new_bytes, max_seq_len - len(kept))
    pieces = []
    window = jnp.asarray(context)
    if cached > 0:
        window, key, new = _cached_loop(graphdef, params, window, length, temperature, key, jnp.int32(cached))
        pieces.append(np.asarray(new)[:cached])
        length = jnp.int32(len(kept) + cached)
    if max_new_bytes > cached:
        rest = max_new_bytes - cached
        new = _sample_loop(graphdef, params, window, length, temperature, key, jnp.int32(rest), max_new_bytes)
        pieces.append(np.asarray(new)[:rest])
    return encoded + b"".join(bytes(np.asarray(p, dtype=np.uint8)) for p in pieces)


def as_text(data: bytes) -> str:
    return data.decode("utf-8", errors="replace")
