"""Loss, the compiled train step (one device or data-parallel), and the timed loop.

The step works on ``nnx.split`` state with plain ``jax.jit`` and donated buffers,
so no NNX graph traversal happens per step.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from model.config import ModelConfig, TrainConfig
from model.transformer import Transformer, build_model


class TrainingError(RuntimeError):
    """Training cannot go on; the message names the step and the cause."""


def next_byte_loss(model: Transformer, tokens: jax.Array) -> jax.Array:
    logits = model(tokens)
    return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], tokens[:, 1:]).mean()


def init_state(model_cfg: ModelConfig, train_cfg: TrainConfig):
    """(graphdef, state) of the model and its AdamW optimizer together."""
    model = build_model(model_cfg, train_cfg.init_seed)
    tx = optax.adamw(train_cfg.learning_rate, weight_decay=train_cfg.weight_decay)
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    return nnx.split((model, optimizer))


def model_from_state(graphdef, state) -> Transformer:
    model, _ = nnx.merge(graphdef, state)
    return model


def params_of(graphdef, state) -> nnx.State:
    return nnx.state(model_from_state(graphdef, state), nnx.Param)


def make_train_step(graphdef, state_sharding=None, batch_sharding=None):
    def step(state, tokens):
        model, optimizer = nnx.merge(graphdef, state)
        loss, grads = nnx.value_and_grad(next_byte_loss)(model, tokens)
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


def make_eval_loss(graphdef):
    @jax.jit
    def eval_loss(state, tokens):
        return next_byte_loss(model_from_state(graphdef, state), tokens)

    return eval_loss


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
        mesh = Mesh(np.array(devices), ("data",))
        return cls(
            devices=tuple(devices),
            state_sharding=NamedSharding(mesh, P()),
            batch_sharding=NamedSharding(mesh, P("data")),
        )

    def put_state(self, state):
        return jax.device_put(state, self.state_sharding or self.devices[0])

    def put_batch(self, batch: np.ndarray):
        return jax.device_put(batch, self.batch_sharding or self.devices[0])


@dataclass
class TrainResult:
    state: Any
    history: list[dict[str, float]]
    compile_s: float
    elapsed_s: float
    steps: int
    global_batch: int
    seq_len: int
    val_loss: float = math.nan
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        return self.steps * self.global_batch * (self.seq_len - 1) / self.elapsed_s

    @property
    def ms_per_step(self) -> float:
        return 1e3 * self.elapsed_s / self.steps

    def metrics(self) -> dict[str, float]:
        last = self.history[-1]
        return {
            "tokens_per_s": round(self.tokens_per_s, 1),
            "ms_per_step": round(self.ms_per_step, 3),
            "final_loss": round(last["loss"], 4),
            "val_loss": round(self.val_loss, 4),
            "steps": self.steps,
            "global_batch": self.global_batch,
            "devices": self.extra.get("devices", 1),
            "compile_s": round(self.compile_s, 3),
            "elapsed_s": round(self.elapsed_s, 3),
        }


def train(
    graphdef,
    state,
    batch_at: Callable[[int], np.ndarray],
    val_batches: list[np.ndarray],
    placement: Placement,
    cfg: TrainConfig,
    on_step: Callable[[int, int], None] | None = None,
) -> TrainResult:
    """Runs ``cfg.steps`` steps. Compilation happens ahead of time and is timed apart,
    so it never counts against throughput and never consumes a training step."""
    state = placement.put_state(state)
    step_fn = make_train_step(graphdef, placement.state_sharding, placement.batch_sharding)
    first = placement.put_batch(batch_at(0))
    started = time.perf_counter()
    compiled = step_fn.lower(state, first).compile()
    compile_s = time.perf_counter() - started

    history: list[dict[str, float]] = []
    global_batch, seq_len = first.shape
    started = time.perf_counter()
    for step in range(cfg.steps):
        tokens = first if step == 0 else placement.put_batch(batch_at(step))
        state, loss = compiled(state, tokens)
        if step % cfg.log_every == 0 or step == cfg.steps - 1:
            value = float(loss)  # blocks: only on logging steps
            if not math.isfinite(value):
                raise TrainingError(
                    f"loss became {value} at step {step}; lower train.learning_rate"
                )
            history.append(
                {
                    "step": step,
                    "loss": value,
                    "perplexity": math.exp(min(value, 50.0)),
                    "tokens": (step + 1) * global_batch * (seq_len - 1),
                }
            )
        if on_step is not None:
            on_step(step + 1, cfg.steps)
    jax.block_until_ready(state)
    elapsed_s = time.perf_counter() - started

    eval_loss = make_eval_loss(graphdef)
    losses = [float(eval_loss(state, placement.put_batch(b))) for b in val_batches]
    return TrainResult(
        state=state,
        history=history,
        compile_s=compile_s,
        elapsed_s=elapsed_s,
        steps=cfg.steps,
        global_batch=global_batch,
        seq_len=seq_len,
        val_loss=float(np.mean(losses)) if losses else math.nan,
        extra={"devices": len(placement.devices)},
    )


def val_batches(val: np.ndarray, batch_size: int, multiple: int = 1, limit: int = 50) -> list[np.ndarray]:
    """Up to ``limit`` whole batches of the validation split, each a multiple of
    ``multiple`` rows (the device count) so they shard evenly; shrunk to fit a small split."""
    size = min(batch_size, len(val)) // multiple * multiple
    if size == 0:
        return []
    return [val[i : i + size].astype(np.int32) for i in range(0, len(val) - size + 1, size)][:limit]
