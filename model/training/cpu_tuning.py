"""The CPU training step's settings, chosen by measuring them on this CPU, once.

What is fastest on one CPU is not on another (docs/benchmarks.md has the measurements), so
where the user left them to ``auto``, three choices are timed on the real shape:

  kernels         the hand-written gradients (custom) or XLA's own (xla)
  rows per pass   ~512 tokens per forward/backward pass, or the whole per-device batch
  XLA options     YNNPACK fusions off (tuned), or XLA's defaults

The defaults and each single change of them are compiled, then timed in turns (the median
round counts, so a host whose speed drifts slows every candidate alike), and the fastest is
used if it beats the defaults by ``MARGIN``; a shape slow to compile keeps the defaults. The
answer is kept per CPU model, instruction set, core count, JAX version, training shape and
device count in ``$BARDFLOW_CACHE_DIR/cpu-step.json``, so it is measured once; with one
device's answer known, several devices try only the XLA options again. Every candidate
computes the same step within float tolerance, and none enters a version key.
``BARDFLOW_CPU_TUNING=off`` keeps the defaults without measuring; a run of several processes
keeps them too (each process must compile the same program).
"""

from __future__ import annotations

import json
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypedDict, cast

import numpy as np

from ...config.machine import cache_dir
from .run_records import MeasuredChoice, StepChoice, Tuning
from .step_settings import resolve

FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16")
TIMED_STEPS, ROUNDS, WARM_STEPS = 3, 3, 1
MARGIN = 0.05  # a change must be this much faster to replace the default: timings this short are noisy
MAX_CANDIDATE_S = 12.0  # the defaults' compile and steps took longer: measuring the rest would take minutes


def cache_file() -> Path:
    return cache_dir() / "cpu-step.json"


class CpuSignature(TypedDict):
    """The machine a CPU measurement holds for."""

    cpu: str
    flags: list[str]  # of FLAGS, those the CPU has
    cores: int | None
    jax: str


def cpu_signature() -> CpuSignature:
    """What a measured choice holds for: the CPU, its vector instructions, cores, JAX."""
    import jax

    model, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and ":" in line:
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and ":" in line:
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return CpuSignature(cpu=model, flags=[f for f in FLAGS if f in flags], cores=os.cpu_count(), jax=jax.__version__)


def default_choice(model_cfg, train_cfg, seq_len: int) -> StepChoice:
    """A CPU's defaults (``model/training/step_settings.py``): the hand-written kernels for the settings left
    to ``auto``, ~512 tokens per pass, YNNPACK fusions off."""
    default = resolve(None, train_cfg, seq_len, "cpu")
    return StepChoice(kernels="custom", rows_per_pass=default.rows_per_pass, xla="tuned")


def candidates(model_cfg, train_cfg, seq_len: int) -> list[StepChoice]:
    """The defaults, then each single change of a setting the user left to ``auto``."""
    base = default_choice(model_cfg, train_cfg, seq_len)
    found = [base]
    if model_cfg.attention == "auto" and model_cfg.dense == "auto":
        found.append({**base, "kernels": "xla"})
    if not train_cfg.micro_batch and base["rows_per_pass"] != train_cfg.per_device_batch:
        found.append({**base, "rows_per_pass": train_cfg.per_device_batch})
    found.append({**base, "xla": "default"})
    return found


def compiled_step(model_cfg, train_cfg, placement, seq_len: int, choice: StepChoice):
    """``choice``'s training step compiled on this placement, with its placed start state and
    a placed batch of random tokens: (step, state, batch)."""
    from .step import init_state, make_train_step

    step = resolve(model_cfg, train_cfg, seq_len, "cpu", choice)
    graphdef, state = init_state(step.model(model_cfg), train_cfg)
    state = placement.put_state(state)
    rows = train_cfg.per_device_batch * len(placement.devices)
    tokens = np.random.default_rng(0).integers(0, model_cfg.vocab_size, (rows, seq_len), dtype=np.int32)
    batch = placement.put_batch(tokens)
    compiled = (
        make_train_step(
            graphdef,
            placement.shardings(state),
            placement.batch_sharding,
            passes=step.passes(train_cfg.per_device_batch),
            remat=step.remat,
            scanned=step.scanned,
        )
        .lower(state, batch)
        .compile(compiler_options=step.xla_options)
    )
    return compiled, state, batch


def prepare(model_cfg, train_cfg, placement, seq_len: int, choice: StepChoice):
    """``choice``'s step compiled on this placement and warm: a function that runs
    ``TIMED_STEPS`` more steps and returns their milliseconds per step."""
    import jax

    compiled, state, batch = compiled_step(model_cfg, train_cfg, placement, seq_len, choice)

    def run(steps: int) -> float:
        nonlocal state
        started = time.perf_counter()
        for _ in range(steps):
            state, _loss = compiled(state, batch)
        jax.block_until_ready(state)
        return 1e3 * (time.perf_counter() - started) / steps

    run(WARM_STEPS)
    return lambda: run(TIMED_STEPS)


def _kept_line(measured: list[MeasuredChoice], tried: int, best: MeasuredChoice, default: MeasuredChoice) -> str:
    """What the measurement kept, for the terminal."""
    gain = 100 * (1 - best["ms_per_step"] / default["ms_per_step"])
    return (
        f"measured {len(measured)} of {tried} step settings on one batch: kept kernels {best['kernels']}, "
        f"{best['rows_per_pass']} rows a pass, XLA options {best['xla']} ({best['ms_per_step']:.1f} ms a step"
        + (f", {gain:.0f} % less time a step than the defaults" if best is not default else ", the defaults")
        + ")"
    )


def _shape(model_cfg, train_cfg, seq_len: int, devices: int) -> dict:
    """What a measurement holds for, besides the CPU: the model, the batch and the devices."""
    return {
        "model": model_cfg.model_dump(mode="json", exclude={"attention", "dense"}),
        "per_device_batch": train_cfg.per_device_batch,
        "micro_batch": train_cfg.micro_batch,
        "fixed_kernels": None
        if model_cfg.attention == model_cfg.dense == "auto"
        else [model_cfg.attention, model_cfg.dense],
        "seq_len": seq_len,
        "devices": devices,
    }


def _keep(path: Path, known: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_suffix(f".{os.getpid()}.tmp")  # never a half-written cache
    temporary.write_text(json.dumps(known, indent=1))
    temporary.replace(path)


def choose(
    model_cfg,
    train_cfg,
    placement,
    seq_len: int,
    say: Callable[[str], None] = lambda line: None,
) -> Tuning:
    """The step's settings for this CPU and shape: from the cache, or measured now (``say``
    tells the user first: it takes seconds to a minute)."""
    import jax

    base = default_choice(model_cfg, train_cfg, seq_len)
    if os.environ.get("BARDFLOW_CPU_TUNING", "").lower() in ("off", "0", "false") or jax.process_count() > 1:
        why = "BARDFLOW_CPU_TUNING=off" if jax.process_count() == 1 else "several processes keep the defaults"
        return Tuning(chosen=base, measured=[], source=why)
    signature = {**cpu_signature(), **_shape(model_cfg, train_cfg, seq_len, len(placement.devices))}
    key = json.dumps(signature, sort_keys=True)
    path = cache_file()
    try:
        known = json.loads(path.read_text())
    except (OSError, ValueError):
        known = {}
    if key in known:
        return cast(Tuning, {**known[key], "source": f"measured before on this CPU ({path})"})
    tried, runs, note = candidates(model_cfg, train_cfg, seq_len), [], ""
    alone = known.get(json.dumps({**signature, "devices": 1}, sort_keys=True))
    if len(placement.devices) > 1 and alone:
        # A device's share is one device's shape, so its kernels and passes stand; what the
        # devices sharing the cores change is XLA's threading: only its options are tried again.
        first = alone["chosen"]
        tried = [first, {**first, "xla": "default" if first["xla"] == "tuned" else "tuned"}]
        note = "; kernels and rows per pass as measured on one device"
    say(
        f"measuring {len(tried)} training step settings on this CPU for this model shape, to keep the fastest "
        f"(once per machine and shape; kept in {path})"
    )
    for choice in tried:
        started = time.perf_counter()
        runs.append(prepare(model_cfg, train_cfg, placement, seq_len, choice))
        if len(runs) == 1 and time.perf_counter() - started > MAX_CANDIDATE_S:
            note = (
                f"; the defaults alone took {time.perf_counter() - started:.0f} s to compile and warm, so the rest "
                "were not"
            )
            break
    rounds = [[run() for run in runs] for _ in range(ROUNDS)]  # in turns: drift slows every candidate alike
    measured = [
        MeasuredChoice(**choice, ms_per_step=round(float(np.median(times)), 2))
        for choice, times in zip(tried, zip(*rounds, strict=True), strict=False)
    ]  # tried: maybe more than ran
    default, best = measured[0], min(measured, key=lambda m: m["ms_per_step"])
    if best["ms_per_step"] > (1 - MARGIN) * default["ms_per_step"]:
        best = default
    chosen = StepChoice(kernels=best["kernels"], rows_per_pass=best["rows_per_pass"], xla=best["xla"])
    say(_kept_line(measured, len(tried), best, default) + note)
    result = {"chosen": chosen, "measured": measured, "note": note}
    _keep(path, {**known, key: result})
    return Tuning(chosen=chosen, measured=measured, note=note, source="measured now")
