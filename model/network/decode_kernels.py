"""Pallas TPU kernels for the serving engine's decode step over one cache shared by all its
slots, laid out (slots, window, heads * head_dim): a store that writes the tile of positions
holding each slot's new key in place, and an attention that reads each slot's part of the cache
where it lies. Both are written for one slot (an index into the shared cache) and run for all
of them: under the engine's ``jax.vmap`` over its slots, with the cache not mapped, each becomes
one kernel over every slot (``custom_vmap``; ``vmap`` of a ``pallas_call`` would loop over them),
and the store gives back the one cache holding every slot's new key. So a call over the first
few slots neither cuts their part out of the cache nor puts it back.

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

LANES = 128  # a TPU vector's lanes: the 0/1 matrix's columns, one a head
SUBLANES = 8  # a float32 tile's rows: a part of the cache is read in whole tiles of positions
ONE_PASS = jax.lax.Precision.DEFAULT
# A grid step's keys at most (elements): its blocks, double-buffered, and spills fit VMEM.
BLOCK_ELEMENTS = 8 * 256 * 768


# Positions and slots are never negative, so ``lax.div`` and ``lax.rem`` are floor division
# and modulo here; unlike ``//`` and ``%`` they lower for a TPU without asking which chip, so a
# test exports the kernels for a TPU on a CPU.


def _interpret() -> bool:
    return jax.default_backend() != "tpu"


def tile_rows(dtype) -> int:
    """Positions in one stored tile: 8 rows of 4-byte values, 16 of 2-byte ones."""
    return SUBLANES * 4 // jnp.dtype(dtype).itemsize


def _store_kernel(at_ref, slot_ref, new_ref, tile_ref, out_ref):
    del slot_ref  # it chose the tile
    rows = tile_ref.shape[1]
    row = jax.lax.broadcasted_iota(jnp.int32, (rows, 1), 0)
    out_ref[0] = jnp.where(row == jax.lax.rem(at_ref[pl.program_id(0)], rows), new_ref[0], tile_ref[0])


def store_all(cache, new, at, slot):
    """cache (slots, window, width) with new (n, 1, width) at positions at (n,) of slots slot
    (n,), each slot once, in place (the cache is aliased to the result)."""
    count, width = new.shape[0], cache.shape[-1]
    rows = tile_rows(cache.dtype)
    tile = pl.BlockSpec((1, rows, width), lambda s, at, slot: (slot[s], jax.lax.div(at[s], rows), 0))
    return pl.pallas_call(
        _store_kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(count,),
            in_specs=[pl.BlockSpec((1, 1, width), lambda s, at, slot: (s, 0, 0)), tile],
            out_specs=tile,
        ),
        out_shape=jax.ShapeDtypeStruct(cache.shape, cache.dtype),
        input_output_aliases={3: 0},
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
        interpret=_interpret(),
    )(at.astype(jnp.int32), slot.astype(jnp.int32), new.astype(cache.dtype), cache)


def _summed(x, matrix, contracted):
    """x (rows, k) float32 times a 0/1 matrix in three one-pass products of x's bfloat16 parts.

    The precision is set on each product: the engine lowers under a float32 default, which
    Mosaic refuses for bfloat16 operands."""
    hi = x.astype(jnp.bfloat16)
    rest = x - hi.astype(jnp.float32)
    mid = rest.astype(jnp.bfloat16)
    lo = (rest - mid.astype(jnp.float32)).astype(jnp.bfloat16)
    dims = (((1,), (contracted,)), ((), ()))
    high, middle, low = (
        jax.lax.dot_general(p, matrix, dims, precision=ONE_PASS, preferred_element_type=jnp.float32)
        for p in (hi, mid, lo)
    )
    return high + middle + low


def _attend_kernel(slot_ref, upto_ref, q_ref, k_ref, v_ref, heads_ref, o_ref, *, head_dim: int):
    del slot_ref  # it chose the blocks
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


def _slots_a_step(count: int, elements: int) -> int:
    """Slots a grid step: fewer, larger steps, as many as divide the count and fit VMEM."""
    return next(per for per in (8, 4, 2, 1) if count % per == 0 and per * elements <= BLOCK_ELEMENTS or per == 1)


def attend_all(query, keys, values, upto, slot, fill: int, head_dim: int):
    """Queries (n, 1, width) of slots slot (n,) over the first ``fill`` positions of their
    keys and values in the shared cache (slots, window, width), positions past upto (n,) unseen
    -> (n, 1, width). Slots are read a few a grid step, so the slots given come in aligned runs:
    0, 1, ... n - 1 as the engine's calls give them, or any one slot."""
    count, width = query.shape[0], keys.shape[-1]
    assert width // head_dim <= LANES, "more heads than a vector's lanes"
    per = _slots_a_step(count, fill * width)
    heads = (jnp.arange(width)[:, None] // head_dim == jnp.arange(LANES)[None, :]).astype(jnp.bfloat16)
    part = pl.BlockSpec((per, fill, width), lambda g, slot: (jax.lax.div(slot[g * per], per), 0, 0))
    row = pl.BlockSpec((per, 1, width), lambda g, slot: (g, 0, 0))
    return pl.pallas_call(
        functools.partial(_attend_kernel, head_dim=head_dim),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(count // per,),
            in_specs=[
                pl.BlockSpec((per, 1, LANES), lambda g, slot: (g, 0, 0)),
                row,
                part,
                part,
                pl.BlockSpec((width, LANES), lambda g, slot: (0, 0)),
            ],
            out_specs=row,
        ),
        out_shape=jax.ShapeDtypeStruct((count, 1, width), jnp.float32),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",), vmem_limit_bytes=100 * 2**20),
        interpret=_interpret(),
    )(
        slot.astype(jnp.int32),
        jnp.broadcast_to(upto.astype(jnp.int32)[:, None, None], (count, 1, LANES)),
        query.astype(jnp.float32),
        keys,
        values,
        heads,
    )


def _mapped(args, in_batched, size):
    return [
        x if batched else jnp.broadcast_to(x, (size, *jnp.shape(x)))
        for x, batched in zip(args, in_batched, strict=True)
    ]


def _shared(in_batched) -> None:
    if in_batched[0]:
        raise NotImplementedError("the decode kernels map over slots of one shared cache: vmap with the cache unmapped")


@custom_vmap
def store(cache, new, at, slot):
    """The shared cache (slots, window, width) with slot ``slot``'s new key (width,) at position ``at``."""
    return store_all(cache, new[None, None], at[None], slot[None])


@store.def_vmap
def _store_slots(size, in_batched, cache, new, at, slot):
    _shared(in_batched)
    new, at, slot = _mapped((new, at, slot), in_batched[1:], size)
    return store_all(cache, new[:, None], at, slot), False


def attend(query, keys, values, upto, slot, fill: int, head_dim: int):
    """Slot ``slot``'s query (width,) over its keys and values in the shared cache (slots,
    window, width) -> (width,)."""

    @custom_vmap
    def one(query, keys, values, upto, slot):
        return attend_all(query[None, None], keys, values, upto[None], slot[None], fill, head_dim)[0, 0]

    @one.def_vmap
    def slots(size, in_batched, query, keys, values, upto, slot):
        _shared(in_batched[1:])
        query, upto, slot = _mapped((query, upto, slot), (in_batched[0], *in_batched[3:]), size)
        return attend_all(query[:, None], keys, values, upto, slot, fill, head_dim)[:, 0], True

    return one(query, keys, values, upto, slot)
