"""A Pallas TPU kernel for the serving engine's decode step over one cache shared by all its
slots, laid out (slots, window, heads * head_dim). For each slot it stores the new key and
value in place (the tile of positions holding them, patched in the part of the cache read and
copied back) and reads the slot's part of the cache where it lies. It is written for one slot
(an index into the shared cache) and runs for all of them: under the engine's ``jax.vmap`` over
its slots, with the cache not mapped, it becomes one kernel over every slot (``custom_vmap``;
``vmap`` of a ``pallas_call`` would loop over them), which gives back the one cache holding
every slot's new key. So a call over the first few slots neither cuts their part out of the
cache nor puts it back, and a layer's step is one kernel.

The attention's products run on the MXU, one of each kind a slot. Each head's query sits on a
row of its own (zero off its head's lanes), so that the rows times the keys give every head's
scores, and the weights times the values give each head's mix on the lanes it keeps. A float32
operand is the sum of three bfloat16 parts stacked as more rows, and a bfloat16 cache is exact
in one pass, so one-pass products give float32 sums; they run in another order than XLA's, so
the results are not the sampler's bit for bit. Off a TPU it runs in Pallas's interpreter
(tests)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.custom_batching import custom_vmap
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

SUBLANES = 8  # a float32 tile's rows
ONE_PASS = jax.lax.Precision.DEFAULT
# A grid step's block of keys (and of values) at most: both, double-buffered, fit VMEM.
BLOCK_BYTES = 16 * 2**20


# Positions and slots are never negative, so ``lax.div`` and ``lax.rem`` are floor division
# and modulo here; unlike ``//`` and ``%`` they lower for a TPU without asking which chip, so a
# test exports the kernels for a TPU on a CPU.


def _interpret() -> bool:
    return jax.default_backend() != "tpu"


def tile_rows(dtype) -> int:
    """Positions in one stored tile: 8 rows of 4-byte values, 16 of 2-byte ones."""
    return SUBLANES * 4 // jnp.dtype(dtype).itemsize


def _parts(x):
    """x as bfloat16 parts whose sum is x: itself when bfloat16, else a float32's three."""
    if x.dtype == jnp.bfloat16:
        return (x,)
    hi = x.astype(jnp.bfloat16)
    rest = x - hi.astype(jnp.float32)
    mid = rest.astype(jnp.bfloat16)
    return hi, mid, (rest - mid.astype(jnp.float32)).astype(jnp.bfloat16)


def _stacked(x):
    """(rows, n) float32 -> (3 * rows, n) bfloat16: its three parts, one above another."""
    return jnp.concatenate([part.astype(jnp.float32) for part in _parts(x)], axis=0).astype(jnp.bfloat16)


def _products(a, b, dims):
    """a (bfloat16) times b, in one-pass products of b's parts summed in float32. The precision
    is set on each: the engine lowers under a float32 default, which Mosaic refuses for
    bfloat16 operands."""
    products = (
        jax.lax.dot_general(a, part, (dims, ((), ())), precision=ONE_PASS, preferred_element_type=jnp.float32)
        for part in _parts(b)
    )
    return functools.reduce(jnp.add, products)


def _folded(x, rows: int):
    """(3 * rows, n) -> (rows, n): the results of a ``_stacked`` operand's three parts summed."""
    return x[:rows] + x[rows : 2 * rows] + x[2 * rows :]


def _attend_kernel(  # noqa: PLR0913 - a kernel's refs
    slot_ref, at_ref, upto_ref, q_ref, new_k_ref, new_v_ref, k_ref, v_ref, heads_ref, o_ref, k_out, v_out, copies, *,
    head_dim: int,
):  # fmt: skip
    per, fill, _ = k_ref.shape
    rows = tile_rows(k_ref.dtype)
    first = pl.program_id(0) * per
    heads = heads_ref[...]  # (groups, width) float32: row h is 1 on head h's lanes
    groups = heads.shape[0]
    seen = jax.lax.broadcasted_iota(jnp.int32, (groups, fill), 1)
    row = jax.lax.broadcasted_iota(jnp.int32, (rows, 1), 0)

    def tile(at):  # the tile of positions holding position ``at``
        return pl.ds(pl.multiple_of(jax.lax.div(at, rows) * rows, rows), rows)

    def copy_back(one: int, half: int):  # slot ``one``'s tile holding its new key (half 0) or value (1)
        positions, cache, out = tile(at_ref[first + one]), (k_ref, v_ref)[half], (k_out, v_out)[half]
        return pltpu.make_async_copy(
            cache.at[one, positions], out.at[slot_ref[first + one], positions], copies.at[half, one]
        )

    # The grid step's slots as a loop, not written out: Mosaic compiles one slot's code.
    def attend_one(one, carry):
        at = at_ref[first + one]
        for half, (new, cache) in enumerate(((new_k_ref, k_ref), (new_v_ref, v_ref))):
            # Always, for a slot in flight: the call reads as far as its furthest key. A slot
            # past them may lie further, and is not stored.
            @pl.when(at < fill)
            def _store(new=new, cache=cache, half=half):
                positions = tile(at)
                kept = cache[one, positions, :]
                cache[one, positions, :] = jnp.where(row == jax.lax.rem(at, rows), new[one].astype(kept.dtype), kept)
                copy_back(one, half).start()

        query = q_ref[one] * jnp.float32(head_dim**-0.5)  # (1, width)
        # Each head's query on a row of its own, so that one product gives every head's scores.
        scores = _folded(_products(_stacked(heads * query), k_ref[one], ((1,), (1,))), groups)  # (groups, fill)
        scores = jnp.where(seen <= upto_ref[first + one], scores, -jnp.inf)
        weights = jnp.exp(scores - jnp.max(scores, axis=1, keepdims=True))
        # Row h: head h's weighted values on every lane, of which its own lanes are kept.
        mixed = _folded(_products(_stacked(weights), v_ref[one], ((1,), (0,))), groups)  # (groups, width)
        mixed = mixed / jnp.sum(weights, axis=1, keepdims=True)
        o_ref[one] = jnp.sum(heads * mixed, axis=0, keepdims=True)
        return carry

    def wait_one(one, carry):
        for half in range(2):
            pl.when(at_ref[first + one] < fill)(copy_back(one, half).wait)
        return carry

    jax.lax.fori_loop(0, per, attend_one, 0)
    jax.lax.fori_loop(0, per, wait_one, 0)


def _slots_a_step(count: int, block_bytes: int) -> int:
    """Slots a grid step: fewer, larger steps, as many as divide the count and fit VMEM."""
    return next(per for per in (8, 4, 2, 1) if count % per == 0 and per * block_bytes <= BLOCK_BYTES or per == 1)


def attend_all(query, new_keys, new_values, keys, values, at, upto, slot, fill: int, head_dim: int):  # noqa: PLR0913 - a kernel's operands
    """Slots slot (n,) of the shared cache (slots, window, width): each one's new key and value
    (n, 1, width) stored at its position ``at`` (n,) in place, and its query (n, 1, width) over
    the first ``fill`` positions, those past upto (n,) unseen -> (n, 1, width), keys, values
    (the caches given, written: they are aliased). A key at or past ``fill`` is not stored (a
    slot no sequence holds). Slots are read a few a grid step, so the slots given come in
    aligned runs: 0, 1, ... n - 1 as the engine's calls give them, or any one slot."""
    count, width = query.shape[0], keys.shape[-1]
    heads = width // head_dim
    groups = -(-heads // SUBLANES) * SUBLANES  # a part's rows: whole tiles
    per = _slots_a_step(count, fill * width * keys.dtype.itemsize)
    rows = (jnp.arange(groups)[:, None] == jnp.arange(width)[None, :] // head_dim).astype(jnp.float32)
    part = pl.BlockSpec((per, fill, width), lambda g, slot, at, upto: (jax.lax.div(slot[g * per], per), 0, 0))
    row = pl.BlockSpec((per, 1, width), lambda g, slot, at, upto: (g, 0, 0))
    in_place = pl.BlockSpec(memory_space=pl.ANY)  # written by the kernel's own copies
    return pl.pallas_call(
        functools.partial(_attend_kernel, head_dim=head_dim),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3,
            grid=(count // per,),
            in_specs=[row, row, row, part, part, pl.BlockSpec((groups, width), lambda g, slot, at, upto: (0, 0))],
            out_specs=[row, in_place, in_place],
            scratch_shapes=[pltpu.SemaphoreType.DMA((2, per))],
        ),
        out_shape=[
            jax.ShapeDtypeStruct((count, 1, width), jnp.float32),
            jax.ShapeDtypeStruct(keys.shape, keys.dtype),
            jax.ShapeDtypeStruct(values.shape, values.dtype),
        ],
        input_output_aliases={6: 1, 7: 2},  # keys, values (counting the three scalar inputs)
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",), vmem_limit_bytes=100 * 2**20),
        interpret=_interpret(),
    )(
        *(x.astype(jnp.int32) for x in (slot, at, upto)),
        *(x.astype(jnp.float32) for x in (query, new_keys, new_values)),
        keys,
        values,
        rows,
    )


def attend(query, new_key, new_value, keys, values, at, upto, slot, fill: int, head_dim: int):  # noqa: PLR0913 - a kernel's operands
    """Slot ``slot``'s new key and value (width,) stored at ``at`` in the shared cache (slots,
    window, width) and its query (width,) over it -> (width,), keys, values."""

    @custom_vmap
    def one(query, new_key, new_value, keys, values, at, upto, slot):
        mixed, keys, values = attend_all(
            query[None, None], new_key[None, None], new_value[None, None], keys, values, at[None], upto[None],
            slot[None], fill, head_dim,
        )  # fmt: skip
        return mixed[0, 0], keys, values

    @one.def_vmap
    def slots(size, in_batched, query, new_key, new_value, keys, values, at, upto, slot):  # noqa: PLR0913 - the same
        if any(in_batched[3:5]):
            raise NotImplementedError("the decode kernel maps over slots of one shared cache: vmap with it unmapped")
        rows = (query, new_key, new_value, at, upto, slot)
        query, new_key, new_value, at, upto, slot = (
            x if batched else jnp.broadcast_to(x, (size, *jnp.shape(x)))
            for x, batched in zip(rows, (*in_batched[:3], *in_batched[5:]), strict=True)
        )
        mixed, keys, values = attend_all(
            query[:, None], new_key[:, None], new_value[:, None], keys, values, at, upto, slot, fill, head_dim
        )
        return (mixed[:, 0], keys, values), (True, False, False)

    return one(query, new_key, new_value, keys, values, at, upto, slot)
