"""How the engine's slots keep their keys and values: chosen once, when the engine is made,
so that its compiled programs never ask which.

``SlotsApart``: each slot's cache its own (``LayerCache``, or ``SlotCache`` where a TPU
stores by select); a decode call cuts the first positions of the slots in flight out, advances
each slot under ``jax.vmap`` and puts the positions back. ``SharedRows``: the Pallas decode
kernels (``model/network/decode_kernels.py``), one cache all slots share, each slot storing
into and reading its own rows where they lie, nothing cut out or put back."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import jax
import jax.numpy as jnp
from jax.typing import DTypeLike

from ..model.network.caches import LayerCache, RowsCache
from ..model.network.decode_kernels import tile_rows
from .limits import ServingError
from .shapes import fills

# (token, position, a slot's caches) -> (logits, the caches written): the model's one step.
OneStep = Callable[..., tuple[jax.Array, tuple]]


class CacheLayout(Protocol):
    precision: str  # the decode products' (``jax.default_matmul_precision``)

    def laid_out(self, layer: LayerCache) -> LayerCache | RowsCache:
        """A layer's cache as ``init_cache`` makes it, in this layout."""
        ...

    def filled(self, fill: int) -> int | None:
        """What the model's call reads of a slot's cache: ``fill`` positions, or None where
        the part handed in holds only those."""
        ...

    def parts(self, caches: tuple, size: int, fill: int) -> tuple:
        """What a decode call advances: the first ``size`` slots' caches."""
        ...

    def advance(self, one: OneStep, tokens, positions, parts: tuple) -> tuple[jax.Array, tuple]:
        """Every slot one position further: (logits by slot, the parts written)."""
        ...

    def put_back(self, caches: tuple, parts: tuple) -> tuple:
        """The caches with the parts written back."""
        ...


class SlotsApart:
    """Each slot's cache its own; float32 products in full, as the sampler's, so that a
    request's bytes are the sampler's on a TPU too."""

    precision = "highest"

    def __init__(self, cache: type[LayerCache]):
        self.cache = cache

    def laid_out(self, layer: LayerCache) -> LayerCache:
        return self.cache.laid_out(layer)

    def filled(self, fill: int) -> None:
        return None

    def parts(self, caches: tuple, size: int, fill: int) -> tuple:
        return tuple(self.cache(*(half[:size] for half in layer)).first(fill) for layer in caches)

    def advance(self, one: OneStep, tokens, positions, parts: tuple) -> tuple[jax.Array, tuple]:
        return jax.vmap(one)(tokens, positions, parts)

    def put_back(self, caches: tuple, parts: tuple) -> tuple:
        return tuple(
            type(layer)(*(jax.lax.dynamic_update_slice(w, p, (0, 0, 0, 0)) for w, p in zip(layer, part, strict=True)))
            for layer, part in zip(caches, parts, strict=True)
        )


class SharedRows:
    """One cache the slots share, read and written by the decode kernels; three one-pass
    bfloat16 products, measured faster (the bytes the engine's own anyway, docs/serving.md)."""

    precision = "high"

    def __init__(self, window: int, dtype: DTypeLike):
        # The kernels read the cache in parts of whole tiles of positions, whose tile holding
        # a new key they store (8 positions, 16 in a bfloat16 cache): the context must split
        # so. Any multiple of four tiles does, as ``fills`` halves it.
        rows = tile_rows(dtype)
        if any(fill % rows for fill in fills(window)):
            raise ServingError(
                f"the decode kernels read and store the cache in tiles of {rows} positions, and this model's "
                f"context of {window} bytes is read in parts of {fills(window)}: serve it without the kernels, or "
                f"train a context that is a multiple of {4 * rows}"
            )

    def laid_out(self, layer: LayerCache) -> RowsCache:
        return RowsCache.laid_out(layer)

    def filled(self, fill: int) -> int:
        return fill

    def parts(self, caches: tuple, size: int, fill: int) -> tuple:
        return caches

    def advance(self, one: OneStep, tokens, positions, parts: tuple) -> tuple[jax.Array, tuple]:
        def slot_step(token, position, slot, caches):  # a slot's rows of the shared caches
            logits, written = one(token, position, tuple(RowsCache(layer.keys, layer.values, slot) for layer in caches))
            return logits, tuple(RowsCache(layer.keys, layer.values) for layer in written)

        slots = jnp.arange(tokens.shape[0])
        return jax.vmap(slot_step, (0, 0, 0, None), (0, None))(tokens, positions, slots, parts)

    def put_back(self, caches: tuple, parts: tuple) -> tuple:
        return parts
