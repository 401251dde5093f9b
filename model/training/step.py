"""The loss and the compiled train step: one device or data-parallel, with gradient
accumulation. The step works on ``nnx.split`` state with plain ``jax.jit`` and donated
buffers, so no NNX graph traversal happens per step."""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import nullcontext
from functools import lru_cache, partial
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ...config.settings import ModelConfig, TrainConfig
from ...errors import BardflowError
from ..network.transformer import Blocks, Transformer, build_model
from .optimizer import make_optimizer
from .placement import StateLayout
from .sharding import DATA_AXIS


class TrainingError(BardflowError, RuntimeError):
    """Training cannot go on; the message names the step and the cause."""


def target_losses(model: Transformer, tokens: jax.Array, blocks: Blocks = "unrolled", dropout_key=None) -> jax.Array:
    """(rows, length - 1): the loss of predicting each byte of the rows but the first from
    those before it. A row one byte longer than the model's context (``data.every_position``)
    is read without its last byte, which is only a target; otherwise the row is read whole
    and the last position's prediction dropped (causal: the same function, one shape for both).
    ``blocks``: how the model runs its blocks (``Transformer``; ``train.layers`` and
    ``train.remat``); ``dropout_key``: training's dropout (``model.dropout``)."""
    inputs = tokens if tokens.shape[1] <= model.max_seq_len else tokens[:, :-1]
    logits, _ = model(inputs, blocks=blocks, dropout_key=dropout_key)
    logits = logits[:, : tokens.shape[1] - 1].astype(jnp.float32)  # the loss is always taken in float32
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:])


def next_byte_loss(model: Transformer, tokens: jax.Array, blocks: Blocks = "unrolled", dropout_key=None) -> jax.Array:
    return target_losses(model, tokens, blocks, dropout_key).mean()


def dropout_key(model: Transformer, optimizer: nnx.Optimizer, seed: int, generator: str = "threefry2x32"):
    """The key of a training step's dropout: ``seed``'s, folded with the optimizer's step count,
    so that a resumed run draws what the uninterrupted one did; None without dropout.
    ``generator``: JAX's implementation of the random bits (``StepSettings.generator``)."""
    if model.dropout == 0:
        return None
    return jax.random.fold_in(jax.random.key(seed, impl=generator), optimizer.step[...])


def in_dtype(model: Transformer, dtype) -> Transformer:
    """The same model computing in ``dtype``: a cast of the float32 parameters, so the
    gradient flows back to them through the cast (mixed precision)."""
    if dtype == jnp.float32:
        return model
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    return nnx.merge(graphdef, jax.tree.map(lambda p: p.astype(dtype), params), rest)


def configured_rates(restored, configured):
    """``restored`` with ``configured``'s peak learning rates (in the optimizer's state since
    ``make_optimizer``): the configuration says how a run trains, its checkpoint where it stopped."""

    def pick(path, saved, ours):
        return ours if "'hyperparams'" in jax.tree_util.keystr(path) else saved

    return jax.tree_util.tree_map_with_path(pick, restored, configured)


def init_state(model_cfg: ModelConfig, train_cfg: TrainConfig):
    """(graphdef, state) of the model and its optimizer together, made in one compiled
    program (op by op, each initialiser would compile on its own)."""
    return nnx.split(_creator(model_cfg, train_cfg)())


def init_state_meanwhile(model_cfg: ModelConfig, train_cfg: TrainConfig) -> tuple[Any, Any, Future]:
    """``init_state`` on a thread: (graphdef, the state's shapes, the state's future), so that
    a run lowers and compiles its step from the shapes while the state's own program compiles
    and runs (on a TPU, seconds of a run's start)."""
    graphdef, shapes = nnx.split(nnx.eval_shape(_creator(model_cfg, train_cfg)))
    pool = ThreadPoolExecutor(1, "bardflow-init")
    try:
        return graphdef, shapes, pool.submit(lambda: init_state(model_cfg, train_cfg)[1])
    finally:
        pool.shutdown(wait=False)


@lru_cache(maxsize=16)
def _creator(model_cfg: ModelConfig, train_cfg: TrainConfig):
    """The compiled ``init_state`` of one configuration. Kept for the process, with the
    optimizer it builds, so that the runs of one process (a local sweep's, a resumed stage's)
    get equal graphdefs, and with them the same compiled step and evaluation, traced once
    (``make_train_step``, ``make_eval_sum``)."""

    @nnx.jit
    def create():
        model = build_model(model_cfg, train_cfg.init_seed)
        return model, nnx.Optimizer(model, make_optimizer(train_cfg), wrt=nnx.Param)

    return create


def model_from_state(graphdef, state) -> Transformer:
    model, _ = nnx.merge(graphdef, state)
    return model


def _accumulated(loss_fn, passes: int, mesh):
    """``(model, tokens, key) -> (loss, grads)`` over ``passes`` equal slices of every
    device's rows, summed in a ``lax.scan``: the mean loss and its gradient, exactly as
    one pass would give them up to float rounding. With a mesh each device works on its
    own rows and the gradients are averaged across devices once per step, not per pass.
    ``key`` (dropout, or None): folded with each pass's index, and each device's."""

    def local(graphdef, params, rest, tokens, key):
        slices = tokens.reshape(passes, tokens.shape[0] // passes, tokens.shape[1])
        if mesh is not None:
            # Per-device copies: their gradients stay on the device (no all-reduce per pass).
            params = jax.lax.pcast(params, (DATA_AXIS,), to="varying")
            key = None if key is None else jax.random.fold_in(key, jax.lax.axis_index(DATA_AXIS))

        def one(rows, index):
            pass_key = None if key is None else jax.random.fold_in(key, index)
            return jax.value_and_grad(lambda p: loss_fn(nnx.merge(graphdef, p, rest), rows, pass_key))(params)

        # The first pass starts the sums (its values carry the right per-device types).
        total, _ = jax.lax.scan(
            lambda total, pass_: (jax.tree.map(jnp.add, total, one(*pass_)), None),
            one(slices[0], 0),
            (slices[1:], jnp.arange(1, passes)),
        )
        total = jax.tree.map(lambda x: x / passes, total)
        return total if mesh is None else jax.lax.pmean(total, DATA_AXIS)

    def loss_and_grads(model, tokens, key):
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        run = partial(local, graphdef)
        if mesh is not None:
            # Parameters whole (under fsdp: gathered once for all passes, which the memory
            # estimate counts), each device's own rows.
            run = jax.shard_map(run, mesh=mesh, in_specs=(P(), P(), P(DATA_AXIS), P()), out_specs=P())
        return run(params, rest, tokens, key)

    return loss_and_grads


def _several(step, steps: int, unroll: bool):
    """``step`` as a call of several: written out, ``(state, tokens) -> (state, losses)`` over
    all ``steps`` stacked batches; or a loop, ``(state, tokens, count)``, over the first
    ``count`` of them (losses past ``count`` stay zero)."""

    def written_out(state, tokens):
        return jax.lax.scan(step, state, tokens, unroll=steps)

    def looped(state, tokens, count):
        def body(at, carried):
            state, losses = carried
            state, loss = step(state, tokens[at])
            return state, losses.at[at].set(loss)

        return jax.lax.fori_loop(0, count, body, (state, jnp.zeros(tokens.shape[0], jnp.float32)))

    return written_out if unroll else looped


@lru_cache(maxsize=16)
def make_train_step(  # noqa: PLR0913 - each argument part of the compiled step's cache key
    graphdef,
    state_sharding=None,
    batch_sharding=None,
    dtype=jnp.float32,
    passes: int = 1,
    remat: bool = False,
    steps: int = 0,
    unroll: bool = False,
    seed: int = 0,
    scanned: bool = False,
    generator: str = "threefry2x32",
):
    """The compiled step ``(state, tokens) -> (state, loss)``. ``state_sharding``: one
    sharding for the whole state, or a ``StateLayout`` (FSDP: each array split its own way,
    ``model/training/placement.py``; XLA gathers a parameter where it is used and reduces its
    gradient to the parts each device keeps).

    ``steps`` > 0: one call runs up to that many optimizer steps, ``(state, tokens, count) ->
    (state, losses)`` with the steps' batches stacked (steps, rows, length), the first
    ``count`` of them taken, and their losses (steps,; zero past ``count``), nothing read back
    between them, so a small step never waits on the host. The steps are a loop of the one
    step whose length is an argument, so that this one program takes a call cut short by a
    hook too and a run compiles no other step. ``unroll``: written out one after another,
    which lets a GPU launch them as one graph, at the cost of compiling each; then
    ``(state, tokens) -> (state, losses)`` takes all ``steps``, and a shorter call needs the
    one-step program. ``seed`` and ``generator``: dropout's (``dropout_key``). ``scanned``:
    the model's blocks as one loop (``train.layers``)."""

    blocks = "recomputed" if remat else "scanned" if scanned else "unrolled"

    def loss_fn(model, tokens, key):
        return next_byte_loss(in_dtype(model, dtype), tokens, blocks, key)

    mesh = None if batch_sharding is None else batch_sharding.mesh
    if passes == 1:
        loss_and_grads = nnx.value_and_grad(loss_fn)
    else:
        loss_and_grads = _accumulated(loss_fn, passes, mesh)

    def step(state, tokens):
        model, optimizer = nnx.merge(graphdef, state)
        loss, grads = loss_and_grads(model, tokens, dropout_key(model, optimizer, seed, generator))
        # The optimizer sees the mesh, so that Muon shares its matrices out among the devices.
        with (
            nullcontext() if mesh is None else jax.sharding.use_abstract_mesh(mesh.abstract_mesh),
            jax.named_scope("optimizer"),  # a profile's kind (bench/profile.py)
        ):
            optimizer.update(model, grads)
        return nnx.state((model, optimizer)), loss

    run = _several(step, steps, unroll) if steps else step
    if state_sharding is None or mesh is None:
        return jax.jit(run, donate_argnums=0)
    if isinstance(state_sharding, StateLayout):
        state_sharding = state_sharding.tree()
    inputs = (state_sharding, batch_sharding)
    if steps:
        inputs = (state_sharding, NamedSharding(mesh, P(None, DATA_AXIS)))
        inputs += () if unroll else (NamedSharding(mesh, P()),)
    return jax.jit(
        run,
        in_shardings=inputs,
        out_shardings=(state_sharding, NamedSharding(mesh, P())),
        donate_argnums=0,
    )
