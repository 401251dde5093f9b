"""What runs after each training step: the run's record (its history, clock and newest
checkpoint), what a hook sees of a step, and the built-in hooks (the loss check, the history
and evaluation, checkpoints, the best state, progress). ``loop.py`` runs them."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .run_records import HistoryEntry, KeptState, Layout
from .step import TrainingError


@jax.jit
def _all_finite(tree) -> jax.Array:
    leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating)]
    return jnp.all(jnp.stack(leaves))


@dataclass
class RunRecord:
    """What the hooks keep of a run: its history, its newest checkpoint and its training
    clock (which leaves out the time the hooks spend evaluating)."""

    history: list[HistoryEntry]
    checkpoints: Any = None  # TrainingCheckpoints, or None: nothing is saved
    last_saved: int | None = None
    prior_s: float = 0.0  # trained before this session (a resumed run)
    started: float = 0.0
    paused_s: float = 0.0
    layout: Layout | None = None  # the devices and layout it trains on: kept in each checkpoint
    best: KeptState | None = None  # train.keep=best: the lowest validation loss so far, kept in each checkpoint
    best_state: Any = None  # its state, where no checkpoints keep it

    def trained_s(self) -> float:
        return self.prior_s + time.perf_counter() - self.started - self.paused_s

    @contextmanager
    def paused(self):
        paused = time.perf_counter()
        try:
            yield
        finally:
            self.paused_s += time.perf_counter() - paused

    def check_loss(self, step: int, loss: float) -> float:
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
        saved = {  # a copy of the history: the save is asynchronous and the loop keeps appending to it
            "step": info.done,
            "history": list(self.history),
            "elapsed_s": self.trained_s(),
            "data_position": info.done,
            "layout": self.layout,
            "best": self.best,
        }
        # Not a step's time, as evaluation is not: the checks (a first one compiles) and the
        # save's wait for the copy off the devices.
        with self.paused():
            self.check_loss(info.step, info.loss)
            if not bool(_all_finite(info.state)):
                raise TrainingError(
                    f"parameters became non-finite at step {info.step}; the checkpoint of step "
                    f"{self.last_saved} is kept; lower train.learning_rate"
                )
            self.checkpoints.save(info.done, info.state, saved)
        self.last_saved = info.done
        return self.last_saved


class CallLosses:
    """The losses of one compiled call's steps, still on the device: read back all at once,
    when a hook first wants one (reading waits for the call)."""

    def __init__(self, values: jax.Array | np.ndarray):
        self.values, self._read = values, None

    def __getitem__(self, index: int) -> float:
        if self._read is None:
            self._read = np.asarray(self.values).reshape(-1)
        return float(self._read[index])


@dataclass(frozen=True)
class StepInfo:
    """One step just taken, as every hook sees it."""

    step: int  # 0-based
    last: int  # the run ends after step last - 1
    losses: CallLosses  # of the call that took this step
    index: int  # this step's place in it
    state: Any  # after this step; None inside a call of several steps (only its last has one)
    tokens: int  # trained on so far
    record: RunRecord

    @property
    def done(self) -> int:
        return self.step + 1

    @property
    def loss(self) -> float:
        return self.losses[self.index]


@dataclass(frozen=True)
class Hook:
    """``run(info)`` after every step for which ``when(info)`` holds. ``needs_state(info)``:
    the steps after which it needs the state, where a call of several steps must end."""

    run: Callable[[StepInfo], object]  # what it returns is not used
    when: Callable[[StepInfo], bool] = lambda info: True
    needs_state: Callable[[StepInfo], bool] | None = None


def every(n: int, and_last: bool = False) -> Callable[[StepInfo], bool]:
    """After steps 0, n, 2n, ... (and after the run's last step, with ``and_last``)."""
    return lambda info: info.step % n == 0 or (and_last and info.done == info.last)


def finite_loss_hook() -> Hook:
    """Each step's loss is read once the next step is queued, so that reading it never
    leaves the device idle (the last step's is read by its evaluation)."""
    pending: list[StepInfo] = []

    def check(info: StepInfo) -> None:
        if pending:
            info.record.check_loss(pending[0].step, pending[0].loss)
        pending[:] = [info]

    return Hook(check)


def bits_per_byte(loss_per_token: float, bytes_per_token: float = 1.0) -> float:
    """A loss in nats per token as bits per byte of the text (a byte is a token of the bytes
    tokenizer): the measure that compares tokenizers."""
    return loss_per_token / math.log(2) / bytes_per_token


def evaluation_hook(
    evaluate: Callable[[Any], float | None], every_n: int, eval_every: int = 0, bytes_per_token: float = 1.0
) -> Hook:
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
        info.record.history.append(
            {
                "step": info.step,
                "loss": value,
                "perplexity": math.exp(min(value, 50.0)),
                "tokens": info.tokens,
                "val_loss": val_loss,
                "val_bpb": None if val_loss is None else bits_per_byte(val_loss, bytes_per_token),
                "seconds": round(trained_s, 3),
            }
        )

    return Hook(record, lambda info: bool(recorded(info) or evaluated(info)), needs_state=evaluated)


def checkpoint_hook(every_n: int) -> Hook:
    """A resumable checkpoint after every ``every_n`` steps but the last (the stage saves that one)."""
    due = lambda info: info.done % every_n == 0 and info.done < info.last  # noqa: E731
    return Hook(lambda info: info.record.save(info), due, needs_state=due)


def best_hook(evaluated: Callable[[StepInfo], bool], best: Any = None) -> Hook:
    """``train.keep=best``: after each evaluation (the evaluation hook's record just written),
    a validation loss lower than any before makes this step's state the one kept: saved in
    ``best`` (a ``TrainingCheckpoints`` of one, so that a resumed run still has it), or without
    checkpoints copied on the device. The last step's state is the run's anyway."""

    def run(info: StepInfo) -> None:
        record = info.record
        val_loss = record.history[-1]["val_loss"] if record.history else None
        if val_loss is None or (record.best is not None and val_loss >= record.best["val_loss"]):
            return
        record.best = {
            "step": info.step,
            "val_loss": val_loss,
            "why": "train.keep=best: the lowest validation loss of the steps evaluated",
        }
        if info.done == info.last:
            record.best_state = None
        elif best is not None:
            best.save(info.done, info.state, {"step": info.done, "best": record.best})
        else:
            record.best_state = jax.tree.map(jnp.copy, info.state)

    return Hook(run, evaluated, needs_state=evaluated)


def progress_hook(on_step: Callable[[int, int], None]) -> Hook:
    return Hook(lambda info: on_step(info.done, info.last))
