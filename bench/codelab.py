"""The codelab's way of doing things, kept only as the baseline the benchmark measures
against: ``@nnx.jit`` over the module objects every step, and a host loop that pads the
context and runs a full forward pass for every new byte."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx


@nnx.jit
def codelab_train_step(model, optimizer, tokens):
    def loss_fn(model):
        logits, _ = model(tokens)
        return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], tokens[:, 1:]).mean()

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss


@jax.jit
def _logits(graphdef, state, tokens, first=0):
    return nnx.merge(graphdef, state)(tokens, first + jnp.arange(tokens.shape[1]))[0]


def host_sampling_loop(last_logits, prompt: bytes, max_new: int, temperature: float, seed: int) -> bytes:
    """The codelab's loop: one forward pass per new byte, ``last_logits(tokens)`` giving the
    logits that follow ``tokens``; greedy at temperature 0, else a fresh key split per byte."""
    tokens = list(prompt)
    key = jax.random.key(seed)
    for _ in range(max_new):
        last = last_logits(tokens)
        if temperature <= 0:
            tokens.append(int(jnp.argmax(last)))
        else:
            key, sub = jax.random.split(key)
            tokens.append(int(jax.random.categorical(sub, last / temperature)))
    return bytes(tokens)


def codelab_generate(
    model, prompt: bytes, max_new: int, temperature: float, seed: int, window: int, absolute: bool = False
) -> bytes:
    """``absolute``: the window's positions are where its bytes sit in the whole text, not
    0.. (for a rotary model the same function, computed with the sampler's angles)."""
    graphdef, state = nnx.split(model)

    def last_logits(tokens):
        context = tokens[-window:]
        first = len(tokens) - len(context) if absolute else 0
        logits = _logits(graphdef, state, jnp.array([context + [0] * (window - len(context))], jnp.int32), first)
        return logits[0, len(context) - 1]

    return host_sampling_loop(last_logits, prompt, max_new, temperature, seed)


def codelab_generate_batch(
    model, prompt: bytes, max_new: int, temperature: float, seeds: list[int], window: int
) -> list[bytes]:
    """The same host loop over a batch: one full forward pass of every row per new byte,
    row ``i`` drawing from its own key exactly as ``codelab_generate`` with ``seeds[i]``."""
    graphdef, state = nnx.split(model)
    rows = [list(prompt) for _ in seeds]
    keys = jnp.stack([jax.random.key(seed) for seed in seeds])
    for _ in range(max_new):
        length = min(len(rows[0]), window)
        context = [row[-window:] + [0] * (window - length) for row in rows]
        last = _logits(graphdef, state, jnp.array(context, jnp.int32))[:, length - 1]
        if temperature <= 0:
            new = jnp.argmax(last, axis=-1)
        else:
            pairs = jax.vmap(jax.random.split)(keys)
            keys, subs = pairs[:, 0], pairs[:, 1]
            new = jax.vmap(jax.random.categorical)(subs, last / temperature)
        for row, token in zip(rows, new.tolist(), strict=True):
            row.append(int(token))
    return [bytes(row) for row in rows]
