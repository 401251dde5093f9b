"""``python -m bench.step_calls [--preset codelab] [--counts 1,4,16] [--steps 64]``: several
optimizer steps per compiled call (``train.steps_per_call``) against one, on this machine's
first device, and on a GPU cuDNN's fused attention against XLA's.

For each count: milliseconds per optimizer step of the preset's compiled step as a training run
builds it (its kernels, precision, passes and XLA options; the steps unrolled on an
accelerator, a loop on a CPU), warm, in alternating rounds, over the same batches; and the
losses of the first ``--steps`` steps from the same start, which should be bitwise those of one
step a call (the largest difference is reported). On a GPU, the same for the attention kernels
over 50 steps: their losses differ by bfloat16's rounding, held to 2 % of the loss.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from pathlib import Path

from bench.report import RESULTS, alternating, machine, write_report

FUSED_LOSS_BOUND = 0.02  # relative: bfloat16 keeps 8 bits of mantissa; two kernels' sums round apart


def start_state(cfg, step):
    """The start state of ``cfg`` built with ``step``'s kernels: each call a fresh copy (a
    compiled step donates the state it is given)."""
    from bardflow.model.training.step import init_state

    return init_state(step.model(cfg.model), cfg.train)


def compiled(cfg, step, count: int, example):
    """The compiled step of ``count`` steps a call (1: the one-step program) and its seconds."""
    import jax
    import numpy as np

    from bardflow.model.training.step import make_train_step

    graphdef, state = start_state(cfg, step)
    program = make_train_step(
        graphdef,
        dtype=jax.numpy.dtype(step.precision),
        passes=step.passes(cfg.train.per_device_batch),
        steps=count if count > 1 else 0,
        unroll=step.unroll and count > 1,
        scanned=step.scanned,
        generator=step.generator,
    )
    started = time.perf_counter()
    if count > 1 and not step.unroll:  # a loop: its length an argument, here always ``count``
        looped = program.lower(state, example, np.int32(count)).compile(compiler_options=step.xla_options)
        return (lambda state, tokens: looped(state, tokens, np.int32(count))), time.perf_counter() - started
    program = program.lower(state, example).compile(compiler_options=step.xla_options)
    return program, time.perf_counter() - started


def losses_of(program, state, batches, count: int) -> list[float]:
    import numpy as np

    found = []
    for at in range(0, len(batches), count):
        state, loss = program(state, batches[at] if count == 1 else np.stack(batches[at : at + count]))
        found.extend(np.asarray(loss).reshape(-1).tolist())
    return found


def measure(preset: str, counts: list[int], steps: int, rounds: int) -> dict:
    import jax
    import numpy as np

    from bardflow.config.settings import build_config
    from bardflow.model.training.step_settings import resolve

    cfg = build_config(preset)
    platform, seq_len = jax.devices()[0].platform, cfg.data.seq_len
    rows = cfg.train.per_device_batch
    data = np.random.default_rng(0).integers(0, 256, (steps, rows, seq_len), dtype=np.int32)
    batches = [data[s] for s in range(steps)]
    results, timers = {}, []
    base = resolve(cfg.model, cfg.train, seq_len, platform)
    for count in counts:
        step = dataclasses.replace(base, steps_per_call=count, unroll=platform != "cpu" and count > 1)
        example = batches[0] if count == 1 else np.stack(batches[:count])
        program, compile_s = compiled(cfg, step, count, example)
        losses = losses_of(program, start_state(cfg, step)[1], batches[: steps // count * count], count)
        holder = {"state": start_state(cfg, step)[1]}

        def timed(program=program, holder=holder, count=count, example=example) -> float:
            started = time.perf_counter()
            for _ in range(max(1, steps // count)):
                holder["state"], loss = program(holder["state"], example)
            jax.block_until_ready(loss)
            return 1e3 * (time.perf_counter() - started) / (max(1, steps // count) * count)

        timers.append(timed)
        results[count] = {"compile_s": round(compile_s, 2), "losses": losses}
    for count, ms in zip(counts, alternating(timers, rounds), strict=True):
        results[count]["ms_per_step"] = statistics.median(ms)
        results[count]["ms_rounds"] = ms
    one = results[counts[0]]["losses"]
    for count in counts:
        theirs = results[count]["losses"]
        results[count]["largest_loss_difference"] = max(abs(a - b) for a, b in zip(one, theirs, strict=False))
        results[count]["speedup"] = results[counts[0]]["ms_per_step"] / results[count]["ms_per_step"]
        del results[count]["losses"]
    report = {"preset": preset, "platform": platform, "step_settings": base.as_json(), "by_count": results}
    if platform == "gpu" and base.attention == "cudnn":
        report["attention"] = compare_attention(cfg, base, batches[:50], rounds)
    return report


def compare_attention(cfg, base, batches, rounds: int) -> dict:
    """cuDNN's fused attention against XLA's: ms a step and the losses of the same steps."""
    import jax

    found, timers = {}, []
    for kernel in ("cudnn", "xla"):
        step = dataclasses.replace(base, attention=kernel, steps_per_call=1, unroll=False)
        program, compile_s = compiled(cfg, step, 1, batches[0])
        losses = losses_of(program, start_state(cfg, step)[1], batches, 1)
        holder = {"state": start_state(cfg, step)[1]}

        def timed(program=program, holder=holder) -> float:
            started = time.perf_counter()
            for batch in batches[:10]:
                holder["state"], loss = program(holder["state"], batch)
            jax.block_until_ready(loss)
            return 1e3 * (time.perf_counter() - started) / 10

        timers.append(timed)
        found[kernel] = {"compile_s": round(compile_s, 2), "losses": losses}
    for kernel, ms in zip(("cudnn", "xla"), alternating(timers, rounds), strict=True):
        found[kernel]["ms_per_step"] = statistics.median(ms)
    pairs = list(zip(found["cudnn"]["losses"], found["xla"]["losses"], strict=True))
    worst = max(abs(a - b) / b for a, b in pairs)
    within = worst <= FUSED_LOSS_BOUND
    return {**found, "largest_relative_loss_difference": worst, "bound": FUSED_LOSS_BOUND, "within": within}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.step_calls", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--preset", default="codelab")
    parser.add_argument("--counts", default="1,4,16", help="steps per call to time, the first the reference")
    parser.add_argument("--steps", type=int, default=64, help="steps whose losses are compared (a multiple of each)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS, help=f"folder for the JSON (default {RESULTS})")
    args = parser.parse_args(argv)
    counts = [int(c) for c in args.counts.split(",")]
    report = measure(args.preset, counts, args.steps, args.rounds)
    flat = {}
    for count, figures in report["by_count"].items():
        flat[f"{count}_per_call.ms_per_step"] = figures["ms_per_step"]
        flat[f"{count}_per_call.speedup"] = figures["speedup"]
        flat[f"{count}_per_call.largest_loss_difference"] = figures["largest_loss_difference"]
    if "attention" in report:
        for kernel in ("cudnn", "xla"):
            flat[f"attention.{kernel}.ms_per_step"] = report["attention"][kernel]["ms_per_step"]
        flat["attention.largest_relative_loss_difference"] = report["attention"]["largest_relative_loss_difference"]
    out = write_report({"machine": machine(), **report}, flat, args.out, f"step-calls-{args.preset}")
    print(f"written to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
