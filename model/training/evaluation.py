"""Validation loss: the batches, the compiled sum of losses, and the evaluation that the
training loop calls."""

from __future__ import annotations

from functools import lru_cache

import jax
import jax.numpy as jnp
import numpy as np

from .placement import Placement
from .step import model_from_state, target_losses

GROUP_TOKENS = 1 << 24  # validation tokens placed on the devices at a time (64 MiB as int32)
AUTO_EVAL_TOKENS = 1 << 20
EVAL_SEED = 0


@lru_cache(maxsize=16)
def make_eval_sum(graphdef, scanned: bool = False):
    """``(state, tokens, weights) -> sum of weight x row loss`` over stacked batches
    (batches, rows, length): rows of weight 0 pad the last batch. One program for the whole
    split: a batch per iteration keeps each pass cache-sized on a CPU, and a single launch per
    evaluation keeps XLA:CPU's queue of programs short. Dozens of small programs launched
    back to back once filled a device's queue of in-flight programs (32) while the other
    emulated device waited in an all-reduce, and with one client thread per core that wait
    could never end (docs/reliability.md, "Data-parallel training on emulated CPU devices").
    ``scanned``: the model's blocks as one loop, as the training step runs them."""

    @jax.jit
    def eval_sum(state, tokens, weights):
        model = model_from_state(graphdef, state)

        def one(row_sums, batch):
            rows, row_weights = batch
            return row_sums + target_losses(model, rows, "scanned" if scanned else "unrolled").mean(
                axis=1
            ) * row_weights, None

        row_sums, _ = jax.lax.scan(one, jnp.zeros(weights.shape[1:], jnp.float32), (tokens, weights))
        return jnp.sum(row_sums)  # across devices once, not once per batch

    return eval_sum


class Evaluation:
    """``state -> loss on the evaluated rows`` (every row once; None without one). Rows of at
    most ``group_tokens`` are placed at a time: the usual case is one group, placed once and
    kept, one program per evaluation; more (a large ``train.eval_rows``) are placed in turn
    at each evaluation, each padded to the same batches so one program serves them all."""

    def __init__(
        self,
        graphdef,
        val_batches: list[tuple[np.ndarray, np.ndarray]],
        placement: Placement,
        group_tokens: int = GROUP_TOKENS,
        scanned: bool = False,
    ):
        self.eval_sum = make_eval_sum(graphdef, scanned)
        self.placement = placement
        count = sum(float(weights.sum()) for _, weights in val_batches)
        if jax.process_count() > 1:  # each process holds its own rows' weights
            from jax.experimental import multihost_utils

            count = float(multihost_utils.process_allgather(np.float32(count)).sum())
        self.count = count
        self.groups: list = []
        self.placed = None  # the one group's rows and weights, placed once
        if not count:
            return
        per_group = max(1, group_tokens // max(1, val_batches[0][0].size))
        groups = [val_batches[at : at + per_group] for at in range(0, len(val_batches), per_group)]
        if len(groups) > 1 and len(groups[-1]) < per_group:  # batches of weight 0: every group one shape
            rows, weights = groups[-1][0]
            groups[-1] = groups[-1] + [(np.zeros_like(rows), np.zeros_like(weights))] * (per_group - len(groups[-1]))
        self.groups = groups
        if len(groups) == 1:
            self.placed = self._place(groups[0])

    def _place(self, group):
        return (
            self.placement.put_batch(np.stack([rows for rows, _ in group]), stacked=True),
            self.placement.put_batch(np.stack([weights for _, weights in group]), stacked=True),
        )

    def lowered(self, state) -> jax.stages.Lowered | None:
        """The evaluation's program for ``state``, to compile ahead (its jitted call then finds
        it compiled); None without rows."""
        if not self.groups:
            return None
        return self.eval_sum.lower(state, *(self.placed or self._place(self.groups[0])))

    def __call__(self, state) -> float | None:
        if not self.count:
            return None
        if self.placed is not None:
            return float(self.eval_sum(state, *self.placed)) / self.count
        return sum(float(self.eval_sum(state, *self._place(group))) for group in self.groups) / self.count


def eval_choice(num_rows: int, limit: int, seed: int = EVAL_SEED) -> np.ndarray | None:
    """Which validation rows are evaluated when the split has more than ``limit``: a fixed,
    seeded choice, sorted (reads run forward through the shards); None for all of them. The
    same for every run of the same data, so their losses compare."""
    if num_rows <= limit:
        return None
    return np.sort(np.random.default_rng(seed).choice(num_rows, size=limit, replace=False))


def eval_limit(eval_rows: int, global_batch: int, row: int) -> int:
    """``train.eval_rows``, or for 0 (auto) what one evaluation of about ten steps' cost holds:
    a forward pass is about a third of a training step's forward and backward, so 30 global
    batches, and never fewer rows than a MiB of tokens (TinyShakespeare's whole split)."""
    return eval_rows or max(30 * global_batch, AUTO_EVAL_TOKENS // row)


def val_batches(val, batch_size: int, multiple: int = 1) -> list[tuple[np.ndarray, np.ndarray]]:
    """The validation rows (an array, or the split's ``Rows``) in batches of ``batch_size``
    rows rounded to a multiple of ``multiple`` (the device count, so they shard evenly):
    (rows, weights) pairs, the last
    batch padded with rows of weight 0, so every row counts exactly once."""
    size = max(multiple, batch_size // multiple * multiple)
    batches = []
    for start in range(0, len(val), size):
        rows = val[start : start + size].astype(np.int32)
        weights = np.ones(size, np.float32)
        if len(rows) < size:
            weights[len(rows) :] = 0.0
            rows = np.concatenate([rows, np.zeros((size - len(rows), val.shape[1]), np.int32)])
        batches.append((rows, weights))
    return batches
