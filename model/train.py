"""Loss, the compiled train step (one device or data-parallel), and the timed loop.

The step works on ``nnx.split`` state with plain ``jax.jit`` and donated buffers,
so no NNX graph traversal happens per step.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from functools import lru_cache, partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from .config import ModelConfig, TrainConfig
from .errors import BardflowError
from .optimizer import DATA_AXIS, make_optimizer
from .settings import StepSettings, resolve
from .transformer import Transformer, build_model


class TrainingError(BardflowError, RuntimeError):
    """Training cannot go on; the message names the step and the cause."""


def target_losses(model: Transformer, tokens: jax.Array) -> jax.Array:
    """(rows, length - 1): the loss of predicting each byte of the rows but the first from
    those before it. A row one byte longer than the model's context (``data.every_position``)
    is read without its last byte, which is only a target; otherwise the row is read whole
    and the last position's prediction dropped (causal: the same function, one shape for both)."""
    inputs = tokens if tokens.shape[1] <= model.max_seq_len else tokens[:, :-1]
    logits, _ = model(inputs)
    logits = logits[:, : tokens.shape[1] - 1].astype(jnp.float32)  # the loss is always taken in float32
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:])


def next_byte_loss(model: Transformer, tokens: jax.Array) -> jax.Array:
    return target_losses(model, tokens).mean()


def in_dtype(model: Transformer, dtype) -> Transformer:
    """The same model computing in ``dtype``: a cast of the float32 parameters, so the
    gradient flows back to them through the cast (mixed precision)."""
    if dtype == jnp.float32:
        return model
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    return nnx.merge(graphdef, jax.tree.map(lambda p: p.astype(dtype), params), rest)


def _configured_rates(restored, configured):
    """``restored`` with ``configured``'s peak learning rates (in the optimizer's state since
    ``make_optimizer``): the configuration says how a run trains, its checkpoint where it stopped."""
    def pick(path, saved, ours):
        return ours if "'hyperparams'" in jax.tree_util.keystr(path) else saved

    return jax.tree_util.tree_map_with_path(pick, restored, configured)


def init_state(model_cfg: ModelConfig, train_cfg: TrainConfig):
    """(graphdef, state) of the model and its optimizer together, made in one compiled
    program (op by op, each initialiser would compile on its own)."""
    return nnx.split(_creator(model_cfg, train_cfg)())


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
    """``(model, tokens) -> (loss, grads)`` over ``passes`` equal slices of every
    device's rows, summed in a ``lax.scan``: the mean loss and its gradient, exactly as
    one pass would give them up to float rounding. With a mesh each device works on its
    own rows and the gradients are averaged across devices once per step, not per pass."""

    def local(graphdef, params, rest, tokens):
        slices = tokens.reshape(passes, tokens.shape[0] // passes, tokens.shape[1])
        if mesh is not None:
            # Per-device copies: their gradients stay on the device (no all-reduce per pass).
            params = jax.lax.pcast(params, (DATA_AXIS,), to="varying")

        def one(rows):
            return jax.value_and_grad(lambda p: loss_fn(nnx.merge(graphdef, p, rest), rows))(params)

        # The first pass starts the sums (its values carry the right per-device types).
        total, _ = jax.lax.scan(lambda total, rows: (jax.tree.map(jnp.add, total, one(rows)), None),
                                one(slices[0]), slices[1:])
        total = jax.tree.map(lambda x: x / passes, total)
        return total if mesh is None else jax.lax.pmean(total, DATA_AXIS)

    def loss_and_grads(model, tokens):
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        run = partial(local, graphdef)
        if mesh is not None:
            run = jax.shard_map(run, mesh=mesh, in_specs=(P(), P(), P(DATA_AXIS)), out_specs=P())
        return run(params, rest, tokens)

    return loss_and_grads


@lru_cache(maxsize=16)
def make_train_step(graphdef, state_sharding=None, batch_sharding=None, dtype=jnp.float32, passes: int = 1):
    def loss_fn(model, tokens):
        return next_byte_loss(in_dtype(model, dtype), tokens)

    mesh = None if batch_sharding is None else batch_sharding.mesh
    if passes == 1:
        loss_and_grads = nnx.value_and_grad(loss_fn)
    else:
        loss_and_grads = _accumulated(loss_fn, passes, mesh)

    def step(state, tokens):
        model, optimizer = nnx.merge(graphdef, state)
        loss, grads = loss_and_grads(model, tokens)
        # The optimizer sees the mesh, so that Muon shares its matrices out among the devices.
        with nullcontext() if mesh is None else jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            optimizer.update(model, grads)
        return nnx.state((model, optimizer)), loss

    if state_sharding is None:
        return jax.jit(step, donate_argnums=0)
    return jax.jit(
        step,
        in_shardings=(state_sharding, batch_sharding),
        out_shardings=(state_sharding, NamedSharding(batch_sharding.mesh, P())),
        donate_argnums=0,
    )


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


@dataclass
class TrainResult:
    state: Any
    history: list[dict[str, float]]
    compile_s: float
    elapsed_s: float  # timed steps only, summed over every session of a resumed run
    steps: int
    global_batch: int
    seq_len: int
    val_loss: float = math.nan
    devices: int = 1
    resumed_from: int | None = None  # the step a checkpoint brought this run back to
    resume_s: float = 0.0  # time to find and restore that checkpoint
    precision: str = "float32"  # the compute dtype; parameters are always float32
    rows_per_pass: int = 0  # rows of each device's batch per forward/backward pass

    @property
    def tokens_per_s(self) -> float:
        return self.steps * self.global_batch * (self.seq_len - 1) / self.elapsed_s

    @property
    def ms_per_step(self) -> float:
        return 1e3 * self.elapsed_s / self.steps

    def metrics(self) -> dict[str, Any]:
        last = self.history[-1]
        return {
            "tokens_per_s": round(self.tokens_per_s, 1),
            "ms_per_step": round(self.ms_per_step, 3),
            "final_loss": round(last["loss"], 4),
            "val_loss": round(self.val_loss, 4),  # the whole validation split
            "val_bpb": round(self.val_loss / math.log(2), 4),  # bits per byte
            "steps": self.steps,
            "global_batch": self.global_batch,
            "devices": self.devices,
            "compile_s": round(self.compile_s, 3),
            "elapsed_s": round(self.elapsed_s, 3),
            "resumed_from_step": self.resumed_from,
            "resume_s": round(self.resume_s, 3),
            "precision": self.precision,
            "rows_per_pass": self.rows_per_pass,
        }


@jax.jit
def _all_finite(tree) -> jax.Array:
    leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating)]
    return jnp.all(jnp.stack(leaves))


@dataclass
class RunRecord:
    """What the hooks keep of a run: its history, its newest checkpoint and its training
    clock (which leaves out the time the hooks spend evaluating)."""

    history: list[dict[str, Any]]
    checkpoints: Any = None  # TrainingCheckpoints, or None: nothing is saved
    last_saved: int | None = None
    prior_s: float = 0.0  # trained before this session (a resumed run)
    started: float = 0.0
    paused_s: float = 0.0

    def trained_s(self) -> float:
        return self.prior_s + time.perf_counter() - self.started - self.paused_s

    @contextmanager
    def paused(self):
        paused = time.perf_counter()
        try:
            yield
        finally:
            self.paused_s += time.perf_counter() - paused

    def check_loss(self, step: int, loss: jax.Array) -> float:
        value = float(loss)
        if not math.isfinite(value):
            kept = f"; the checkpoint of step {self.last_saved} is kept" if self.last_saved else ""
            raise TrainingError(f"loss became {value} at step {step}{kept}; lower train.learning_rate")
        return value

    def save(self, info: StepInfo) -> int | None:
        """The one way a checkpoint is written: of the state after ``info``'s step, once its
        loss and parameters are known to be finite. Returns the newest saved step."""
        if self.checkpoints is None or info.done <= (self.last_saved or 0):
            return self.last_saved
        self.check_loss(info.step, info.loss)
        if not bool(_all_finite(info.state)):
            raise TrainingError(f"parameters became non-finite at step {info.step}; the checkpoint of step "
                                f"{self.last_saved} is kept; lower train.learning_rate")
        # A copy of the history: the save is asynchronous and the loop keeps appending to it.
        self.checkpoints.save(info.done, info.state, {"step": info.done, "history": list(self.history),
                                                      "elapsed_s": self.trained_s(), "data_position": info.done})
        self.last_saved = info.done
        return self.last_saved


@dataclass(frozen=True)
class StepInfo:
    """One step just taken, as every hook sees it."""

    step: int  # 0-based
    last: int  # the run ends after step last - 1
    loss: jax.Array  # still on the device: reading it waits for the step
    state: Any
    tokens: int  # trained on so far
    record: RunRecord

    @property
    def done(self) -> int:
        return self.step + 1


@dataclass(frozen=True)
class Hook:
    """``run(info)`` after every step for which ``when(info)`` holds."""

    run: Callable[[StepInfo], None]
    when: Callable[[StepInfo], bool] = lambda info: True


def every(n: int, and_last: bool = False) -> Callable[[StepInfo], bool]:
    """After steps 0, n, 2n, ... (and after the run's last step, with ``and_last``)."""
    return lambda info: info.step % n == 0 or (and_last and info.done == info.last)


def run_steps(step_fn, state, tokens_at: Callable[[int], jax.Array], steps: range, tokens_per_step: int,
              hooks: Sequence[Hook], record: RunRecord):
    """The training loop: a step, then each hook that is due, in order."""
    for step in steps:
        state, loss = step_fn(state, tokens_at(step))
        info = StepInfo(step, steps.stop, loss, state, (step + 1) * tokens_per_step, record)
        for hook in hooks:
            if hook.when(info):
                hook.run(info)
    return state


def finite_loss_hook() -> Hook:
    """Each step's loss is read once the next step is queued, so that reading it never
    leaves the device idle (the last step's is read by its evaluation)."""
    pending: list[StepInfo] = []

    def check(info: StepInfo) -> None:
        if pending:
            info.record.check_loss(pending[0].step, pending[0].loss)
        pending[:] = [info]

    return Hook(check)


def evaluation_hook(evaluate: Callable[[Any], float | None], every_n: int, eval_every: int = 0) -> Hook:
    """A history record every ``every_n`` steps and after the last, with the validation loss
    on the whole split every ``eval_every`` steps (0: in every record) and after the last
    (its time left out of the clock); a record between evaluations has none."""
    recorded, evaluated = every(every_n, and_last=True), every(eval_every or every_n, and_last=True)

    def record(info: StepInfo) -> None:
        value = info.record.check_loss(info.step, info.loss)
        trained_s = info.record.trained_s()
        val_loss = None
        if evaluated(info):
            with info.record.paused():
                val_loss = evaluate(info.state)
        info.record.history.append({"step": info.step, "loss": value, "perplexity": math.exp(min(value, 50.0)),
                                    "tokens": info.tokens, "val_loss": val_loss,
                                    "val_bpb": None if val_loss is None else val_loss / math.log(2),
                                    "seconds": round(trained_s, 3)})

    return Hook(record, lambda info: recorded(info) or evaluated(info))


def checkpoint_hook(every_n: int) -> Hook:
    """A resumable checkpoint after every ``every_n`` steps but the last (the stage saves that one)."""
    return Hook(lambda info: info.record.save(info), lambda info: info.done % every_n == 0 and info.done < info.last)


def progress_hook(on_step: Callable[[int, int], None]) -> Hook:
    return Hook(lambda info: on_step(info.done, info.last))


def train(
    graphdef,
    state,
    batch_at: Callable[[int], np.ndarray],
    val_batches: list[np.ndarray],
    placement: Placement,
    cfg: TrainConfig,
    on_step: Callable[[int, int], None] | None = None,
    checkpoints=None,
    stop_after: int | None = None,
    step: StepSettings | None = None,
    hooks: Sequence[Hook] = (),
) -> TrainResult:
    """Runs steps until ``cfg.steps`` (or the first ``stop_after`` of its schedule), first
    resuming from the newest checkpoint in ``checkpoints`` if there is one. After each step
    the hooks run: the loss check, a history record every ``cfg.log_every`` steps (with the
    validation loss every ``cfg.eval_every``), a checkpoint every ``cfg.checkpoint_every``,
    ``on_step``, then ``hooks`` (the caller's: a stop signal, a metrics writer). ``step``: how
    the step runs (``model/settings.py``; by default the platform's defaults for ``cfg``).

    The batch of step ``s`` is ``batch_at(s)`` and training draws no random numbers,
    so a resumed run repeats the uninterrupted one exactly. Compilation happens ahead
    of time and is timed apart: it never counts against throughput or consumes a step.
    """
    last = min(stop_after or cfg.steps, cfg.steps)
    record, start, resumed_from, resume_s = RunRecord([], checkpoints), 0, None, 0.0
    state = placement.put_state(state)
    if checkpoints is not None:
        started = time.perf_counter()
        configured = jax.tree.map(lambda leaf: leaf, state)  # the restore writes into ``state``'s variables
        found = checkpoints.latest(state)  # restored straight into the placed state's shardings
        if found is not None:
            state, saved = _configured_rates(found[0], configured), found[1]
            start, record.history, record.prior_s = saved["step"], saved["history"], saved["elapsed_s"]
            record.last_saved, resumed_from, resume_s = start, start, time.perf_counter() - started
    first = placement.put_batch(batch_at(start))
    global_batch, seq_len = first.shape
    step = step or resolve(None, cfg, seq_len, placement.devices[0].platform)
    dtype, passes = jnp.dtype(step.precision), step.passes(cfg.per_device_batch)
    started = time.perf_counter()
    compiled = make_train_step(graphdef, placement.state_sharding, placement.batch_sharding, dtype, passes).lower(
        state, first).compile(compiler_options=step.xla_options)
    compile_s = time.perf_counter() - started

    def tokens_at(step: int) -> jax.Array:
        return first if step == start else placement.put_batch(batch_at(step))

    builtin = [finite_loss_hook(), evaluation_hook(make_evaluate(graphdef, val_batches, placement), cfg.log_every,
                                                   cfg.eval_every)]
    builtin += [checkpoint_hook(cfg.checkpoint_every)] if checkpoints is not None else []
    builtin += [progress_hook(on_step)] if on_step is not None else []
    record.started = time.perf_counter()
    state = run_steps(compiled, state, tokens_at, range(start, last), global_batch * (seq_len - 1),
                      [*builtin, *hooks], record)
    jax.block_until_ready(state)
    return TrainResult(
        state=state, history=record.history, compile_s=compile_s, elapsed_s=record.trained_s(), steps=last,
        global_batch=global_batch, seq_len=seq_len,
        val_loss=math.nan if record.history[-1]["val_loss"] is None else record.history[-1]["val_loss"],
        devices=len(placement.devices), resumed_from=resumed_from, resume_s=resume_s, precision=dtype.name,
        rows_per_pass=step.rows_per_pass,
    )


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
