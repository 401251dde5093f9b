"""``python -m bench.profile``: where a training step's time goes, by kind of XLA operation.

Traces a few steps of the production step (codelab model, batch 32 x 256) with
``jax.profiler``, matches each executed operation to the compiled HLO, and sums the
time per kind: the optimizer's update, attention, the other matrix products, layout copies,
reductions, the rest. Writes the same table as JSON under ``bench/results/``.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import re
import tempfile
import time
from pathlib import Path

from bench.report import RESULTS, machine


def kinds_of(hlo: str) -> dict[str, tuple[str, str]]:
    """Instruction name -> (kind, shape) from compiled HLO text."""
    found = {}
    for line in hlo.splitlines():
        match = re.match(r"\s*(?:ROOT )?%?([\w.-]+) = (\S+) ([\w-]+)\(", line)
        if match is None:
            continue
        name, shape, opcode = match.groups()
        op_name = (re.search(r'op_name="([^"]*)"', line) or [None, ""])[1]
        # The step names two scopes (``jax.named_scope``): the optimizer's update and attention.
        if "/optimizer/" in op_name:
            kind = "optimizer"
        elif "/attention/" in op_name or opcode == "custom-call" and "tpu_custom_call" in line:
            kind = "attention"
        elif "dot_general" in op_name or opcode in ("dot", "convolution"):
            kind = "matrix products"
        elif opcode in ("copy", "transpose") or name.startswith(("copy", "transpose")):
            kind = "layout copies"
        elif "reduce" in op_name or "reduce" in name:
            kind = "reductions"
        else:
            kind = "elementwise and other"
        found[name] = (kind, shape)
    return found


def profile(compiled, state, stream, steps: int) -> dict:
    import jax

    state, loss = compiled(state, stream[0])
    jax.block_until_ready(loss)
    kinds = kinds_of(compiled.as_text())
    with tempfile.TemporaryDirectory() as trace_dir:
        started = time.perf_counter()
        jax.profiler.start_trace(trace_dir)
        for tokens in stream[1:]:
            state, loss = compiled(state, tokens)
        jax.block_until_ready(loss)
        jax.profiler.stop_trace()
        wall_ms = 1e3 * (time.perf_counter() - started) / steps
        trace = next(Path(trace_dir).rglob("*.trace.json.gz"))
        events = json.loads(gzip.open(trace).read())["traceEvents"]
    by_kind, by_op = collections.Counter(), collections.Counter()
    for event in events:
        if event.get("ph") == "X" and event.get("name") in kinds:
            kind, shape = kinds[event["name"]]
            by_kind[kind] += event["dur"] / 1e3 / steps
            by_op[(event["name"], kind, shape)] += event["dur"] / 1e3 / steps
    total = sum(by_kind.values())
    print(f"  {wall_ms:,.0f} ms/step wall, {total:,.0f} ms/step of traced operations (they overlap on several cores)")
    for kind, ms in by_kind.most_common():
        print(f"    {kind:<24} {ms:9,.0f} ms/step  {100 * ms / total:5.1f} %")
    print("    the eight slowest operations:")
    for (name, kind, shape), ms in by_op.most_common(8):
        print(f"      {ms:7,.1f} ms  {kind:<22} {shape:<28} {name}")
    return {
        "state": state,
        "wall_ms_per_step": wall_ms,
        "ms_per_step_by_kind": dict(by_kind.most_common()),
        "slowest": [{"name": n, "kind": k, "shape": s, "ms": ms} for (n, k, s), ms in by_op.most_common(20)],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.profile", description=__doc__)
    parser.add_argument("--steps", type=int, default=2, help="steps traced (default 2)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)

    import jax
    import numpy as np

    from bardflow.config.settings import build_config
    from bardflow.model.training.step import init_state, make_train_step
    from bardflow.model.training.step_settings import resolve

    cfg = build_config("codelab")
    backend = jax.default_backend()
    production = resolve(cfg.model, cfg.train, 256, backend)
    graphdef, state = init_state(production.model(cfg.model), cfg.train)
    stream = np.random.default_rng(0).integers(0, 256, (args.steps + 1, 32, 256), dtype=np.int32)
    # The production step (cache-sized passes, its compiler options); the same in one pass
    # over the whole batch; and that with XLA's default CPU options, where every matrix
    # product is a synchronous YNNPACK call, so the trace accounts for all of it (in the
    # other builds the products run asynchronously in Eigen's pool and only partly show).
    variants = {
        "production": (production.passes(32), production.xla_options),
        "one pass": (1, production.xla_options),
        "xla-default": (1, {}),
    }
    report = {"machine": machine(), "variants": {}}
    for variant, (passes, options) in variants.items():
        print(f"codelab model, batch 32 x 256, {backend}, {variant} build ({passes} passes per step):")
        compiled = make_train_step(graphdef, passes=passes).lower(state, stream[0]).compile(compiler_options=options)
        report["variants"][variant] = profile(compiled, state, stream, args.steps)
        report["variants"][variant]["passes"] = passes
        state = report["variants"][variant].pop("state")
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out / f"{report['machine']['date']}-{report['machine']['backend']}-profile.json"
    out.write_text(json.dumps(report, indent=1))
    print(f"written to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
