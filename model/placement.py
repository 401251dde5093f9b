"""Where a training run's state and batches live: one device, or the data axis of a mesh."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from .optimizer import DATA_AXIS


@dataclass(frozen=True)
class Placement:
    """Where the state and the batches live: one device, or a ``data`` mesh."""

    devices: tuple
    state_sharding: Any = None
    batch_sharding: Any = None

    @classmethod
    def single(cls, device) -> Placement:
        return cls(devices=(device,))

    @classmethod
    def data_parallel(cls, devices) -> Placement:
        mesh = Mesh(np.array(devices), (DATA_AXIS,))
        return cls(
            devices=tuple(devices),
            state_sharding=NamedSharding(mesh, P()),
            batch_sharding=NamedSharding(mesh, P(DATA_AXIS)),
        )

    def put_state(self, state):
        if jax.process_count() == 1:
            return jax.device_put(state, self.state_sharding or self.devices[0])
        # Every process built the same initial state from the same seed: each fills in
        # the copies on its own devices, and together they make one replicated array.
        def replicate(x):
            local = np.asarray(x)
            return jax.make_array_from_callback(local.shape, self.state_sharding, lambda index: local[index])

        return jax.tree.map(replicate, state)

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
