"""``python -m bench.compile_times [--presets quality,codelab,gpt2]``: what each way of writing
the training step costs to compile, and what it costs a step, per preset, on this machine's
first device, with no persistent compilation cache (every program compiled cold):

  before      the blocks unrolled and, on an accelerator, a call's steps written out, with JAX's
              default generator for dropout (the step before ``train.layers`` and the loop)
  loop        the same with a call's steps as a loop
  auto        what ``bardflow run`` takes here (``model/training/step_settings.py``)
  scanned     ``auto`` with the blocks as one loop over their stacked parameters

Each row: seconds to compile the program of one step and of a call of several, ms a step,
tokens/s and MFU. On a TPU a program compiles faster after a similar one in the same process
(docs/tpu-check.md, "One process, several programs"): the rows' compile times compare in their
order only, and a run's own is a fresh process's (the TPU check's step part). ``--smoke``:
small shapes and few steps (a CPU). Writes ``<date>-<backend>-compile-times.json`` under
``--out``; docs/benchmarks.md and
docs/tpu-check.md hold the figures.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from pathlib import Path

from bench.report import RESULTS, machine


def variants(base, platform: str) -> dict:
    """The step settings compared, by name (``base``: this platform's ``auto``)."""
    before = dataclasses.replace(
        base,
        layers="unrolled",
        unroll=base.steps_per_call > 1 and platform != "cpu",  # accelerators wrote a call's steps out
        generator="threefry2x32",
    )
    return {
        "before": before,
        "loop": dataclasses.replace(before, unroll=False),
        "auto": base,
        "scanned": dataclasses.replace(base, layers="scanned"),
    }


def measure(preset: str, smoke: bool, steps: int, chosen: list[str] | None = None) -> dict:
    import jax

    from bardflow.model.training.step_settings import resolve
    from bench.tpu_step import build_step, configured, step_figures

    cfg = configured(preset, smoke)
    platform = jax.devices()[0].platform
    base = resolve(cfg.model, cfg.train, cfg.data.seq_len, platform)
    found = {"preset": preset, "auto": base.as_json(), "variants": {}}
    for name, step in variants(base, platform).items():
        if chosen and name not in chosen:
            continue
        started = time.perf_counter()
        figures = step_figures(cfg, step, step.steps_per_call, steps)
        one_s = figures["compile_s"]
        if step.steps_per_call > 1 and step.unroll:  # the run's other program: a call of one step (a loop needs none)
            one_s = build_step(cfg, dataclasses.replace(step, steps_per_call=1, unroll=False), 1)[1]
        figures["compile_one_step_s"] = round(one_s, 1)
        figures["layers"], figures["unroll"], figures["generator"] = step.layers, step.unroll, step.generator
        found["variants"][name] = figures
        print(
            f"{preset:8} {name:8} one step {one_s:6.1f} s, {step.steps_per_call} a call "
            f"{figures['compile_s']:6.1f} s, {figures['ms_per_step']:8.3f} ms a step, MFU {figures['mfu']} "
            f"({time.perf_counter() - started:.0f} s)",
            flush=True,
        )
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.compile_times", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--presets", default="quality,codelab,gpt2")
    parser.add_argument("--variants", default="before,loop,auto,scanned", help="which of them to measure")
    parser.add_argument("--steps", type=int, default=20, help="steps per timed round")
    parser.add_argument("--smoke", action="store_true", help="small shapes and few steps")
    parser.add_argument("--out", type=Path, default=RESULTS, help=f"folder for the JSON (default {RESULTS})")
    args = parser.parse_args(argv)
    os.environ.pop("JAX_COMPILATION_CACHE_DIR", None)  # every program compiled cold
    report = {"machine": machine(), "smoke": args.smoke, "presets": {}}
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out / f"{report['machine']['date']}-{report['machine']['backend']}-compile-times.json"
    for preset in args.presets.split(","):
        report["presets"][preset] = measure(
            preset, args.smoke, 2 if args.smoke else args.steps, args.variants.split(",")
        )
        out.write_text(json.dumps(report, indent=1))
    print(f"written to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
