"""What a training step needs to know of the other processes of a run: process 0's answer
on every process, and which rows of a sharded batch this process holds."""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from ...errors import DistributedError


def broadcast_json(value: Any) -> Any:
    """Process 0's ``value`` (any JSON) on every process (the others pass None)."""
    import jax
    from jax.experimental import multihost_utils

    data = np.frombuffer(json.dumps(value).encode(), np.uint8) if jax.process_index() == 0 else np.zeros(0, np.uint8)
    size = int(multihost_utils.broadcast_one_to_all(np.int64(data.size)))
    buffer = np.zeros(size, np.uint8)
    buffer[: data.size] = data
    return json.loads(np.asarray(multihost_utils.broadcast_one_to_all(buffer)).tobytes())


def local_rows(sharding, global_rows: int) -> tuple[int, int]:
    """The contiguous rows ``[start, stop)`` of a batch sharded by ``sharding`` that live on
    this process's devices: the only rows this process reads."""
    import jax

    starts, stops = [], []
    for device, index in sharding.devices_indices_map((global_rows,)).items():
        if device.process_index == jax.process_index():
            rows = index[0]
            starts.append(rows.start or 0)
            stops.append(global_rows if rows.stop is None else rows.stop)
    start, stop = min(starts), max(stops)
    if stop - start != sum(b - a for a, b in set(zip(starts, stops, strict=True))):
        raise DistributedError("this process's devices hold rows that are not contiguous")
    return start, stop
