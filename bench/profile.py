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


def thread_names(events: list[dict]) -> dict[tuple, str]:
    """(pid, tid) -> "process/thread" from the trace's metadata events."""
    processes = {e["pid"]: e["args"].get("name", "") for e in events if e.get("name") == "process_name"}
    return {
        (e["pid"], e.get("tid")): f"{processes.get(e['pid'], '')}/{e['args'].get('name', '')}"
        for e in events
        if e.get("name") == "thread_name"
    }


def device_ops(events: list[dict]) -> tuple[list[dict], float]:
    """The executed operations of the trace and the device time of the programs they ran in:
    on a TPU or GPU the events of its "XLA Ops" line, the programs' time from its "XLA
    Modules" line; on a CPU the events naming their ``hlo_op`` (the programs' time then unknown:
    0). Each operation once, however many lines show it."""
    names = thread_names(events)
    timed = [e for e in events if e.get("ph") == "X"]
    ops = [e for e in timed if names.get((e["pid"], e.get("tid")), "").endswith("/XLA Ops")]
    modules = [e for e in timed if names.get((e["pid"], e.get("tid")), "").endswith("/XLA Modules")]
    if not ops:
        ops = [e for e in timed if "hlo_op" in e.get("args", {})]
    return leaves(ops), sum(e["dur"] for e in modules) / 1e3


def leaves(events: list[dict]) -> list[dict]:
    """The events that hold no other of their line: a loop's or a call's event spans the
    operations it ran, which are counted themselves."""
    found = []
    by_line = collections.defaultdict(list)
    for event in events:
        by_line[(event["pid"], event.get("tid"))].append(event)
    for line in by_line.values():
        line.sort(key=lambda e: (e["ts"], -e["dur"]))
        for event, after in zip(line, [*line[1:], None], strict=True):
            if after is None or after["ts"] >= event["ts"] + event["dur"]:
                found.append(event)
    return found


def cost_of(event: dict) -> tuple[float, float]:
    """The floating-point operations and bytes the trace says an operation did (0 where it
    does not say)."""
    args = event.get("args", {})

    def number(*keys: str) -> float:
        for key in keys:
            try:
                return float(args[key])
            except (KeyError, TypeError, ValueError):
                continue
        return 0.0

    return number("model_flops", "flops"), number("bytes_accessed", "raw_bytes_accessed")


def kind_of(event: dict, kinds: dict[str, tuple[str, str]]) -> tuple[str, str, str, bool]:
    """An executed operation's name, kind and shape, and whether the compiled HLO names it
    (a kernel's own name, or an operation of a nested computation, it does not)."""
    args = event.get("args", {})
    name = args.get("hlo_op", event["name"])
    kind, shape = kinds.get(name, (None, ""))
    matched = kind is not None
    if kind is None:
        long_name = str(args.get("long_name", name))
        kind = "attention" if "custom-call" in long_name or "custom_call" in long_name else "elementwise and other"
    if kind in ("elementwise and other", "reductions") and "convolution" in str(args.get("hlo_category", "")):
        kind = "matrix products"  # a fusion around a product, which the HLO's line does not show
    if "/optimizer/" in str(args.get("tf_op", "")):
        kind = "optimizer"
    return name, kind, shape, matched


def against_bounds(by_kind: collections.Counter, work: dict, peak_flops: float | None, bandwidth: float | None) -> dict:
    """Each kind's ms a step and share, its work (GFLOPs, GB), and where the chip's peak and
    bandwidth are known the time that work takes at its bound, and how far over it it runs."""
    total = sum(by_kind.values())
    found = {}
    for kind, ms in by_kind.most_common():
        flops, moved = work[kind]
        bound_ms = None
        if peak_flops and bandwidth and (flops or moved):
            bound_ms = 1e3 * max(flops / peak_flops, moved / bandwidth)
        found[kind] = {
            "ms_per_step": round(ms, 3),
            "share": round(ms / total, 4),
            "gflops": round(flops / 1e9, 2),
            "gbytes": round(moved / 1e9, 3),
            "bound_ms": None if bound_ms is None else round(bound_ms, 3),
            "over_bound": None if not bound_ms else round(ms / bound_ms, 2),
        }
    return found


def profile(
    compiled, state, stream, steps: int, peak_flops: float | None = None, bandwidth: float | None = None
) -> dict:
    """Traces ``steps`` calls of ``compiled`` and sums the device's operations by kind: each
    kind's ms a step, its share of the programs' device time (``covered``: how much of that
    time the kinds account for), and where the trace gives each operation's work and the
    chip's ``peak_flops`` and ``bandwidth`` are known, the time that work takes at the chip's
    bound (the larger of its products at the peak and its bytes at the bandwidth)."""
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
    ops, module_ms = device_ops(events)
    by_kind, by_op = collections.Counter(), collections.Counter()
    work: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0])
    unmatched = collections.Counter()
    categories = collections.Counter()  # XLA's own kinds, where the trace gives them (a TPU's)
    for event in ops:
        name, kind, shape, matched = kind_of(event, kinds)
        ms = event["dur"] / 1e3 / steps
        if not matched:
            unmatched[name] += ms
        if category := str(event.get("args", {}).get("hlo_category", "")):
            categories[category] += ms
        by_kind[kind] += ms
        by_op[(name, kind, shape)] += ms
        flops, moved = cost_of(event)
        work[kind][0] += flops / steps
        work[kind][1] += moved / steps
    total = sum(by_kind.values())
    program_ms = module_ms / steps
    covered = total / program_ms if program_ms else None
    print(
        f"  {wall_ms:,.1f} ms/step wall (traced), {program_ms:,.1f} ms/step of the step's programs on the device, "
        f"{total:,.1f} ms/step of operations" + (f" ({100 * covered:.0f} % of the programs' time)" if covered else "")
    )
    kinds_found = against_bounds(by_kind, work, peak_flops, bandwidth)
    for kind, found in kinds_found.items():
        bound_ms, ms = found["bound_ms"], found["ms_per_step"]
        said = f" (its bound {bound_ms:,.1f} ms: {ms / bound_ms:.2f}x)" if bound_ms else ""
        print(f"    {kind:<24} {ms:9,.1f} ms/step  {100 * found['share']:5.1f} %{said}")
    print("    the eight slowest operations:")
    for (name, kind, shape), ms in by_op.most_common(8):
        print(f"      {ms:7,.2f} ms  {kind:<22} {shape:<28} {name}")
    return {
        "state": state,
        "wall_ms_per_step": wall_ms,
        "program_ms_per_step": program_ms,
        "covered": None if covered is None else round(covered, 4),
        "ms_per_step_by_kind": dict(by_kind.most_common()),
        "kinds": kinds_found,
        "slowest": [{"name": n, "kind": k, "shape": s, "ms": ms} for (n, k, s), ms in by_op.most_common(20)],
        "not_in_the_hlo": [{"name": n, "ms": round(ms, 3)} for n, ms in unmatched.most_common(12)],
        "ms_per_step_by_xla_category": {c: round(ms, 3) for c, ms in categories.most_common()},
        "threads": sorted(set(thread_names(events).values()))[:40],
        "op_args": sorted({key for event in ops[:2000] for key in event.get("args", {})}),
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
