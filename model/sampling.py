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
def _sample_loop(graphdef, params, context, length, temperature, key, max_new):
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

    out = jnp.zeros((max_new,), context.dtype)
    carry = (context, length, key, out)
    return jax.lax.fori_loop(0, max_new, one_byte, carry)[3]


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
    new = _sample_loop(
        graphdef,
        params,
        jnp.asarray(context),
        jnp.int32(len(kept)),
        jnp.float32(temperature),
        jax.random.key(seed),
        max_new_bytes,
    )
    return encoded + bytes(np.asarray(new, dtype=np.uint8))


def as_text(data: bytes) -> str:
    return data.decode("utf-8", errors="replace")
