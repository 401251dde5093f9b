"""``python -m bench [--quick]``: bardflow against the codelab-style baselines, measured in
one process, alternating A and B, reporting medians and the per-pair ratio.

Writes one table to the terminal and the same as JSON under ``bench/results/``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
REPO = Path(__file__).resolve().parents[1]
SHARED_CORPUS = REPO.parent / "shared" / "data" / "tinyshakespeare.txt"


def machine() -> dict:
    import jax

    from artifacts.store import library_versions

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else platform.processor()
    return {"cpu": cpu, "cores": os.cpu_count(), "backend": jax.default_backend(),
            "devices": [str(d) for d in jax.devices()], "python": platform.python_version(),
            "libraries": library_versions(), "date": time.strftime("%Y-%m-%d")}


def paired(a, b, pairs: int) -> tuple[list[float], list[float]]:
    """Alternates A and B so drift (thermal, other load) hits both alike."""
    first, second = [], []
    for _ in range(pairs):
        first.append(a())
        second.append(b())
    return first, second


def summary(a: list[float], b: list[float]) -> dict:
    return {"a_median": statistics.median(a), "b_median": statistics.median(b),
            "ratio_median": statistics.median(y / x for x, y in zip(a, b)), "a": a, "b": b}


def bench_train(cfg, pairs: int, steps: int) -> dict:
    import jax
    import numpy as np
    import optax
    from flax import nnx

    from bench.codelab import codelab_train_step
    from model.train import init_state, make_train_step
    from model.transformer import build_model

    batch, seq_len = cfg.train.per_device_batch, cfg.data.seq_len
    stream = np.random.default_rng(0).integers(0, 256, (steps, batch, seq_len), dtype=np.int32)
    tokens_per_run = steps * batch * (seq_len - 1)

    model = build_model(cfg.model, cfg.train.init_seed)
    optimizer = nnx.Optimizer(model, optax.adamw(cfg.train.learning_rate, weight_decay=cfg.train.weight_decay), wrt=nnx.Param)
    started = time.perf_counter()
    jax.block_until_ready(codelab_train_step(model, optimizer, stream[0]))
    codelab_compile = time.perf_counter() - started

    graphdef, state = init_state(cfg.model, cfg.train)
    started = time.perf_counter()
    compiled = make_train_step(graphdef).lower(state, stream[0]).compile()
    bardflow_compile = time.perf_counter() - started
    box = {"state": state}

    def codelab() -> float:
        started = time.perf_counter()
        for tokens in stream:
            loss = codelab_train_step(model, optimizer, tokens)
        jax.block_until_ready(loss)
        return tokens_per_run / (time.perf_counter() - started)

    def bardflow() -> float:
        started = time.perf_counter()
        state = box["state"]
        for tokens in stream:
            state, loss = compiled(state, tokens)
        jax.block_until_ready(loss)
        box["state"] = state
        return tokens_per_run / (time.perf_counter() - started)

    a, b = paired(codelab, bardflow, pairs)
    result = summary(a, b)
    return {"codelab_tok_s": result["a_median"], "bardflow_tok_s": result["b_median"],
            "bardflow_over_codelab": result["ratio_median"],
            "codelab_ms_step": 1e3 * batch * (seq_len - 1) / result["a_median"],
            "bardflow_ms_step": 1e3 * batch * (seq_len - 1) / result["b_median"],
            "codelab_compile_s": codelab_compile, "bardflow_compile_s": bardflow_compile,
            "torch_tok_s": bench_torch(cfg, steps),
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "batch": [batch, seq_len], "steps_per_run": steps, "pairs": pairs, "raw": result}


def bench_torch(cfg, steps: int) -> float | None:
    """The PyTorch peer, if torch is installed (an optional benchmark-only extra)."""
    try:
        from bench.torch_peer import tokens_per_s
    except ImportError:
        return None
    return tokens_per_s(cfg, steps)


def bench_generate(cfg, pairs: int, new_bytes: int) -> dict:
    from bench.codelab import codelab_generate
    from model.sampling import generate
    from model.transformer import build_model

    model = build_model(cfg.model, 1)
    window = cfg.model.max_seq_len
    greedy_codelab = codelab_generate(model, b"ROMEO:", new_bytes, 0.0, 42, window)
    greedy_bardflow = generate(model, "ROMEO:", new_bytes, 0.0, 42, window)

    def timed(fn):
        def run() -> float:
            started = time.perf_counter()
            fn()
            return new_bytes / (time.perf_counter() - started)
        return run

    a, b = paired(timed(lambda: codelab_generate(model, b"ROMEO:", new_bytes, 0.8, 42, window)),
                  timed(lambda: generate(model, "ROMEO:", new_bytes, 0.8, 42, window)), pairs)
    result = summary(a, b)
    seeded = generate(model, "ROMEO:", new_bytes, 0.8, 7, window) == generate(model, "ROMEO:", new_bytes, 0.8, 7, window)
    return {"codelab_bytes_s": result["a_median"], "bardflow_bytes_s": result["b_median"],
            "bardflow_over_codelab": result["ratio_median"], "greedy_identical": greedy_codelab == greedy_bardflow,
            "sampled_reproducible": seeded, "new_bytes": new_bytes, "batch": 1, "raw": result}


def bench_pipeline(preset: str) -> dict:
    if not SHARED_CORPUS.exists():
        return {"skipped": f"no offline corpus at {SHARED_CORPUS}"}
    try:
        import prefect  # noqa: F401 - a GPU box may have the JAX stack but not Prefect
    except ImportError:
        return {"skipped": "prefect is not installed"}
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "PREFECT_HOME": f"{tmp}/prefect"}
        command = [sys.executable, "-m", "flows.cli", "run", "--preset", preset, "--corpus", str(SHARED_CORPUS),
                   "--store", f"{tmp}/store", "--json"]
        times = []
        for _ in range(2):
            started = time.perf_counter()
            subprocess.run(command, cwd=REPO, env=env, check=True, capture_output=True)
            times.append(time.perf_counter() - started)
    return {"preset": preset, "fresh_s": times[0], "cached_rerun_s": times[1]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer pairs, steps and bytes: minutes on a CPU")
    parser.add_argument("--steps", type=int, help="training steps per timed run (default 10, quick 3)")
    parser.add_argument("--pairs", type=int, help="A/B pairs (default 6, quick 2)")
    parser.add_argument("--out", type=Path, default=RESULTS, help=f"folder for the JSON (default {RESULTS})")
    args = parser.parse_args(argv)

    from model.config import build_config

    cfg = build_config("codelab")
    pairs, steps, new_bytes, preset = (2, 3, 100, "tiny") if args.quick else (6, 10, 300, "cpu")
    pairs, steps = args.pairs or pairs, args.steps or steps
    report = {"machine": machine(), "mode": "quick" if args.quick else "full",
              "train": bench_train(cfg, pairs, steps), "generate": bench_generate(cfg, pairs, new_bytes),
              "pipeline": bench_pipeline(preset)}
    flat = {
        "train.codelab_tok_s": report["train"]["codelab_tok_s"],
        "train.bardflow_tok_s": report["train"]["bardflow_tok_s"],
        "train.torch_tok_s": report["train"]["torch_tok_s"],
        "generate.codelab_bytes_s": report["generate"]["codelab_bytes_s"],
        "generate.bardflow_bytes_s": report["generate"]["bardflow_bytes_s"],
        "generate.greedy_identical": report["generate"]["greedy_identical"],
        "pipeline.cpu_preset_s": report["pipeline"].get("fresh_s") if preset == "cpu" else None,
        f"pipeline.{preset}_preset_s": report["pipeline"].get("fresh_s"),
        "pipeline.cached_rerun_s": report["pipeline"].get("cached_rerun_s"),
    }
    report["summary"] = flat
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out / f"{report['machine']['date']}-{report['machine']['backend']}-{report['mode']}.json"
    out.write_text(json.dumps(report, indent=1, default=str))
    width = max(map(len, flat))
    for key, value in flat.items():
        shown = f"{value:,.1f}" if isinstance(value, float) else str(value)
        print(f"{key:<{width}}  {shown}")
    print(f"train: bardflow/codelab = {report['train']['bardflow_over_codelab']:.2f}x (median of {pairs} pairs); "
          f"generate: {report['generate']['bardflow_over_codelab']:.1f}x")
    print(f"written to {out}")
    return 0
