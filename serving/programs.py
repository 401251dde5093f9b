"""The serving engine's compiled programs: the decode call (``STEPS_A_CALL`` steps over the
first slots, reading the first positions of their caches), the prefill of a long prompt into
one slot, and the move of a slot's cache to another. The engine (``engine.py``) schedules the
sequences and calls them; these compute, over the cache layout chosen for the engine
(``layouts.py``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from ..model.inference.sampling import matmul_precision, sample, sample_truncated, seeded
from .layouts import CacheLayout
from .shapes import buckets, decode_sizes, fills

STEPS_A_CALL = 8  # decode steps in one call: one return to the host for 8 bytes
WHOLE = (0.0, 0, 1.0)  # the settings of a free slot: temperature, top_k, top_p that cut nothing


class EnginePrograms:
    """The engine's programs for a model (``graphdef``, its context ``window`` and whether its
    positions are ``rotary``) over ``slots`` slots laid out as ``layout`` says; each traced
    once per shape (``compilations`` counts them)."""

    def __init__(self, graphdef, window: int, rotary: bool, layout: CacheLayout, slots: int):
        self.graphdef, self.window, self.rotary, self.layout, self.slots = graphdef, window, rotary, layout, slots
        self.compilations = 0
        self.decode_jit = jax.jit(self._decode_call, donate_argnums=(1,), static_argnums=(2, 3))
        self.prefill_jit = jax.jit(self._prefill_slot, donate_argnums=(1,), static_argnums=(5,))
        self.decode = matmul_precision(self.decode_jit, layout.precision)
        self.prefill = matmul_precision(self.prefill_jit, layout.precision)
        self.move = jax.jit(self._move_slot, donate_argnums=(0,))

    def count(self) -> int:
        """How many programs the engine's warm-up compiles: a decode call per size and fill, a
        prefill per bucket, and the move where there are slots to move between."""
        return len(decode_sizes(self.slots)) * len(fills(self.window)) + len(buckets(self.window)) + (self.slots > 1)

    def _decode_call(  # noqa: PLR0913 - a jitted program's traced inputs
        self, params, caches, size: int, fill: int, tokens, keys, positions, settings, fed, kept_from, fed_seeds
    ):
        """The first ``size`` slots ``STEPS_A_CALL`` positions further, in one call, each
        reading the first ``fill`` positions of its cache: each slot's last byte written into
        its cache at its position and the next byte drawn, ``STEPS_A_CALL`` times (a slot past
        the sequences in flight computes too, and is ignored, as are the bytes past a
        sequence's end); the bytes drawn (steps, size), every slot's last byte and key after
        them, the caches. ``fed`` (slots, steps): a slot that joins with a short prompt takes
        its bytes as its first steps' input, -1 elsewhere; it starts from its ``fed_seeds`` key
        and keeps the bytes of steps ``kept_from`` on, its key split once a byte kept."""
        self.compilations += 1
        model = nnx.merge(self.graphdef, params)
        settings = settings[:size]
        temperature, top_k, top_p = settings[:, 0], settings[:, 1].astype(jnp.int32), settings[:, 2]
        # Sorting for top_k and top_p costs more than a small model's step: only a call with a
        # slot that cuts its distribution sorts (the same draws either way).
        truncating = jnp.any((top_k > 0) | (top_p < 1.0))

        def draw(logits, keys):
            return jax.lax.cond(
                truncating,
                lambda: jax.vmap(sample_truncated)(logits, keys, temperature, top_k, top_p),
                lambda: jax.vmap(sample)(logits, keys, temperature),
            )

        def one(token, position, cache):
            if not self.rotary:
                # A learned position past the context (a step after a sequence's end, its byte
                # dropped) would look up NaN and store it in the slot's cache, where a weight
                # of 0 times NaN reaches the slot's next sequence: it takes the last one's.
                position = jnp.minimum(position, self.window - 1)
            logits, written = model(token[None, None], position[None], cache, filled=self.layout.filled(fill))
            assert written is not None  # given a cache, the model returns it written
            return logits[0, 0], written

        def step(carry, inputs):
            tokens, positions, keys, part = carry
            forced, kept = inputs
            tokens = jnp.where(forced >= 0, forced, tokens)
            logits, part = self.layout.advance(one, tokens, positions, part)
            drawn, drawn_keys = draw(logits, keys)
            return (drawn, positions + 1, jnp.where(kept[:, None], drawn_keys, keys), part), drawn

        parts = self.layout.parts(caches, size, fill)
        fed = fed[:size].T  # (steps, size)
        kept = jnp.arange(STEPS_A_CALL)[:, None] >= kept_from[None, :size]
        keys_in = jnp.where((fed[0] >= 0)[:, None], jax.vmap(seeded)(fed_seeds[:size]), keys[:size])
        start = (tokens[:size], positions[:size], keys_in, parts)
        (last, _, drawn_keys, written), drawn = jax.lax.scan(step, start, (fed, kept))
        caches = self.layout.put_back(caches, written)
        return drawn, tokens.at[:size].set(last), keys.at[:size].set(drawn_keys), caches

    def _move_slot(self, caches, tokens, keys, source, target):
        """Slot ``source``'s cache, last byte and key copied into slot ``target``."""
        self.compilations += 1

        def moved(rows):
            return jax.lax.dynamic_update_index_in_dim(
                rows, jax.lax.dynamic_index_in_dim(rows, source, keepdims=False), target, 0
            )

        return jax.tree.map(moved, caches), moved(tokens), moved(keys)

    def _prefill_slot(self, params, caches, tokens, keys, slot, size: int, prompt, length, seed, settings):  # noqa: PLR0913 - a jitted program's traced inputs
        """The prompt (padded to ``size``) written into one slot's cache from position 0, and
        the byte after its ``length`` real bytes drawn from its ``seed``: it and the key after
        it become the slot's. The padding's keys sit past the prompt, where each decode step
        writes its own before any query reads that far."""
        self.compilations += 1
        model = nnx.merge(self.graphdef, params)
        cache = jax.tree.map(lambda layer: jax.lax.dynamic_index_in_dim(layer, slot, keepdims=False), caches)
        logits, cache = model(prompt[None], jnp.arange(size), cache)
        token, key = sample_truncated(
            logits[0, length - 1], seeded(seed), settings[0], settings[1].astype(jnp.int32), settings[2]
        )
        caches = jax.tree.map(
            lambda layers, layer: jax.lax.dynamic_update_index_in_dim(layers, layer, slot, 0), caches, cache
        )
        return caches, tokens.at[slot].set(token), keys.at[slot].set(key)
