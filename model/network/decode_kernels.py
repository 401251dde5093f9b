"""Pallas TPU kernels for the serving engine's decode step over a cache laid out (slots,
window, heads * head_dim): a store that writes the 8-position block holding each slot's new
key in place, and an attention that reads each slot's part of its cache once. Both are written
for one slot and run for all of them: under the engine's ``jax.vmap`` each becomes one kernel
over every slot (``custom_vmap``), where ``vmap`` of a ``pallas_call`` would loop over them.

Each head's products are summed on the MXU against a 0/1 matrix (heads along its columns). A
float32 value is the sum of three bfloat16 parts, and the 0/1 matrix is exact in bfloat16, so
three one-pass products give the float32 sums (the six passes of full precision are not
needed); the sums run in another order than XLA's, so the results are not the sampler's bit
for bit. Off a TPU they run in Pallas's interpreter (tests)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.custom_batching import custom_vmap
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

ROWS = 8  # positions in a stored block: a float32 tile's sublanes
LANES = 128  # a TPU vector's lanes: the 0/1 matrix's columns, one a head


def _interpret() -> bool:
    return jax.default_backend() != "tpu"


def _store_kernel(at_ref, new_ref, block_ref, out_ref):
    row = jax.lax.broadcasted_iota(jnp.int32, (ROWS, 1), 0)
    out_ref[0] = jnp.where(row == at_ref[pl.program_id(0)] % ROWS, new_ref[0], block_ref[0])


def store_all(cache, new, at):
    """cache (slots, window, width) with new (slots, 1, width) at positions at (slots,), in
    place (the cache is aliased to the result)."""
    slots, _, width = cache.shape
    block = pl.BlockSpec((1, ROWS, width), lambda s, at: (s, at[s] // ROWS, 0))
    return pl.pallas_call(
        _store_kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(slots,),
            in_specs=[pl.BlockSpec((1, 1, width), lambda s, at: (s, 0, 0)), block],
            out_specs=block,
        ),
        out_shape=jax.ShapeDtypeStruct(cache.shape, cache.dtype),
        input_output_aliases={2: 0},
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
        interpret=_interpret(),
    )(at.astype(jnp.int32), new.astype(cache.dtype), cache)


def _summed(x, matrix, contracted):
    """x (rows, k) float32 times a 0/1 matrix in three one-pass products of x's bfloat16 parts."""
    hi = x.astype(jnp.bfloat16)
    rest = x - hi.astype(jnp.float32)
    mid = rest.astype(jnp.bfloat16)
    lo = (rest - mid.astype(jnp.float32)).astype(jnp.bfloat16)
    dims = (((1,), (contracted,)), ((), ()))
    high, middle, low = (
        jax.lax.dot_general(p, matrix, dims, preferred_element_type=jnp.float32) for p in (hi, mid, lo)
    )
    return high + middle + low


def _attend_kernel(upto_ref, q_ref, k_ref, v_ref, heads_ref, o_ref, *, head_dim: int):
    per, fill, width = k_ref.shape
    heads = heads_ref[...]  # (width, LANES) bfloat16: 1 where a lane belongs to that column's head
    q = q_ref[...] * jnp.float32(head_dim**-0.5)  # (per, 1, width)
    scores = _summed((k_ref[...] * q).reshape(per * fill, width), heads, 0).reshape(per, fill, LANES)
    seen = jax.lax.broadcasted_iota(jnp.int32, (per, fill, LANES), 1) <= upto_ref[...]
    scores = jnp.where(seen, scores, -jnp.inf)
    weights = jnp.exp(scores - jnp.max(scores, axis=1, keepdims=True))
    spread = _summed(weights.reshape(per * fill, LANES), heads, 1).reshape(per, fill, width)
    total = _summed(jnp.sum(weights, axis=1), heads, 1)  # (per, width): each head's sum, spread
    o_ref[...] = jnp.sum(spread * v_ref[...], axis=1, keepdims=True) / total[:, None, :]


def attend_all(query, keys, values, upto, fill: int, head_dim: int):
    """Each slot's query (slots, 1, width) over the first ``fill`` positions of its keys and
    values (slots, window, width), positions past upto (slots,) unseen -> (slots, 1, width)."""
    slots, _, width = keys.shape
    assert width // head_dim <= LANES, "more heads than a vector's lanes"
    per = 8 if slots % 8 == 0 else 1  # slots a grid step: fewer, larger steps
    heads = (jnp.arange(width)[:, None] // head_dim == jnp.arange(LANES)[None, :]).astype(jnp.bfloat16)
    part = pl.BlockSpec((per, fill, width), lambda g: (g, 0, 0))
    row = pl.BlockSpec((per, 1, width), lambda g: (g, 0, 0))
    return pl.pallas_call(
        functools.partial(_attend_kernel, head_dim=head_dim),
        grid=(slots // per,),
        in_specs=[
            pl.BlockSpec((per, 1, LANES), lambda g: (g, 0, 0)),
            row,
            part,
            part,
            pl.BlockSpec((width, LANES), lambda g: (0, 0)),
        ],
        out_specs=row,
        out_shape=jax.ShapeDtypeStruct((slots, 1, width), jnp.float32),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",), vmem_limit_bytes=100 * 2**20),
        interpret=_interpret(),
    )(
        jnp.broadcast_to(upto.astype(jnp.int32)[:, None, None], (slots, 1, LANES)),
        query.astype(jnp.float32),
        keys,
        values,
        heads,
    )


def _batched(args, in_batched, size):
    return [
        x if batched else jnp.broadcast_to(x, (size, *jnp.shape(x)))
        for x, batched in zip(args, in_batched, strict=True)
    ]


@custom_vmap
def store(cache, new, at):
    """One slot: cache (window, width) with new (width,) at position at."""
    return store_all(cache[None], new[None, None], at[None])[0]


@store.def_vmap
def _store_slots(size, in_batched, cache, new, at):
    cache, new, at = _batched((cache, new, at), in_batched, size)
    return store_all(cache, new[:, None], at), True


def attend(query, keys, values, upto, fill: int, head_dim: int):
    """One slot: query (width,) over keys and values (window, width) -> (width,)."""

    @custom_vmap
    def one(query, keys, values, upto):
        return attend_all(query[None, None], keys[None], values[None], upto[None], fill, head_dim)[0, 0]

    @one.def_vmap
    def slots(size, in_batched, query, keys, values, upto):
        query, keys, values, upto = _batched((query, keys, values, upto), in_batched, size)
        return attend_all(query[:, None], keys, values, upto, fill, head_dim)[:, 0], True

    return one(query, keys, values, upto)
