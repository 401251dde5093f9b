"""Where a training run's state and batches live: one device, or the data axis of a mesh,
with the state whole on every device (replicated) or split over them (FSDP)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from .memory import fsdp_dim
from .optimizer import DATA_AXIS


def fsdp_spec(shape: tuple[int, ...], devices: int) -> P:
    """An array's partition under FSDP: split over the data axis along ``fsdp_dim``'s
    dimension (the one rule, ``model/training/memory.py``), or replicated."""
    dim = fsdp_dim(shape, devices)
    return P() if dim is None else P(*([None] * dim), DATA_AXIS)


@dataclass(frozen=True)
class StateLayout:
    """One sharding per array of a state, hashable (a compiled step is kept per layout)."""

    treedef: Any
    shardings: tuple

    def tree(self):
        return jax.tree.unflatten(self.treedef, self.shardings)


@dataclass(frozen=True)
class Placement:
    """Where the state and the batches live: one device, or a ``data`` mesh over which the
    batches are split and the state is replicated or, with ``fsdp``, split by ``fsdp_spec``."""

    devices: tuple
    state_sharding: Any = None  # replicated: one sharding for every array
    batch_sharding: Any = None
    fsdp: bool = False

    @classmethod
    def single(cls, device) -> Placement:
        return cls(devices=(device,))

    @classmethod
    def data_parallel(cls, devices, fsdp: bool = False) -> Placement:
        mesh = Mesh(np.array(devices), (DATA_AXIS,))
        return cls(
            devices=tuple(devices),
            state_sharding=NamedSharding(mesh, P()),
            batch_sharding=NamedSharding(mesh, P(DATA_AXIS)),
            fsdp=fsdp and len(devices) > 1,
        )

    @property
    def layout(self) -> str:
        return "fsdp" if self.fsdp else "replicated" if self.batch_sharding is not None else "single"

    def shardings(self, state) -> Any:
        """The state's shardings: one for all arrays, or (FSDP) a ``StateLayout`` of each's
        own; None on one device."""
        if not self.fsdp:
            return self.state_sharding
        mesh, count = self.state_sharding.mesh, len(self.devices)
        leaves, treedef = jax.tree.flatten(state)
        return StateLayout(treedef, tuple(NamedSharding(mesh, fsdp_spec(tuple(leaf.shape), count)) for leaf in leaves))

    def state_target(self, state):
        """``state``'s shardings as a tree of the same structure (where to place or restore it)."""
        layout = self.shardings(state)
        if layout is None:
            return jax.tree.map(lambda _: jax.sharding.SingleDeviceSharding(self.devices[0]), state)
        return layout.tree() if isinstance(layout, StateLayout) else jax.tree.map(lambda _: layout, state)

    def put_state(self, state):
        target = self.state_target(state)
        if jax.process_count() == 1:
            return jax.device_put(state, target)

        # Every process built the same initial state from the same seed: each fills in
        # the parts on its own devices, and together they make one global array.
        def place(x, sharding):
            local = np.asarray(x)
            return jax.make_array_from_callback(local.shape, sharding, lambda index: local[index])

        return jax.tree.map(place, state, target)

    def rows(self, global_rows: int) -> tuple[int, int]:
        """The rows ``[start, stop)`` of every global batch that this process supplies."""
        if jax.process_count() == 1:
            return 0, global_rows
        from .multihost import local_rows

        return local_rows(self.batch_sharding, global_rows)

    def put_batch(self, batch: np.ndarray, stacked: bool = False):
        """``batch`` is this process's rows (all of them when there is one process);
        ``stacked``: batches of rows, (batches, rows, …), each batch split like one."""
        if self.batch_sharding is None:
            return jax.device_put(batch, self.devices[0])
        sharding = NamedSharding(self.batch_sharding.mesh, P(None, DATA_AXIS)) if stacked else self.batch_sharding
        return jax.make_array_from_process_local_data(sharding, batch)
