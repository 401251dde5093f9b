"""The optimizers: AdamW (the codelab's), or Muon for the blocks' weight matrices with AdamW
for the rest, on a schedule, after optional clipping.

Muon is optax's, assembled here from its public parts as ``optax.contrib.muon`` assembles
it (the same state, so checkpoints carry over; the same numbers up to float rounding), for
two reasons (``split_among_devices``): on several data-parallel devices each device
orthogonalises only its share of the matrices and the devices then exchange the results,
instead of every device computing every matrix's Newton-Schulz iterations; and the matrices
of one shape go through those iterations together, as one batch, in a loop: optax writes
its iterations out one after another, and XLA then compiles each iteration's products apart
(docs/tpu-check.md, "Where the quality step's compile time goes").
"""

from __future__ import annotations

from functools import lru_cache

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P
from optax.contrib import MuonDimensionNumbers, MuonState, scale_by_muon

from ...config.settings import TrainConfig
from .sharding import DATA_AXIS

# Muon orthogonalises the update of a weight matrix that maps features to features; the
# embedding tables and the head map ids to features and back, and stay with AdamW.
_NOT_MUON = ("token_embed", "pos_embed", "lm_head")


def learning_rate(cfg: TrainConfig, peak: float | None = None) -> float | optax.Schedule:
    """The learning rate by step: constant (after any warmup), or warmup then cosine decay
    to the floor at the last step. The step count lives in the optimizer state, so a resumed
    run continues the schedule where it stopped. ``peak``: another peak, same shape."""
    peak = cfg.learning_rate if peak is None else peak
    if cfg.schedule == "cosine":
        return optax.warmup_cosine_decay_schedule(
            0.0, peak, cfg.warmup_steps, cfg.steps, peak * cfg.min_learning_rate_fraction
        )
    if cfg.warmup_steps:
        return optax.join_schedules(
            [optax.linear_schedule(0.0, peak, cfg.warmup_steps), optax.constant_schedule(peak)], [cfg.warmup_steps]
        )
    return peak


def muon_labels(params):
    """``"muon"`` for the blocks' weight matrices, ``"adam"`` for everything else."""

    def label(path, leaf):
        names = {str(getattr(key, "key", getattr(key, "name", key))) for key in path}
        return "muon" if leaf.ndim == 2 and not names & set(_NOT_MUON) else "adam"

    return jax.tree_util.tree_map_with_path(label, params)


def _newton_schulz_cost(shape: tuple[int, ...]) -> int:
    """Multiply-adds of one Newton-Schulz iteration on a matrix (optax works on the wide
    orientation): X X^T, its square, and that times X."""
    rows, cols = sorted(shape)
    return rows * rows * (2 * cols + rows)


def share_out(costs: list[int], devices: int) -> list[int]:
    """The device of each item: the costliest first, each to the least loaded device
    (ties to the lower index), so the devices finish together."""
    loads, owners = [0] * devices, [0] * len(costs)
    for item in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        owner = min(range(devices), key=lambda d: (loads[d], d))
        owners[item], loads[owner] = owner, loads[owner] + costs[item]
    return owners


def _by_shape(
    core, state: MuonState, ns_steps: int, grads: list, moments: list, chosen: list[int]
) -> tuple[dict, dict]:
    """``core`` on the ``chosen`` matrices, those of one shape stacked (every layer's query
    projection, say): one batched orthogonalisation per shape instead of one per matrix, which
    is fewer and larger matrix products. Its ``ns_steps`` iterations a loop: given a row of
    coefficients per iteration (the same row each, as stored), optax scans over them instead
    of writing them out. Returns the updates and the moments by index."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for i in chosen:
        groups.setdefault(grads[i].shape, []).append(i)
    out, new = core.update(
        [jnp.stack([grads[i] for i in g]) for g in groups.values()],
        state._replace(
            mu=[jnp.stack([moments[i] for i in g]) for g in groups.values()],
            ns_coeffs=jnp.broadcast_to(jnp.asarray(state.ns_coeffs), (ns_steps, 3)),  # (3,): a, b, c
        ),
    )
    outs, mus = {}, {}
    for g, o, m in zip(groups.values(), out, new.mu, strict=True):
        for j, i in enumerate(g):
            outs[i], mus[i] = o[j], m[j]
    return outs, mus


def split_among_devices(
    core: optax.GradientTransformation, ns_steps: int, axis: str = DATA_AXIS
) -> optax.GradientTransformation:
    """``core`` (``scale_by_muon``) on the matrices, stacked by shape, with its
    orthogonalisations shared out among the devices of the enclosing mesh's ``axis``: each
    device computes its share of the matrices, then one all-reduce (of exact zeros but for
    each matrix's own device) gives every device all of them. The momentum, elementwise and
    cheap, is computed by every device, so the state stays replicated (XLA drops the unused
    orthogonalisations there). Without such a mesh, or with one device on it, one device
    computes them all."""

    def update(updates, state, params=None):  # state: a MuonState
        del params
        mesh = jax.sharding.get_abstract_mesh()
        devices = 1 if mesh.empty or axis not in mesh.axis_names else mesh.shape[axis]
        grads, tree = jax.tree.flatten(updates)  # the leaves of other labels are masked: none here
        moments = tree.flatten_up_to(state.mu)
        outs, mus = _by_shape(core, state, ns_steps, grads, moments, list(range(len(grads))))
        new = state._replace(
            count=optax.safe_increment(state.count), mu=tree.unflatten([mus[i] for i in range(len(grads))])
        )
        if devices == 1 or len(grads) < 2:
            return tree.unflatten([outs[i] for i in range(len(grads))]), new
        owners = share_out([_newton_schulz_cost(g.shape) for g in grads], devices)

        def on(device: int):
            mine = [i for i, owner in enumerate(owners) if owner == device]

            def compute(grads, moments):
                share = _by_shape(core, state, ns_steps, grads, moments, mine)[0]
                return [share[i] if i in share else jnp.zeros_like(g) for i, g in enumerate(grads)]

            return compute

        def each_device(grads, moments):
            share = jax.lax.switch(jax.lax.axis_index(axis), [on(d) for d in range(devices)], grads, moments)
            return jax.lax.psum(share, axis)

        out = jax.shard_map(each_device, in_specs=P(), out_specs=P())(grads, moments)
        return tree.unflatten(out), new

    return optax.GradientTransformation(core.init, update)


def _matrices(updates):
    """Every leaf a matrix, or a stack of them along the leading axes: rows reduced (x @ w)."""
    return jax.tree.map(lambda u: MuonDimensionNumbers(reduction_axis=u.ndim - 2, output_axis=u.ndim - 1), updates)


def _scale_by_shape() -> optax.GradientTransformation:
    """Muon's width scaling (Keller Jordan's): sqrt(max(1, fan_out / fan_in))."""
    return optax.stateless(
        lambda updates, params: jax.tree.map(lambda u: u * jnp.sqrt(jnp.maximum(1, u.shape[1] / u.shape[0])), updates)
    )


def muon(learning_rate, adam_learning_rate, ns_steps: int, beta2: float, weight_decay: float):
    """``optax.contrib.muon`` with the blocks' matrices (``muon_labels``) on Muon and the rest
    on AdamW, its defaults otherwise (Nesterov momentum 0.95, AdamW's Nesterov too)."""
    core = scale_by_muon(ns_steps=ns_steps, weight_dimension_numbers=_matrices)
    return optax.partition(
        {
            "muon": optax.chain(
                split_among_devices(core, ns_steps),
                _scale_by_shape(),
                optax.add_decayed_weights(weight_decay),
                optax.scale_by_learning_rate(learning_rate),
            ),
            "adam": optax.adamw(adam_learning_rate, b2=beta2, weight_decay=weight_decay, nesterov=True),
        },
        muon_labels,
    )


@lru_cache(
    maxsize=32
)  # one per configuration: equal optimizers make equal graphdefs (model/training/step.py, _creator)
def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    """AdamW (or Muon for the blocks' matrices) on ``learning_rate(cfg)``, after clipping the
    gradient's global norm if asked. The peak learning rates are values in the optimizer's
    state (``optax.inject_hyperparams``), not constants of the compiled step: the runs of a
    sweep or search over them compile one step; the schedule's shape (warmup, cosine) then
    scales the update."""
    if cfg.optimizer == "muon":

        def muon_at(learning_rate, adam_learning_rate):
            return muon(learning_rate, adam_learning_rate, cfg.muon_ns_steps, cfg.beta2, cfg.weight_decay)

        tx = optax.inject_hyperparams(muon_at)(
            learning_rate=cfg.muon_learning_rate, adam_learning_rate=cfg.learning_rate
        )
    else:

        def adamw_at(learning_rate):
            return optax.adamw(learning_rate, b2=cfg.beta2, weight_decay=cfg.weight_decay)

        tx = optax.inject_hyperparams(adamw_at)(learning_rate=cfg.learning_rate)
    shape = learning_rate(cfg, peak=1.0)
    if callable(shape):  # a schedule (warmup, cosine), not a constant
        tx = optax.chain(tx, optax.scale_by_schedule(shape))
    return optax.chain(optax.clip_by_global_norm(cfg.grad_clip), tx) if cfg.grad_clip else tx
