"""The timed training loop: its programs compiled ahead, calls of one step or several, and
after each step the hooks (``hooks.py``: progress, evaluation, checkpoints, a finite loss),
each run every N steps."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ...config.settings import TrainConfig
from .compiling import CompileCount, compile_all, compiled_so_far
from .evaluation import Evaluation
from .hooks import (
    CallLosses,
    Hook,
    RunRecord,
    StepInfo,
    best_hook,
    bits_per_byte,
    checkpoint_hook,
    evaluation_hook,
    every,
    finite_loss_hook,
    progress_hook,
)
from .memory import check_compiled_fits, free_bytes, step_memory
from .placement import Placement
from .run_records import HistoryEntry, KeptState, Layout, StepMetrics
from .step import configured_rates, make_train_step, model_from_state
from .step_settings import StepSettings, resolve


@dataclass
class TrainResult:
    state: Any
    history: list[HistoryEntry]
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
    layout: str = "single"  # single, replicated or fsdp (model/training/placement.py)
    memory: dict[str, int] | None = None  # the compiled step's per-device bytes (model/training/memory.py)
    resumed_layout: Layout | None = None  # the devices and layout of the checkpoint resumed from
    kept: KeptState | None = None  # train.keep=best: the evaluated step whose state this is
    compiles: CompileCount = CompileCount()  # what the run compiled, ahead and as it went
    compile_each: dict[str, float] = field(default_factory=dict)  # each program of compile_s, its own seconds
    bytes_per_token: float = 1.0  # the validation text's (``TrainingSetup``)

    @property
    def tokens_per_s(self) -> float:
        return self.steps * self.global_batch * (self.seq_len - 1) / self.elapsed_s

    @property
    def ms_per_step(self) -> float:
        return 1e3 * self.elapsed_s / self.steps

    def metrics(self) -> StepMetrics:
        last = self.history[-1]
        found: StepMetrics = {
            "tokens_per_s": round(self.tokens_per_s, 1),
            "ms_per_step": round(self.ms_per_step, 3),
            "final_loss": round(last["loss"], 4),
            "val_loss": round(self.val_loss, 4),  # the whole validation split
            "val_bpb": round(bits_per_byte(self.val_loss, self.bytes_per_token), 4),
            "steps": self.steps,
            "global_batch": self.global_batch,
            "devices": self.devices,
            "compile_s": round(self.compile_s, 3),  # the step's and evaluation's, ahead
            "compile_each_s": self.compile_each,  # those programs', each timed on its own thread
            "compiled": self.compiles.as_json(),  # every program the run compiled
            "elapsed_s": round(self.elapsed_s, 3),
            "resumed_from_step": self.resumed_from,
            "resume_s": round(self.resume_s, 3),
            "precision": self.precision,
            "rows_per_pass": self.rows_per_pass,
            "layout": self.layout,
        }
        if self.memory is not None:
            found["step_memory"] = self.memory
        if self.resumed_from is not None:
            found["resumed_layout"] = self.resumed_layout
        if self.kept is not None:
            found["kept"] = self.kept
        return found


@dataclass(frozen=True)
class StepCalls:
    """The compiled training step: ``one`` takes a step a call; ``several`` (where set) takes
    ``count`` steps a call, their batches stacked, and where ``looped`` any number up to
    ``count`` (its third argument; the stack padded), so that no other program is needed."""

    one: Callable | None
    several: Callable | None = None
    count: int = 1
    looped: bool = False


_NO_LOSSES = CallLosses(np.zeros(1, np.float32))  # what a hook's needs_state sees: it asks about steps only


def _call_end(start: int, stop: int, count: int, hooks: Sequence[Hook], record: RunRecord) -> int:
    """Where a call that starts at step ``start`` ends: after ``count`` steps, or sooner, after
    the first step at which a hook needs the state, or at ``stop``."""
    for step in range(start, min(start + count, stop)):
        probe = StepInfo(step, stop, _NO_LOSSES, 0, None, 0, record)
        if any(hook.needs_state is not None and hook.needs_state(probe) for hook in hooks):
            return step + 1
    return min(start + count, stop)


def run_steps(
    calls: StepCalls,
    state,
    tokens_at: Callable[[int], jax.Array],
    stacked_at: Callable[[range], jax.Array],
    steps: range,
    tokens_per_step: int,
    hooks: Sequence[Hook],
    record: RunRecord,
):
    """The training loop: a call of one step or of several, then for each of its steps each
    hook that is due, in order (a hook that needs the state after a step has the call end there)."""
    step = steps.start
    while step < steps.stop:
        end = _call_end(step, steps.stop, calls.count, hooks, record) if calls.several else step + 1
        if calls.several is not None and calls.looped:
            state, losses = calls.several(state, stacked_at(range(step, end)), np.int32(end - step))
        elif calls.several is not None and end - step == calls.count:
            state, losses = calls.several(state, stacked_at(range(step, end)))
        else:
            assert calls.one is not None  # every StepCalls but a looped one has it
            end = step + 1
            state, losses = calls.one(state, tokens_at(step))
        read = CallLosses(losses)
        for at in range(step, end):
            info = StepInfo(
                at, steps.stop, read, at - step, state if at == end - 1 else None, (at + 1) * tokens_per_step, record
            )
            for hook in hooks:
                if hook.when(info):
                    hook.run(info)
        step = end
    return state


@dataclass(frozen=True)
class TrainingSetup:
    """What one training loop runs. The model (``graphdef``, ``state``); its data (the batch of
    step ``s`` is ``batch_at(s)``; ``val_batches`` are evaluated); where (``placement``); the
    recipe (``cfg``) and how its step runs (``step``: ``model/training/step_settings.py``, the
    platform's defaults for ``cfg`` by default). Then what the loop keeps and tells:
    ``checkpoints`` (resumed from, saved every ``cfg.checkpoint_every``), ``best`` (where
    ``cfg.keep == "best"`` keeps its state: checkpoints of one, or the device), ``stop_after``
    (only the first steps of the schedule), ``on_step(done, total)``, the caller's ``hooks``
    (a stop signal, a metrics writer) and ``note`` (a line for the user). ``state`` may be a
    future of the state, made meanwhile (``init_state_meanwhile``), with its ``shapes``: the
    step compiles from those."""

    graphdef: Any
    state: Any
    batch_at: Callable[[int], np.ndarray]
    val_batches: list[tuple[np.ndarray, np.ndarray]]
    placement: Placement
    cfg: TrainConfig
    step: StepSettings | None = None
    checkpoints: Any = None
    best: Any = None
    stop_after: int | None = None
    on_step: Callable[[int, int], None] | None = None
    hooks: Sequence[Hook] = ()
    note: Callable[[str], None] | None = None  # tells the user how long compiling took
    shapes: Any = None  # the state's, where ``state`` is a Future
    bytes_per_token: float = 1.0  # the validation text's: bits per byte from the loss per token


@dataclass
class _Resumed:
    """Where a loop starts: the state, its step and, resumed from a checkpoint, that step, the
    seconds the restore took and the layout it was saved on."""

    state: Any
    start: int = 0
    from_step: int | None = None
    seconds: float = 0.0
    layout: Layout | None = None


def _resume(checkpoints, state, record: RunRecord) -> _Resumed:
    """The newest checkpoint in ``checkpoints`` restored straight into the placed ``state``'s
    shardings (its history, time and best step into ``record``), or ``state`` from the start."""
    if checkpoints is None:
        return _Resumed(state)
    started = time.perf_counter()
    configured = jax.tree.map(lambda leaf: leaf, state)  # the restore writes into ``state``'s variables
    found = checkpoints.latest(state)
    if found is None:
        return _Resumed(state)
    saved = found[1]
    record.history, record.prior_s, record.last_saved = saved["history"], saved["elapsed_s"], saved["step"]
    record.best = saved.get("best")
    # The layout is absent from a checkpoint of before it was kept.
    return _Resumed(
        configured_rates(found[0], configured),
        saved["step"],
        saved["step"],
        time.perf_counter() - started,
        saved.get("layout"),
    )


def _builtin_hooks(setup: TrainingSetup, evaluate: Evaluation) -> list[Hook]:
    """What runs after every step before the caller's hooks: the loss check, the history and
    evaluation, the best state (``keep: best``), checkpoints and the progress callback."""
    cfg = setup.cfg
    hooks = [finite_loss_hook(), evaluation_hook(evaluate, cfg.log_every, cfg.eval_every, setup.bytes_per_token)]
    if cfg.keep == "best":
        hooks.append(best_hook(every(cfg.eval_every or cfg.log_every, and_last=True), setup.best))
    hooks += [checkpoint_hook(cfg.checkpoint_every)] if setup.checkpoints is not None else []
    hooks += [progress_hook(setup.on_step)] if setup.on_step is not None else []
    return hooks


def train(setup: TrainingSetup) -> TrainResult:
    """Runs steps until ``cfg.steps`` (or the first ``stop_after`` of its schedule), first
    resuming from the newest checkpoint in ``checkpoints`` if there is one. After each step
    the hooks run: the loss check, a history record every ``cfg.log_every`` steps (with the
    validation loss every ``cfg.eval_every``), a checkpoint every ``cfg.checkpoint_every``,
    ``on_step``, then the caller's ``hooks``. With ``cfg.keep == "best"`` the state returned is
    that of the evaluated step of lowest validation loss.

    The batch of step ``s`` is ``batch_at(s)``, and dropout's bits come from the seed and
    the step, so a resumed run repeats the uninterrupted one exactly. Compilation happens
    ahead of time, on threads while a checkpoint is restored, and is timed apart: it never
    counts against throughput or consumes a step.
    """
    state, batch_at, placement, cfg, step = setup.state, setup.batch_at, setup.placement, setup.cfg, setup.step
    last = min(setup.stop_after or cfg.steps, cfg.steps)
    record = RunRecord([], setup.checkpoints)
    record.layout = {"devices": len(placement.devices), "layout": placement.layout}
    compiles_before = compiled_so_far()
    local = batch_at(0)  # any step's batch has its shape
    example = placement.put_batch(local)
    global_batch, seq_len = example.shape
    step = step or resolve(None, cfg, seq_len, placement.devices[0].platform)
    evaluate = Evaluation(setup.graphdef, setup.val_batches, setup.placement, scanned=step.scanned)
    placed = placement.placed_shapes(state if setup.shapes is None else setup.shapes)
    compiling = _compile_ahead(setup, placed, (local, example), step, evaluate, last)
    state = placement.put_state(state.result() if isinstance(state, Future) else state)
    resumed = _resume(setup.checkpoints, state, record)
    state, start = resumed.state, resumed.start
    calls, compile_s, memory, compile_each = compiling.result(state)
    first = example if start == 0 else placement.put_batch(batch_at(start))
    tokens_at, stacked_at = _placed_batches(setup, calls, start, first)
    record.started = time.perf_counter()
    state = run_steps(
        calls,
        state,
        tokens_at,
        stacked_at,
        range(start, last),
        global_batch * (seq_len - 1),
        [*_builtin_hooks(setup, evaluate), *setup.hooks],
        record,
    )
    jax.block_until_ready(state)
    state, kept = _kept_state(state, record, setup.best, last) if cfg.keep == "best" else (state, None)
    return TrainResult(
        state=state,
        history=record.history,
        compile_s=compile_s,
        compile_each=compile_each,
        elapsed_s=record.trained_s(),
        steps=last,
        global_batch=global_batch,
        seq_len=seq_len,
        val_loss=kept["val_loss"] if kept else _or_nan(record.history[-1]["val_loss"]),
        devices=len(placement.devices),
        resumed_from=resumed.from_step,
        resume_s=resumed.seconds,
        precision=jnp.dtype(step.precision).name,
        rows_per_pass=step.rows_per_pass,
        layout=placement.layout,
        memory=memory,
        resumed_layout=resumed.layout,
        kept=kept,
        compiles=compiled_so_far() - compiles_before,
        bytes_per_token=setup.bytes_per_token,
    )


def _placed_batches(setup: TrainingSetup, calls: StepCalls, start: int, first: jax.Array):
    """(step -> its batch, steps -> their batches stacked), placed on the devices; ``first``
    is step ``start``'s, placed already. A loop's call cut short gets its stack padded."""
    batch_at, placement = setup.batch_at, setup.placement

    def tokens_at(step: int) -> jax.Array:
        return first if step == start else placement.put_batch(batch_at(step))

    def stacked_at(steps: range) -> jax.Array:
        batches = [batch_at(step) for step in steps]
        if calls.looped:  # the loop takes the first len(steps) of the stack
            batches += [np.zeros_like(batches[0])] * (calls.count - len(batches))
        return placement.put_batch(np.stack(batches), stacked=True)

    return tokens_at, stacked_at


@dataclass
class _Compiling:
    """The step's programs (and the evaluation's) compiling on threads: ``result()`` waits
    for them, tells ``setup.note`` how long that took, and gives the calls, the seconds from
    the start of lowering to the programs ready, and the compiled step's memory, held against
    the device's free memory."""

    setup: TrainingSetup
    step: StepSettings
    started: float
    futures: list  # the one-step program's (unless looped), the several's (if any), the evaluation's
    names: list[str]  # the programs', in that order
    several: int  # steps a call of the several-step program; 0: none
    looped: bool  # that program takes any number of steps up to ``several``: no one-step program

    def result(self, state) -> tuple[StepCalls, float, dict[str, int], dict[str, float]]:
        timed = [future.result() for future in self.futures]
        compiled = [t.executable for t in timed]
        each = {name: round(t.seconds, 2) for name, t in zip(self.names, timed, strict=True)}
        if self.looped:
            calls, largest = StepCalls(None, compiled[0], self.several, looped=True), compiled[0]
        elif self.several:
            calls, largest = StepCalls(compiled[0], compiled[1], self.several), compiled[1]
        else:
            calls, largest = StepCalls(compiled[0]), compiled[0]
        compile_s = time.perf_counter() - self.started
        placement, cfg, step = self.setup.placement, self.setup.cfg, self.step
        if self.setup.note is not None:
            side_by_side = ", ".join(f"{name} {seconds:.1f} s" for name, seconds in each.items())
            self.setup.note(
                f"compiled the step ({step.layers} blocks, {step.steps_per_call} a call) and the evaluation "
                f"in {compile_s:.1f} s ({side_by_side}, side by side)"
            )
        memory = step_memory(largest, state)
        device = next(d for d in placement.devices if d.process_index == jax.process_index())  # one of ours
        check_compiled_fits(
            memory,
            free_bytes(device),
            f"{device.platform} device {device.id} ({device.device_kind})",
            placement.layout,
            step.remat,
            step.passes(cfg.per_device_batch),
            len(placement.devices) if device.platform == "cpu" else 1,
        )
        return calls, compile_s, memory, each


def _compile_ahead(
    setup: TrainingSetup, state, batch: tuple[np.ndarray, Any], step: StepSettings, evaluate: Evaluation, last: int
) -> _Compiling:
    """The step lowered here for ``state`` (its shapes, placed) and ``batch`` (this process's
    rows, and placed) — one step a
    call, or ``step.steps_per_call`` a call where that is more than one and the run has more
    than a step (as a loop, which takes fewer too; written out, beside the one step a call)
    — with the evaluation, and all of them compiled side by side on threads
    (``compiling.compile_all``) while the caller restores a checkpoint."""
    local, example = batch
    graphdef, placement, cfg = setup.graphdef, setup.placement, setup.cfg
    dtype, passes = jnp.dtype(step.precision), step.passes(cfg.per_device_batch)
    started = time.perf_counter()
    shardings = placement.shardings(state)
    seed = cfg.init_seed if model_from_state(graphdef, state).dropout > 0 else 0  # dropout's; unused without

    def lowered_step(count: int, batch):
        made = make_train_step(
            graphdef,
            shardings,
            placement.batch_sharding,
            dtype,
            passes,
            step.remat,
            count,
            step.unroll,
            seed,
            step.scanned,
            step.generator,
        )
        return made.lower(state, batch) if count == 0 or step.unroll else made.lower(state, batch, np.int32(count))

    several = step.steps_per_call if step.steps_per_call > 1 and last > 1 else 0
    looped = bool(several) and not step.unroll
    programs, names = ([], []) if looped else ([lowered_step(0, example)], ["step"])
    if several:  # an example of the stacked batches: their shape
        programs.append(lowered_step(several, placement.put_batch(np.stack([local] * several), stacked=True)))
        names.append(f"{several} steps")
    options = [step.xla_options] * len(programs)
    evaluation = evaluate.lowered(state)
    if evaluation is not None:  # compiled beside the step; its jitted call then finds it compiled
        programs.append(evaluation)
        names.append("evaluation")
        options.append({})
    return _Compiling(setup, step, started, compile_all(programs, options), names, several, looped)


def _kept_state(state, record: RunRecord, best, last: int) -> tuple[Any, KeptState | None]:
    """``train.keep=best``: the state of the evaluated step of lowest validation loss, and
    which step that is (the last step's own state where it is the best, or none was evaluated)."""
    found = record.best
    if found is None or found["step"] == last - 1:
        return state, found
    if best is None:
        return record.best_state, found
    restored = best.latest(state)
    # None: set aside as damaged (said through the checkpoints' note), or never copied here; a
    # record of another step: an older best left by a save that did not finish.
    held = (restored[1].get("best") or {}).get("step") if restored is not None else None
    if restored is None or held != found["step"]:
        last_val = record.history[-1]["val_loss"]
        why = f"train.keep=best, but the state of step {found['step']} was not found: the last step's delivered"
        return state, {"step": last - 1, "val_loss": _or_nan(last_val), "why": why}
    return restored[0], found


def _or_nan(value: float | None) -> float:
    return math.nan if value is None else value
