"""A layer's keys and values as the model reads and writes them while it samples: the
sampler's layout (``LayerCache``), and the serving engine's, chosen once per engine for its
device (``SlotCache`` on a TPU, ``RowsCache`` with the Pallas decode kernels)."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from . import decode_kernels
from .kernels import attend


class LayerCache(NamedTuple):
    """One layer's keys and values, rows and heads in one leading axis: the layout the
    attention products read, and one that XLA updates in place even for a single row."""

    keys: jax.Array  # (rows * heads, window, head_dim)
    values: jax.Array

    @property
    def window(self) -> int:
        return self.keys.shape[-2]

    @classmethod
    def laid_out(cls, layer: LayerCache) -> LayerCache:
        """``layer``'s keys and values (positions second, as ``init_cache`` lays them) in this class's layout."""
        return cls(*layer)

    def written(self, keys, values, at) -> LayerCache:
        """``keys`` and ``values`` (rows * heads, t, head_dim) stored from index ``at`` on."""
        at = (0, at, 0)
        return type(self)(
            jax.lax.dynamic_update_slice(self.keys, keys.astype(self.keys.dtype), at),
            jax.lax.dynamic_update_slice(self.values, values.astype(self.values.dtype), at),
        )

    def first(self, count: int) -> LayerCache:
        """The first ``count`` positions (whatever axes lead: the engine's slots)."""
        return type(self)(self.keys[..., :count, :], self.values[..., :count, :])

    def attended(self, query, visible, filled: int | None = None):
        """``attend`` over the first ``filled`` positions (all by default)."""
        return attend(query, *(self if filled is None else self.first(filled)), visible)

    def written_and_attended(self, new: LayerCache, at, query, visible, filled: int | None = None):
        """``new``'s keys and values stored from ``at`` on, then ``query`` over the cache: the
        mix and the cache written."""
        cache = self.written(*new, at)
        return cache.attended(query, visible, filled), cache


class SlotCache(LayerCache):
    """A layer's cache for one of many sequences that ``jax.vmap`` advances together, each at a
    position of its own (the serving engine's slots on a TPU). Stored in place at a position
    that differs per sequence, one position is a scatter, which a TPU runs as a loop over the
    sequences, one small copy each; a select over the cache streams it once. Positions run
    along the last axis, (rows * heads, head_dim, window): the layout in which a TPU runs the
    engine's select and attention fastest (docs/journal.md)."""

    @property
    def window(self) -> int:
        return self.keys.shape[-1]

    @classmethod
    def laid_out(cls, layer: LayerCache) -> LayerCache:
        return cls(*(half.swapaxes(-1, -2) for half in layer))

    def written(self, keys, values, at) -> LayerCache:
        keys, values = (x.swapaxes(1, 2).astype(self.keys.dtype) for x in (keys, values))
        if keys.shape[2] != 1:
            return SlotCache(
                jax.lax.dynamic_update_slice(self.keys, keys, (0, 0, at)),
                jax.lax.dynamic_update_slice(self.values, values, (0, 0, at)),
            )
        hit = jnp.arange(self.window) == at
        return SlotCache(jnp.where(hit, keys, self.keys), jnp.where(hit, values, self.values))

    def first(self, count: int) -> LayerCache:
        return SlotCache(self.keys[..., :count], self.values[..., :count])

    def attended(self, query, visible, filled: int | None = None):
        return attend(query, *(self if filled is None else self.first(filled)), visible, positions_last=True)


class RowsCache(NamedTuple):
    """A layer's cache for the serving engine's slots, read and written by Pallas TPU kernels
    (``decode_kernels.py``): (slots, window, heads * head_dim), each position one row of every
    head side by side, so that a store in place writes a tile of 8 positions, not 128. A decode
    step of one new key runs for one ``slot`` of the cache all slots share (the engine maps it
    over its slots, the cache unmapped): one kernel stores the key in place and reads the cache
    where it lies, up to ``filled``. A prompt of several keys takes XLA's path over one slot's
    (window, heads * head_dim), ``slot`` unset."""

    keys: jax.Array
    values: jax.Array
    slot: jax.Array | None = None

    @property
    def window(self) -> int:
        return self.keys.shape[-2]

    @classmethod
    def laid_out(cls, layer: LayerCache) -> RowsCache:
        """One sequence's ``layer`` (heads, window, head_dim) as one slot's rows."""
        return cls(*(half.swapaxes(0, 1).reshape(half.shape[1], -1) for half in layer))

    def heads_first(self, heads: int) -> LayerCache:
        """One slot's cache as ``LayerCache`` lays it out (heads, window, head_dim)."""
        return LayerCache(*(half.reshape(half.shape[0], heads, -1).swapaxes(0, 1) for half in (self.keys, self.values)))

    def written(self, keys, values, at) -> RowsCache:
        """One slot's ``keys`` and ``values`` (heads, t, head_dim) stored from index ``at`` on."""
        heads, length, head_dim = keys.shape
        rows = (x.swapaxes(0, 1).reshape(length, heads * head_dim).astype(self.keys.dtype) for x in (keys, values))
        return RowsCache(*(jax.lax.dynamic_update_slice(c, r, (at, 0)) for c, r in zip(self[:2], rows, strict=True)))

    def attended(self, query, visible, filled: int | None = None):
        return self.heads_first(query.shape[0]).attended(query, visible, filled)

    def written_and_attended(self, new: LayerCache, at, query, visible, filled: int | None = None):
        heads, queries, head_dim = query.shape
        if self.slot is None or queries != 1 or new.keys.shape[1] != 1:  # a prompt: XLA's path
            cache = self.written(*new, at)
            return cache.attended(query, visible, filled), cache
        upto = jnp.sum(visible[0]) - 1  # the last position this query sees
        query_row, key_row, value_row = (x.swapaxes(0, 1).reshape(-1) for x in (query, *new))  # (heads * head_dim,)
        mixed, keys, values = decode_kernels.attend(
            query_row, key_row, value_row, self.keys, self.values, at, upto, self.slot, filled or self.window, head_dim
        )
        return mixed.reshape(heads, 1, head_dim), RowsCache(keys, values, self.slot)


Cache = LayerCache | RowsCache  # a layer's keys and values as the model reads and writes them
