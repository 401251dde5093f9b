"""``python -m bench.tpu_step [--presets gpt2,quality,codelab]``: the training step on this
machine's first device, per preset, as a training run builds it (``bench/step_calls.py``'s
``compiled``), and the choices an accelerator's step makes, each measured:

  attention   the attention alone (forward and backward, bfloat16, each preset's shape): XLA's,
              and Pallas's flash and splash kernels at each tile length that divides the context
  kernels     the whole step with each attention kernel: ms a step, tokens/s, MFU (nanoGPT's
              count, ``model/training/utilization.py``), and the losses of ``--loss-steps`` steps
              from one start against XLA's kernel and against a float32 step (bfloat16's noise)
  calls       steps a compiled call (1 and ``auto``) with the chosen kernel
  run         ``auto``'s call alone, the program a run compiles (with ``profile``, and one step a
              call, that program traced too: no second compile)
  batch       per-device batches and remat around the preset's: ms a step, XLA's memory
              (arguments and temporaries) against the estimate that ``bardflow run`` refuses
              runs with (``model/training/memory.py``)
  profile     a ``jax.profiler`` trace of the chosen step: its slowest operations

``--smoke`` runs every part on small shapes (a CPU: Pallas's kernels in its interpreter).
Writes ``<date>-<backend>-tpu-step.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path

from bench.report import RESULTS, machine

LOSS_BOUND = 0.02  # relative, as bench/step_calls.py's: bfloat16 keeps 8 bits of mantissa
# The smoke shapes: each preset's model, two layers wide 64 over 128 bytes (one Pallas tile).
SMOKE = {
    "model.num_layers": 1,
    "model.d_model": 128,
    "model.num_heads": 2,
    "model.ffn_dim": 256,
    "data.seq_len": 128,
    "model.max_seq_len": 128,
    "train.per_device_batch": 2,
}


def configured(preset: str, smoke: bool, settings: dict | None = None):
    from bardflow.config.settings import build_config

    return build_config(preset, {**(SMOKE if smoke else {}), **(settings or {})})


def interpreted(kernel: str):
    """Off a TPU, Pallas's flash kernel runs in the interpreter the whole trace is under
    (splash uses its own: ``model/network/kernels.py``)."""
    from contextlib import nullcontext

    import jax
    from jax.experimental.pallas import tpu as pltpu

    return (
        pltpu.force_tpu_interpret_mode()
        if kernel.startswith("flash") and jax.default_backend() != "tpu"
        else nullcontext()
    )


def timed_ms(call, repeats: int) -> float:
    """Median ms of ``call()`` (which blocks until its result is ready) over ``repeats``, after
    one untimed call."""
    call()
    found = []
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        found.append(1e3 * (time.perf_counter() - started))
    return statistics.median(found)


def attention_blocks(cfg, repeats: int) -> dict:
    """Forward and backward of the attention alone at ``cfg``'s shape, per kernel and tile."""
    import jax
    import jax.numpy as jnp

    from bardflow.model.network.kernels import PALLAS_TILE, pallas_attention

    rows, length = cfg.train.per_device_batch, min(cfg.data.seq_len, cfg.model.max_seq_len)
    heads, head_dim = cfg.model.num_heads, cfg.model.d_model // cfg.model.num_heads
    q, k, v = (
        jax.random.normal(key, (rows, length, heads, head_dim), jnp.bfloat16)
        for key in jax.random.split(jax.random.key(0), 3)
    )
    candidates = {"xla": lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True)}
    block = PALLAS_TILE
    while block <= min(length, 1024) and length % PALLAS_TILE == 0:
        if length % block == 0:
            for kernel in ("flash", "splash"):
                candidates[f"{kernel}-{block}"] = lambda q, k, v, kernel=kernel, block=block: pallas_attention(
                    q, k, v, kernel, block
                )
        block *= 2
    found = {}
    for name, attention in candidates.items():
        grads = jax.jit(jax.grad(lambda q, k, v, f=attention: f(q, k, v).astype(jnp.float32).sum(), argnums=(0, 1, 2)))
        try:
            with interpreted(name):
                found[name] = round(timed_ms(lambda grads=grads: jax.block_until_ready(grads(q, k, v)), repeats), 3)
        except Exception as error:  # noqa: BLE001 - a kernel that cannot run at a shape is a finding
            found[name] = f"failed: {str(error).strip().splitlines()[0][:160]}"
    return {"shape": [rows, length, heads, head_dim], "ms_forward_backward": found}


def build_step(cfg, step, count: int, remat: bool | None = None):
    """(compiled step, its seconds to compile, the start state, the arguments after the state:
    a batch, and where the steps are a loop their count) as a run builds them."""
    import jax
    import numpy as np

    from bardflow.model.training.step import init_state, make_train_step

    graphdef, state = init_state(step.model(cfg.model), cfg.train)
    width = cfg.data.seq_len + int(cfg.data.every_position)
    rows = np.random.default_rng(0).integers(0, 256, (max(count, 1), cfg.train.per_device_batch, width), dtype=np.int32)
    looped = count > 1 and not step.unroll
    inputs = (rows, np.int32(count)) if looped else (rows if count > 1 else rows[0],)
    program = make_train_step(
        graphdef,
        dtype=jax.numpy.dtype(step.precision),
        passes=step.passes(cfg.train.per_device_batch),
        remat=step.remat if remat is None else remat,
        steps=count if count > 1 else 0,
        unroll=step.unroll and count > 1,
        scanned=step.scanned,
        generator=step.generator,
    )
    started = time.perf_counter()
    with interpreted(step.attention):
        compiled = program.lower(state, *inputs).compile(compiler_options=step.xla_options)
    return compiled, time.perf_counter() - started, (graphdef, state), inputs


def step_figures(cfg, step, count: int, steps: int, remat: bool | None = None, traced: int = 0) -> dict:
    """ms a step, tokens/s and MFU of ``step`` at ``count`` steps a call; XLA's memory against the
    estimate. ``traced`` (one step a call): that many more steps profiled (``profiled``'s figures)."""
    import jax

    from bardflow.model.training.memory import estimate, step_memory
    from bardflow.model.training.utilization import utilization

    remat = step.remat if remat is None else remat
    compiled, compile_s, (_, state), inputs = build_step(cfg, step, count, remat)
    memory = step_memory(compiled, state)
    holder = {"state": state}

    def run() -> None:
        for _ in range(max(1, steps // max(count, 1))):
            holder["state"], loss = compiled(holder["state"], *inputs)
        jax.block_until_ready(loss)

    ms = timed_ms(run, 3) / (max(1, steps // max(count, 1)) * max(count, 1))
    length = min(cfg.data.seq_len, cfg.model.max_seq_len)
    tokens_per_s = 1e3 * cfg.train.per_device_batch * length / ms
    device = jax.devices()[0]
    used = utilization(cfg.model, length, tokens_per_s, 1, device.device_kind, step.precision)
    found = estimate(
        cfg.model,
        cfg.train,
        1,
        cfg.data.seq_len,
        step.rows_per_pass,
        step.precision,
        remat=remat,
        attention=step.attention,
        platform=device.platform,
    )
    measured = memory.get("argument_bytes", 0) + memory.get("temp_bytes", 0)
    traced_figures = {"profile": traced_profile(compiled, holder["state"], inputs[0], traced, step)} if traced else {}
    return {
        "attention": step.attention,
        "steps_per_call": count,
        "per_device_batch": cfg.train.per_device_batch,
        "remat": remat,
        "compile_s": round(compile_s, 1),
        "ms_per_step": round(ms, 3),
        "tokens_per_s": round(tokens_per_s),
        "mfu": used["mfu"],
        "xla_argument_plus_temp_mib": round(measured / 2**20, 1),
        "estimate_mib": round(found.total_bytes / 2**20, 1),
        "estimate_vs_xla": round(found.total_bytes / measured, 3) if measured else None,
        **traced_figures,
    }


def losses(cfg, step, batches) -> list[float]:
    import numpy as np

    compiled, _, (_, state), _ = build_step(cfg, step, 1)
    found = []
    for batch in batches:
        state, loss = compiled(state, batch)
        found.append(float(np.asarray(loss)))
    return found


def kernels(cfg, base, steps: int, loss_steps: int, platform: str) -> dict:
    """The step with each attention kernel this platform runs; the losses of the first
    ``loss_steps`` steps against XLA's kernel and against a float32 step."""
    import numpy as np

    names = ["xla", "splash", "flash"] if platform == "tpu" or base.attention in ("splash", "flash") else ["xla"]
    width = cfg.data.seq_len + int(cfg.data.every_position)
    batches = list(
        np.random.default_rng(1).integers(0, 256, (loss_steps, cfg.train.per_device_batch, width), dtype=np.int32)
    )
    found = {}
    for name in names:
        step = dataclasses.replace(base, attention=name, steps_per_call=1, unroll=False)
        figures = step_figures(cfg, step, 1, steps)
        figures["losses"] = losses(cfg, step, batches)
        found[name] = figures
    reference = found["xla"]["losses"]
    float32 = losses(
        cfg, dataclasses.replace(base, attention="xla", precision="float32", steps_per_call=1, unroll=False), batches
    )
    noise = max(abs(a - b) / b for a, b in zip(float32, reference, strict=True))
    for figures in found.values():
        theirs = figures.pop("losses")
        figures["largest_relative_loss_difference"] = max(
            abs(a - b) / b for a, b in zip(theirs, reference, strict=True)
        )
    return {
        "by_kernel": found,
        "bfloat16_noise": noise,  # XLA's bfloat16 step against its float32 step, the same steps
        "bound": LOSS_BOUND,
        "within": all(f["largest_relative_loss_difference"] <= max(LOSS_BOUND, noise) for f in found.values()),
        "loss_steps": loss_steps,
    }


def batches_and_remat(preset: str, smoke: bool, base_cfg, steps: int, platform: str) -> list[dict]:
    """The preset's per-device batch, twice it, and both with remat: what fits and how fast."""
    from bardflow.model.training.step_settings import resolve

    rows = base_cfg.train.per_device_batch
    found = []
    for batch, remat in ((rows, False), (rows, True), (2 * rows, False), (2 * rows, True)):
        cfg = configured(preset, smoke, {"train.per_device_batch": batch, "train.remat": remat})
        step = resolve(cfg.model, cfg.train, cfg.data.seq_len, platform)
        try:
            found.append(step_figures(cfg, step, 1, steps, remat))
        except Exception as error:  # noqa: BLE001 - out of memory is the finding
            found.append(
                {"per_device_batch": batch, "remat": remat, "failed": str(error).strip().splitlines()[0][:200]}
            )
    return found


def profiled(cfg, step, steps: int) -> dict:
    compiled, _, (_, state), (example,) = build_step(cfg, step, 1)
    return traced_profile(compiled, state, example, steps, step)


def traced_profile(compiled, state, example, steps: int, step) -> dict:
    """``steps`` one-step calls of ``compiled`` from ``state`` on ``example``, traced and summed by kind."""
    import jax
    import numpy as np

    from bardflow.model.training.utilization import peak_flops
    from bench.profile import profile
    from bench.sampler import bandwidth

    stream = np.stack([example] * (steps + 1))
    kind = jax.devices()[0].device_kind
    figures = profile(compiled, state, stream, steps, peak_flops(kind, step.precision), bandwidth(kind))
    figures.pop("state")
    figures["slowest"] = figures["slowest"][:12]
    return figures


def traced_by_run(report: dict) -> dict:
    run = report.get("run")
    if not isinstance(run, list) or "profile" not in run[0]:
        raise RuntimeError("the run part did not trace its program (it failed or was skipped)")
    return run[0].pop("profile")


def measure(preset: str, smoke: bool, steps: int, loss_steps: int, parts: set[str], deadline: float, save) -> dict:
    import jax

    from bardflow.model.training.step_settings import resolve

    cfg = configured(preset, smoke)
    platform = jax.devices()[0].platform
    base = resolve(cfg.model, cfg.train, cfg.data.seq_len, platform)
    if smoke and platform != "tpu":  # Pallas's interpreter: the kernel runs, slowly
        base = dataclasses.replace(base, attention="splash", precision="bfloat16")
    report: dict = {"preset": preset, "step_settings": base.as_json()}
    profile_steps = 2 if smoke else 3
    # The run's own program is the one profiled where it takes a step a call: compiled once.
    traced_in_run = profile_steps if {"run", "profile"} <= parts and base.steps_per_call == 1 else 0
    timings = {
        "attention": lambda: attention_blocks(cfg, 2 if smoke else 10),
        "kernels": lambda: kernels(cfg, base, steps, loss_steps, platform),
        "calls": lambda: (
            [
                step_figures(cfg, dataclasses.replace(base, steps_per_call=1, unroll=False), 1, steps),
                step_figures(cfg, base, base.steps_per_call, steps),
            ]
            if base.steps_per_call > 1
            else [step_figures(cfg, base, 1, steps)]
        ),
        "run": lambda: [step_figures(cfg, base, base.steps_per_call, steps, traced=traced_in_run)],
        "batch": lambda: batches_and_remat(preset, smoke, cfg, steps, platform),
        "profile": lambda: (
            traced_by_run(report)
            if traced_in_run
            else profiled(cfg, dataclasses.replace(base, steps_per_call=1, unroll=False), profile_steps)
        ),
    }
    for name, part in timings.items():
        if name not in parts:
            continue
        if time.monotonic() > deadline:
            report[name] = {"skipped": "--budget-s spent"}
            continue
        started = time.perf_counter()
        try:
            report[name] = part()
        except Exception as error:  # noqa: BLE001 - one part's failure must not lose the others
            report[name] = {"failed": f"{type(error).__name__}: {str(error).strip()[:300]}"}
        print(f"{preset} {name}: {time.perf_counter() - started:.1f} s {json.dumps(report[name])[:600]}", flush=True)
        save(report)
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.tpu_step", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--presets", default="gpt2,quality,codelab")
    parser.add_argument(
        "--parts", default="attention,kernels,calls,batch,profile", help="a,b (every preset) or preset:a,b;preset:c"
    )
    parser.add_argument("--steps", type=int, default=20, help="steps per timed round")
    parser.add_argument("--loss-steps", type=int, default=50, help="steps whose losses the kernels compare")
    parser.add_argument("--smoke", action="store_true", help="small shapes: every part runs, on a CPU too")
    parser.add_argument("--out", type=Path, default=RESULTS, help=f"folder for the JSON (default {RESULTS})")
    parser.add_argument("--budget-s", type=float, default=1e9, help="no part starts after this many seconds")
    args = parser.parse_args(argv)
    # "a,b" for every preset, or "preset:a,b;preset:c" for each its own
    chosen = dict(item.split(":", 1) for item in args.parts.split(";")) if ":" in args.parts else {}
    deadline = time.monotonic() + args.budget_s
    report = {"machine": machine(), "smoke": args.smoke, "presets": {}}
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out / f"{report['machine']['date']}-{report['machine']['backend']}-tpu-step.json"

    def save(found: dict) -> None:  # after every part: a part cut short loses only itself
        report["presets"][found["preset"]] = found
        out.write_text(json.dumps(report, indent=1))

    for preset in args.presets.split(","):
        parts = set(chosen.get(preset, "" if chosen else args.parts).split(","))
        measure(preset, args.smoke, args.steps, args.loss_steps, parts, deadline, save)
    print(f"written to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
