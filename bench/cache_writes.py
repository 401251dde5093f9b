"""``python -m bench.cache_writes [--smoke]``: how the serving engine's decode step should store
each slot's new key and value on this machine's first device, and along which axis of the
cache the positions should run.

Many slots, each at a position of its own, advance together (``jax.vmap`` over the slots, as
``serving/engine.py`` runs them): a ``scatter`` writes each slot's one position in place; a
``select`` rewrites the part of the cache the step reads, the new key where the position is.
Positions ``second`` is the sampler's cache, (slots, heads, window, head_dim); ``last`` is
(slots, heads, head_dim, window), which a TPU tiles by 128 along the window, not along a head
width of 64. The step here is the attention alone at `gpt2`'s shape (64 slots, 12 layers, 12
heads of 64, the first 256 of 1,024 positions read), 8 steps a call: milliseconds a step for
each.
"""

from __future__ import annotations

import argparse
import itertools
import time

import jax
import jax.numpy as jnp

from bench.report import machine

STEPS = 8


def decode_call(write: str, last: bool, slots: int, heads: int, head_dim: int, layers: int, fill: int):
    """A compiled call of ``STEPS`` attention steps over every layer's cache, each slot writing
    its own position ``write``'s way, positions along the ``last`` axis or the second."""
    axis = 3 if last else 2  # the positions' axis of (slots, heads, ., .)
    cached = "shdn" if last else "shnd"

    def store(cache, new, positions):
        new = jnp.expand_dims(new, axis)  # (slots, heads, head_dim, 1) or (slots, heads, 1, head_dim)
        part = jax.lax.slice_in_dim(cache, 0, fill, axis=axis)
        if write == "scatter":
            put = jax.vmap(lambda c, x, at: jax.lax.dynamic_update_slice_in_dim(c, x, at, axis - 1))
            cache = put(cache, new, positions)
            return cache, jax.lax.slice_in_dim(cache, 0, fill, axis=axis)
        hit = jnp.expand_dims(jnp.arange(fill)[None] == positions[:, None], (1, 2) if last else (1, 3))
        part = jnp.where(hit, new, part)
        return jax.lax.dynamic_update_slice(cache, part, (0, 0, 0, 0)), part

    def call(caches, query, positions):
        def step(carry, i):
            caches, query = carry
            at, written = positions + i, []
            for keys, values in caches:
                keys, key_part = store(keys, query, at)
                values, value_part = store(values, query, at)
                scores = jnp.einsum(f"shd,{cached}->shn", query, key_part)
                scores = jnp.where((jnp.arange(fill)[None] <= at[:, None])[:, None], scores, -jnp.inf)
                weights = jnp.exp(scores - scores.max(-1, keepdims=True))
                query = query + jnp.einsum(f"shn,{cached}->shd", weights, value_part) / weights.sum(-1)[..., None]
                written.append((keys, values))
            return (written, query), None

        (caches, query), _ = jax.lax.scan(step, (caches, query), jnp.arange(STEPS))
        return caches, query

    return jax.jit(call, donate_argnums=(0,))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.cache_writes", description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="small shapes: every part runs, on a CPU too")
    args = parser.parse_args(argv)
    slots, heads, window, head_dim, layers = (8, 2, 128, 64, 2) if args.smoke else (64, 12, 1024, 64, 12)
    fill = window // 4
    print(machine())
    for write, positions_axis in itertools.product(("scatter", "select"), ("second", "last")):
        last = positions_axis == "last"
        call = decode_call(write, last, slots, heads, head_dim, layers, fill)
        shape = (slots, heads, head_dim, window) if last else (slots, heads, window, head_dim)
        caches = [(jnp.zeros(shape), jnp.zeros(shape)) for _ in range(layers)]  # distinct buffers, donated
        query = jnp.full((slots, heads, head_dim), 0.01)
        positions = jnp.arange(slots, dtype=jnp.int32) % (fill // 2)  # a call's last step stays inside the part
        caches, query = call(caches, query, positions)
        jax.block_until_ready(query)
        times = []
        for i in range(5):
            started = time.perf_counter()
            caches, query = call(caches, query, positions + (STEPS * (i + 1)) % (fill // 4))
            jax.block_until_ready(query)
            times.append(time.perf_counter() - started)
        print(f"{write}, positions {positions_axis}: {min(times) / STEPS * 1000:.3f} ms a step", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
