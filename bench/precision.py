"""``python -m bench.precision [--quick]``: bfloat16 against float32 compute on this machine.

For the ``cpu`` preset's shape (on one device and data-parallel over every visible device, as
its two training stages run) and the ``codelab`` shape (one device): milliseconds per step of
the step a training run compiles (its kernels, passes and XLA options; parameters stay
float32, the forward and backward passes compute in the given precision), warm and in
alternating rounds, and the training loss after the same steps from the same start and data.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any, NamedTuple

from bench.report import RESULTS, SHARED_CORPUS, alternating, machine, write_report

PRECISIONS = ("float32", "bfloat16")


class CompiledStep(NamedTuple):
    program: Any  # (state, batch) -> (state, loss), compiled
    state: Any  # the start state, placed
    rows: int  # the global batch
    settings: Any  # model/step_settings.StepSettings


def compiled_step(cfg, precision: str, placement, seq_len: int) -> CompiledStep:
    """The training step as ``train`` compiles it for ``cfg`` in ``precision``, with its placed
    start state."""
    import jax.numpy as jnp
    import numpy as np

    from bardflow.model.training.step import init_state, make_train_step
    from bardflow.model.training.step_settings import resolve

    train_cfg = cfg.train.model_copy(update={"precision": precision})
    step = resolve(cfg.model, train_cfg, seq_len, placement.devices[0].platform)
    graphdef, state = init_state(step.model(cfg.model), train_cfg)
    state = placement.put_state(state)
    rows = train_cfg.per_device_batch * len(placement.devices)
    example = placement.put_batch(np.zeros((rows, seq_len), np.int32))
    program = (
        make_train_step(
            graphdef,
            placement.state_sharding,
            placement.batch_sharding,
            jnp.dtype(precision),
            passes=step.passes(train_cfg.per_device_batch),
        )
        .lower(state, example)
        .compile(compiler_options=step.xla_options)
    )
    return CompiledStep(program, state, rows, step)


def product_rate(precision: str, size: tuple[int, int, int] = (2048, 512, 2048), calls: int = 20) -> float:
    """GFLOP/s of one large matrix product in ``precision`` (float32 accumulation and output):
    whether the compiler uses the CPU's bfloat16 instructions at all."""
    import jax
    import jax.numpy as jnp

    m, k, n = size
    a, b = jnp.ones((m, k), precision), jnp.ones((k, n), precision)
    product = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32).sum()).lower(a, b).compile()
    product(a, b).block_until_ready()
    started = time.perf_counter()
    for _ in range(calls):
        product(a, b).block_until_ready()
    return 2 * m * k * n * calls / (time.perf_counter() - started) / 1e9


def compare(preset: str, parallel: bool, steps: int, loss_steps: int, rounds: int, corpus: Path) -> dict:
    import jax
    import numpy as np

    from bardflow.config.settings import build_config
    from bardflow.model.data.splits import Batches, encode
    from bardflow.model.training.placement import Placement

    cfg = build_config(preset)
    devices = jax.devices()
    placement = Placement.data_parallel(devices) if parallel else Placement.single(devices[0])
    split = encode(
        corpus.read_bytes(), cfg.data.seq_len, cfg.data.train_fraction, cfg.data.shuffle_seed, cfg.data.every_position
    )
    built = {p: compiled_step(cfg, p, placement, split.train.shape[1]) for p in PRECISIONS}
    batches = Batches(split.train, built["float32"].rows)
    timing_batch = placement.put_batch(batches(0))

    def timed(precision: str):
        program, state = built[precision].program, built[precision].state
        holder = {"state": jax.tree.map(lambda x: x.copy(), state)}

        def run() -> float:
            started = time.perf_counter()
            for _ in range(steps):
                holder["state"], loss = program(holder["state"], timing_batch)
            jax.block_until_ready(loss)
            return 1e3 * (time.perf_counter() - started) / steps

        return run

    ms = dict(zip(PRECISIONS, alternating([timed(p) for p in PRECISIONS], rounds), strict=True))
    losses = {}
    for precision in PRECISIONS:
        program, state = built[precision].program, built[precision].state
        history = []
        for s in range(loss_steps):
            state, loss = program(state, placement.put_batch(batches(s)))
            history.append(float(loss))
        losses[precision] = float(np.mean(history[-10:]))  # the last ten steps' training loss
    f32, bf16 = (statistics.median(ms[p]) for p in PRECISIONS)
    return {
        "preset": preset,
        "devices": len(placement.devices),
        "global_batch": built["float32"].rows,
        "seq_len": cfg.data.seq_len,
        "step_settings": built["float32"].settings.as_json(),
        "timed_steps": steps,
        "rounds": rounds,
        "ms_per_step": ms,
        "float32_ms": f32,
        "bfloat16_ms": bf16,
        "bfloat16_speedup": f32 / bf16,
        "loss_steps": loss_steps,
        "loss": losses,
        "bfloat16_minus_float32_loss": losses["bfloat16"] - losses["float32"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.precision", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="fewer rounds and steps")
    parser.add_argument("--corpus", type=Path, default=SHARED_CORPUS, help="a local copy of TinyShakespeare")
    parser.add_argument("--out", type=Path, default=RESULTS, help=f"folder for the JSON (default {RESULTS})")
    args = parser.parse_args(argv)
    if not args.corpus.is_file():
        print(
            f"bench.precision: error: no corpus at {args.corpus}; pass --corpus PATH to a copy of TinyShakespeare",
            file=sys.stderr,
        )
        return 2

    from bardflow.flows.environment import prepare_environment

    prepare_environment()  # one emulated device per core on a CPU, as a run has
    quick = args.quick
    shapes = [
        ("cpu", False, 10, 60 if quick else 200),
        ("cpu", True, 10, 60 if quick else 200),
        ("codelab", False, 2 if quick else 3, 12 if quick else 40),
    ]
    results = [
        compare(preset, parallel, steps, loss_steps, 2 if quick else 5, args.corpus)
        for preset, parallel, steps, loss_steps in shapes
    ]
    products = {p: product_rate(p) for p in PRECISIONS}
    flat = {"product.float32_gflops": products["float32"], "product.bfloat16_gflops": products["bfloat16"]}
    for r in results:
        name = f"{r['preset']}.{r['devices']}dev"
        flat.update(
            {
                f"{name}.float32_ms": r["float32_ms"],
                f"{name}.bfloat16_ms": r["bfloat16_ms"],
                f"{name}.bfloat16_speedup": r["bfloat16_speedup"],
                f"{name}.bf16_minus_f32_loss": r["bfloat16_minus_float32_loss"],
            }
        )
    out = write_report(
        {"machine": machine(), "precision": results, "product_gflops": products},
        flat,
        args.out,
        "precision-quick" if quick else "precision",
    )
    print(f"written to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
