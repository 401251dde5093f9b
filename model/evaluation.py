"""Validation loss: the batches, the compiled sum of losses, and the evaluation that the
training loop calls."""

from __future__ import annotations

from functools import lru_cache

import jax
import jax.numpy as jnp
import numpy as np

from .placement import Placement
from .step import model_from_state, target_losses


@lru_cache(maxsize=16)
def make_eval_sum(graphdef):
    """``(state, tokens, weights) -> sum of weight x row loss`` over stacked batches
    (batches, rows, length): rows of weight 0 pad the last batch. One program for the whole
    split: a batch per iteration keeps each pass cache-sized on a CPU, and a single launch per
    evaluation keeps XLA:CPU's queue of programs short. Dozens of small programs launched
    back to back once filled a device's queue of in-flight programs (32) while the other
    emulated device waited in an all-reduce, and with one client thread per core that wait
    could never end (docs/reliability.md, "Data-parallel training on emulated CPU devices")."""
    @jax.jit
    def eval_sum(state, tokens, weights):
        model = model_from_state(graphdef, state)

        def one(row_sums, batch):
            rows, row_weights = batch
            return row_sums + target_losses(model, rows).mean(axis=1) * row_weights, None

        row_sums, _ = jax.lax.scan(one, jnp.zeros(weights.shape[1:], jnp.float32), (tokens, weights))
        return jnp.sum(row_sums)  # across devices once, not once per batch

    return eval_sum


def make_evaluate(graphdef, val_batches: list[tuple[np.ndarray, np.ndarray]], placement: Placement):
    """``state -> loss on the whole validation split`` (every row once; None without one):
    the split placed once, the same rows every time, one program per evaluation."""
    eval_sum = make_eval_sum(graphdef)
    count = sum(float(weights.sum()) for _, weights in val_batches)
    if jax.process_count() > 1:  # each process holds its own rows' weights
        from jax.experimental import multihost_utils

        count = float(multihost_utils.process_allgather(np.float32(count)).sum())
    if not count:
        return lambda state: None
    rows = placement.put_batch(np.stack([rows for rows, _ in val_batches]), stacked=True)
    weights = placement.put_batch(np.stack([weights for _, weights in val_batches]), stacked=True)
    return lambda state: float(eval_sum(state, rows, weights)) / count


def val_batches(val: np.ndarray, batch_size: int, multiple: int = 1) -> list[tuple[np.ndarray, np.ndarray]]:
    """The whole validation split in batches of ``batch_size`` rows rounded to a multiple of
    ``multiple`` (the device count, so they shard evenly): (rows, weights) pairs, the last
    batch padded with rows of weight 0, so every row counts exactly once."""
    size = max(multiple, batch_size // multiple * multiple)
    batches = []
    for start in range(0, len(val), size):
        rows = val[start : start + size].astype(np.int32)
        weights = np.ones(size, np.float32)
        if len(rows) < size:
            weights[len(rows):] = 0.0
            rows = np.concatenate([rows, np.zeros((size - len(rows), val.shape[1]), np.int32)])
        batches.append((rows, weights))
    return batches
