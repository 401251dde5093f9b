"""Where a training run's state and batches live: one device, or the data axis of a mesh,
with the state whole on every device (replicated) or split over them (FSDP)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ..network.parameters import parameter_of
from .sharding import DATA_AXIS, parameter_mesh_axes


def state_spec(path, shape: tuple[int, ...], layout: str, mesh: dict[str, int]) -> P:
    """The partition of the state's array at key ``path``: a parameter's or its optimizer
    moment's by the rule table (``model/training/sharding.py``); whole for everything else
    (step counts, learning rates)."""
    name = parameter_of(_names(path))
    if name is None:
        return P()
    axes = list(parameter_mesh_axes(name, shape, layout, mesh))
    while axes and axes[-1] is None:  # P("data") rather than P("data", None): the same, one spelling
        axes.pop()
    return P(*axes)


def _names(path) -> tuple[str, ...]:
    """A key path's dictionary keys and sequence indices as text; attributes (a variable's
    ``.value``) left out: ``('blocks', '0', 'attn', 'qkv', 'kernel')``."""
    keys = []
    for key in path:
        if isinstance(key, jax.tree_util.DictKey | jax.tree_util.FlattenedIndexKey):
            keys.append(str(key.key))
        elif isinstance(key, jax.tree_util.SequenceKey):
            keys.append(str(key.idx))
    return tuple(keys)


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
    batches are split and the state is replicated or, with ``fsdp``, split by ``state_spec``."""

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
        mesh = self.state_sharding.mesh
        leaves, treedef = jax.tree_util.tree_flatten_with_path(state)
        return StateLayout(
            treedef,
            tuple(
                NamedSharding(mesh, state_spec(path, tuple(leaf.shape), self.layout, dict(mesh.shape)))
                for path, leaf in leaves
            ),
        )

    def state_target(self, state):
        """``state``'s shardings as a tree of the same structure (where to place or restore it)."""
        layout = self.shardings(state)
        if layout is None:
            return jax.tree.map(lambda _: jax.sharding.SingleDeviceSharding(self.devices[0]), state)
        return layout.tree() if isinstance(layout, StateLayout) else jax.tree.map(lambda _: layout, state)

    def placed_shapes(self, state):
        """``state``'s shapes (of arrays or of shapes alone) with the shardings ``put_state``
        gives them: what a program is lowered for before the state exists."""
        return jax.tree.map(
            lambda leaf, sharding: jax.ShapeDtypeStruct(
                leaf.shape, leaf.dtype, sharding=sharding, weak_type=getattr(leaf, "weak_type", False)
            ),
            state,
            self.state_target(state),
        )

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
