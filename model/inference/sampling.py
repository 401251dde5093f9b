"""Sampling bytes from a trained model, with the whole loop compiled.

Each new byte is conditioned on the last ``max_seq_len`` bytes. While the context has
room, each byte costs one position through the model's key/value cache. Once it is full:
with rotary positions the cache is a ring (the newest key replaces the oldest, and the
others stay valid, since attention sees only distances); with learned positions every
position shifts, and each byte needs a forward pass over the whole window.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from functools import partial, wraps
from typing import Protocol, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ...errors import BardflowError
from ..network.transformer import Transformer

T = TypeVar("T")


class PromptError(BardflowError, ValueError):
    """A prompt or sampling setting cannot be used."""


def matmul_precision(run: Callable[..., T], precision: str = "highest") -> Callable[..., T]:
    """``run`` (a jitted function) traced and run with float32 matrix products in full on
    every device. A TPU's default rounds their operands to bfloat16, and how it rounds depends
    on the program's shapes: there a sequence drew other bytes in a batch than alone, and other
    bytes in the serving engine than in this sampler (docs/journal.md). A CPU's products are
    full already. ``precision="high"``: three one-pass bfloat16 products on a TPU, where full
    precision takes six (float32 short of its last bits)."""

    @wraps(run)
    def precise(*args):
        with jax.default_matmul_precision(precision):
            return run(*args)

    return precise


def pick(logits, keys, temperature):
    """One byte per row, each row drawing from its own key exactly as a batch of one would:
    (next keys, bytes). Temperature 0 is greedy."""
    pairs = jax.vmap(jax.random.split)(keys)
    scaled = logits / jnp.maximum(temperature, 1e-6)
    sampled = jax.vmap(jax.random.categorical)(pairs[:, 1], scaled)
    return pairs[:, 0], jnp.where(temperature > 0, sampled, jnp.argmax(logits, axis=-1))


@matmul_precision
@partial(jax.jit, static_argnums=(0, 6))  # graphdef, max_new
def _sliding_loop(graphdef, params, context, temperature, keys, count, max_new):
    """``count`` bytes per row from a full window that slides left by one per byte: every
    position shifts, so each byte needs a forward pass over the whole window."""
    model = nnx.merge(graphdef, params)

    def one_byte(i, carry):
        context, keys, out = carry
        logits, _ = model(context, last_only=True)
        keys, token = pick(logits[:, 0], keys, temperature)
        token = token.astype(context.dtype)
        context = jnp.roll(context, -1, axis=1).at[:, -1].set(token)
        return context, keys, out.at[:, i].set(token)

    out = jnp.zeros((context.shape[0], max_new), context.dtype)  # static size; ``count`` columns get filled
    return jax.lax.fori_loop(0, count, one_byte, (context, keys, out))[2]


def _noise(keys, count, size: int, vocab: int):
    """What ``pick`` would draw for the next ``count`` (<= ``size``) bytes, all at once:
    (the keys after ``count`` bytes, Gumbel noise (size, rows, vocab)). Sampling a byte is
    ``argmax(logits / temperature + noise)``, exactly ``jax.random.categorical``. Drawn
    inside the byte loop, each byte's key split and noise are two small loops of their own
    on a CPU (JAX's threefry), more operations than a small model's step."""

    def split(keys, _):
        pairs = jax.vmap(jax.random.split)(keys)
        return pairs[:, 0], (pairs[:, 0], pairs[:, 1])

    _, (chain, subs) = jax.lax.scan(split, keys, length=size)
    keys = jnp.where(count > 0, chain[jnp.maximum(count - 1, 0)], keys)
    gumbel = jax.vmap(jax.vmap(lambda key: jax.random.gumbel(key, (vocab,), jnp.float32)))
    return keys, gumbel(subs)


@matmul_precision
@partial(jax.jit, static_argnums=(0, 10), donate_argnums=(3,))  # graphdef, size; the cache is updated in place
def _cached_loop(graphdef, params, context, cache, start, length, done, count, temperature, keys, size):  # noqa: PLR0913 - a jitted loop's traced inputs
    """Feeds the context one byte at a time through the model with its key/value cache,
    then samples bytes at one position each: the work per byte is one token's, not the
    whole window's. ``cache``: None at first, then what the last call returned.
    Positions ``start`` (0, or where the last call stopped) up to the one
    that samples byte ``done + count`` (``count`` <= ``size`` bytes in this call). With
    learned positions ``length + done + count <= window``; with rotary ones the cache
    wraps around. Positions and counts are traced, so one compilation serves every prompt."""
    model = nnx.merge(graphdef, params)
    rows, window = context.shape
    if cache is None:  # the first call: an empty cache, made here rather than op by op; in the weights' dtype
        cache = model.init_cache(rows, window, model.token_embed.embedding.dtype)
    keys, noise = _noise(keys, count, size, model.lm_head.out_features)
    greedy = temperature <= 0

    def position(pos, carry, filled):
        context, cache, out = carry
        logits, cache = model(jax.lax.dynamic_slice_in_dim(context, pos, 1, axis=1), pos[None], cache, filled=filled)
        slot = jnp.maximum(pos - (length - 1) - done, 0)  # this call's sampled byte
        scaled = logits[:, 0] / jnp.maximum(temperature, 1e-6) + noise[slot]
        token = jnp.argmax(jnp.where(greedy, logits[:, 0], scaled), axis=-1).astype(context.dtype)
        sampling = pos >= length - 1  # the prompt's own bytes are only read, not sampled
        at = jnp.minimum(pos + 1, window - 1)  # past the window: the last column feeds the next byte
        context = context.at[:, at].set(jnp.where(sampling, token, context[:, at]))
        out = out.at[:, slot].set(jnp.where(sampling, token, out[:, slot]))
        return context, cache, out

    out = jnp.zeros((rows, size), context.dtype)  # the first ``count`` columns get filled
    end, carry = length - 1 + done + count, (context, cache, out)
    # The positions in pieces of the window, each reading the cache only up to its own end (a
    # position reads the keys before it); past the window (rotary: a ring) the whole cache.
    piece = window // CACHE_PIECES if window % CACHE_PIECES == 0 else window
    for limit in range(piece, window + 1, piece):
        lowest = jnp.maximum(start, limit - piece)
        carry = jax.lax.fori_loop(lowest, jnp.minimum(end, limit), partial(position, filled=limit), carry)
    context, cache, out = jax.lax.fori_loop(jnp.maximum(start, window), end, partial(position, filled=None), carry)
    return context, cache, keys, out


# A sampling step reads the cache up to the end of the piece of the window its position is in:
# four pieces read on average 5/8 of what the whole window would, for four copies of the step
# in the compiled loop.
CACHE_PIECES = 4
SEGMENT = 4096  # bytes sampled per compiled call at most: bounds the noise drawn ahead (rows x SEGMENT x 256 floats)


class Tokenizer(Protocol):
    """Token ids for bytes and back (``model/data/tokenizer.py``'s BPE); without one, each
    byte is a token."""

    def encode(self, data: bytes) -> np.ndarray: ...

    def decode(self, ids: Iterable[int]) -> bytes: ...


def generate(
    model: Transformer,
    prompt: str,
    max_new_bytes: int,
    temperature: float,
    seed: int,
    max_seq_len: int,
    tokenizer: Tokenizer | None = None,
) -> bytes:
    """The prompt's bytes followed by ``max_new_bytes`` sampled tokens' bytes (with a tokenizer,
    ``max_new_bytes`` tokens); temperature 0 is greedy."""
    return generate_batch(model, prompt, max_new_bytes, temperature, [seed], max_seq_len, tokenizer)[0]


def generate_batch(
    model: Transformer,
    prompt: str,
    max_new_bytes: int,
    temperature: float,
    seeds: list[int],
    max_seq_len: int,
    tokenizer: Tokenizer | None = None,
) -> list[bytes]:
    """One sample per seed, all in one batch; sample ``i`` is exactly ``generate(..., seeds[i])``."""
    encoded = prompt.encode("utf-8")
    if not encoded:
        raise PromptError("the prompt is empty; give at least one character of text")
    if temperature < 0:
        raise PromptError(f"temperature {temperature} is negative; use 0 (greedy) or more")
    if not seeds:
        raise PromptError("no seeds given; pass one seed per sample")
    ids = np.frombuffer(encoded, np.uint8) if tokenizer is None else tokenizer.encode(encoded)
    rows = sample_ids(model, ids, max_new_bytes, temperature, seeds, max_seq_len)
    if tokenizer is None:
        return [encoded + row.astype(np.uint8).tobytes() for row in rows]
    return [encoded + tokenizer.decode(row) for row in rows]


def sample_ids(
    model: Transformer, ids: np.ndarray, max_new: int, temperature: float, seeds: list[int], max_seq_len: int
) -> np.ndarray:
    """(seeds, max_new): the ids drawn after the prompt's ``ids`` (its last ``max_seq_len``)
    for each seed."""
    kept = ids[-max_seq_len:]  # a longer prompt keeps only what fits the context
    context = np.zeros((len(seeds), max_seq_len), np.int32)
    context[:, : len(kept)] = kept
    graphdef, params = nnx.split(model)
    keys = jnp.stack([jax.random.key(seed) for seed in seeds])
    length, scale = np.int32(len(kept)), np.float32(temperature)
    # While the context has room, or always with rotary positions, each new token costs one
    # position (a KV cache); past that, every learned position embedding shifts, and each
    # token needs a forward pass over the whole window (only the last position in the top layer).
    cached = max_new if model.rotary else min(max_new, max_seq_len - len(kept))
    pieces = []
    window = context
    if cached > 0:
        size = max(max_seq_len, min(cached, SEGMENT))  # one compilation for every length up to the context
        cache, start = None, 0
        for done in range(0, cached, size):
            count = min(size, cached - done)
            window, cache, keys, new = _cached_loop(
                graphdef,
                params,
                window,
                cache,
                np.int32(start),
                length,
                np.int32(done),
                np.int32(count),
                scale,
                keys,
                size,
            )
            pieces.append(np.asarray(new)[:, :count])
            start = len(kept) - 1 + done + count
    if max_new > cached:
        rest = max_new - cached
        new = _sliding_loop(graphdef, params, window, scale, keys, np.int32(rest), max_new)
        pieces.append(np.asarray(new)[:, :rest])
    return np.concatenate(pieces, axis=1)


def as_text(data: bytes) -> str:
    return data.decode("utf-8", errors="replace")


# One sequence's draw inside the serving engine's compiled calls (serving/engine.py), where
# each slot draws with its own settings.
def sample(logits, key, temperature):
    """One byte from ``logits`` (vocab,): greedy at temperature 0, else drawn from the whole
    distribution at ``temperature``; (the byte, the key for the next draw): the sampler's own
    draw (``pick``) for one row."""
    keys, drawn = pick(logits[None].astype(jnp.float32), key[None], temperature)
    return drawn[0].astype(jnp.int32), keys[0]


def sample_truncated(logits, key, temperature, top_k, top_p):
    """As ``sample``, from the distribution cut to its ``top_k`` most likely bytes (0: all) and
    to the fewest whose probabilities reach ``top_p`` (1: all). Left whole by both, it draws
    what ``sample`` draws: nothing is cut, and the key and the draw are the same."""
    key, draw = jax.random.split(key)
    logits = logits.astype(jnp.float32)
    scaled = logits / jnp.maximum(temperature, 1e-6)
    ranked = jnp.sort(scaled)[::-1]
    vocab = logits.shape[-1]
    kth = ranked[jnp.clip(jnp.where(top_k > 0, top_k, vocab), 1, vocab) - 1]
    scaled = jnp.where(scaled < kth, -jnp.inf, scaled)
    ranked = jnp.where(ranked < kth, -jnp.inf, ranked)
    # The least likely byte kept: the first whose cumulative probability reaches top_p (all
    # of them at top_p 1, whatever the sum's rounding).
    before = jnp.sum(jnp.cumsum(jax.nn.softmax(ranked)) < top_p)
    cutoff = jnp.where(top_p < 1.0, ranked[jnp.minimum(before, vocab - 1)], -jnp.inf)
    scaled = jnp.where(scaled < cutoff, -jnp.inf, scaled)
    drawn = jax.random.categorical(draw, scaled)
    return jnp.where(temperature > 0, drawn, jnp.argmax(logits)).astype(jnp.int32), key


def seeded(seed):
    """The key data a seed starts from, as the sampler's ``jax.random.key(seed)`` holds it;
    worked out inside a compiled program (one dispatch and read back per request would cost
    more than a decode call on a TPU)."""
    return jax.random.key_data(jax.random.key(seed))
