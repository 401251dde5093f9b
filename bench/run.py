"""``python -m bench [--quick | --smoke]``: bardflow against the codelab-style baselines, measured in
one process, alternating A and B, reporting medians and the per-pair ratio.

Writes one table to the terminal and the same as JSON under ``bench/results/``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

from bench.commands import bardflow
from bench.report import REPO, RESULTS, SHARED_CORPUS, alternating, machine, write_report


class Mode(NamedTuple):
    """How much one run of the benchmark measures."""

    pairs: int  # alternating rounds of each comparison
    steps: int  # training steps per timed run
    new_bytes: int  # bytes sampled per call
    shape: str  # the preset whose model the training and learned-position sampling are timed on
    sampler_shapes: tuple[str, ...]  # the presets whose rotary models the sampler is timed on
    precision: tuple[int, int, int]  # float32 against bfloat16: timed steps, loss steps, rounds
    pipeline: str  # the preset whose whole pipeline is timed


# The quick mode times the same work per call as the full one (300 bytes: past the contexts,
# where the window slides or the cache wraps), in fewer rounds of fewer steps; the smoke mode
# only shows that every part runs.
MODES = {
    "full": Mode(6, 10, 300, "codelab", ("cpu", "codelab"), (10, 200, 5), "cpu"),
    "quick": Mode(4, 3, 300, "codelab", ("cpu", "codelab"), (10, 60, 2), "tiny"),
    "smoke": Mode(1, 2, 20, "tiny", ("tiny",), (2, 2, 1), "tiny"),
}


def summary(a: list[float], b: list[float]) -> dict:
    return {
        "a_median": statistics.median(a),
        "b_median": statistics.median(b),
        "ratio_median": statistics.median(y / x for x, y in zip(a, b, strict=True)),
        "a": a,
        "b": b,
    }


def bench_train(cfg, pairs: int, steps: int) -> dict:
    import jax
    import numpy as np
    import optax
    from flax import nnx

    from bardflow.model.network.transformer import build_model
    from bardflow.model.training.step import init_state, make_train_step
    from bardflow.model.training.step_settings import resolve
    from bench.codelab import codelab_train_step

    batch, seq_len = cfg.train.per_device_batch, cfg.data.seq_len
    stream = np.random.default_rng(0).integers(0, 256, (steps, batch, seq_len), dtype=np.int32)
    tokens_per_run = steps * batch * (seq_len - 1)

    model = build_model(cfg.model, cfg.train.init_seed)
    adamw = optax.adamw(cfg.train.learning_rate, weight_decay=cfg.train.weight_decay)
    optimizer = nnx.Optimizer(model, adamw, wrt=nnx.Param)
    started = time.perf_counter()
    jax.block_until_ready(codelab_train_step(model, optimizer, stream[0]))
    codelab_compile = time.perf_counter() - started

    step = resolve(cfg.model, cfg.train, seq_len, jax.default_backend())  # the production step, as the stages build it
    graphdef, state = init_state(step.model(cfg.model), cfg.train)
    started = time.perf_counter()
    dtype, passes = jax.numpy.dtype(step.precision), step.passes(batch)
    compiled = (
        make_train_step(graphdef, dtype=dtype, passes=passes)
        .lower(state, stream[0])
        .compile(compiler_options=step.xla_options)
    )
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

    peer = torch_runner(cfg, steps)
    a, b, *c = alternating([codelab, bardflow] + ([peer] if peer else []), pairs)
    result = summary(a, b)
    torch_result = summary(c[0], b) if c else None
    return {
        "codelab_tok_s": result["a_median"],
        "bardflow_tok_s": result["b_median"],
        "bardflow_over_codelab": result["ratio_median"],
        "codelab_ms_step": 1e3 * batch * (seq_len - 1) / result["a_median"],
        "bardflow_ms_step": 1e3 * batch * (seq_len - 1) / result["b_median"],
        "codelab_compile_s": codelab_compile,
        "bardflow_compile_s": bardflow_compile,
        "torch_tok_s": torch_result and torch_result["a_median"],
        "bardflow_over_torch": torch_result and torch_result["ratio_median"],
        "bardflow_precision": dtype.name,
        "bardflow_rows_per_pass": batch // passes,
        **utilisation(cfg, result["b_median"], dtype.name),
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "batch": [batch, seq_len],
        "steps_per_run": steps,
        "pairs": pairs,
        "raw": result,
        "raw_torch": torch_result,
    }


def utilisation(cfg, tokens_per_s: float, precision: str) -> dict:
    """Model FLOPs utilization of one device as the training manifest counts it
    (``model/training/utilization.py``: its formula and its table of peaks)."""
    import jax

    from bardflow.model.training.utilization import utilization

    kind = jax.devices()[0].device_kind
    used = utilization(cfg.model, cfg.data.seq_len, tokens_per_s, 1, kind, precision)
    return {"achieved_tflops": tokens_per_s * used["flops_per_token"] / 1e12, **used}


def bench_precision(mode: Mode) -> dict:
    """float32 against bfloat16 compute (``bench/precision.py``): the ``cpu`` preset's shape
    on a CPU, the ``codelab`` preset's on an accelerator (the ``tiny`` one in a smoke run),
    one device."""
    import jax

    from bench.precision import compare

    if not SHARED_CORPUS.exists():
        return {"skipped": f"no offline corpus at {SHARED_CORPUS}"}
    preset = "cpu" if jax.default_backend() == "cpu" else "codelab"
    if mode.shape == "tiny":  # a smoke run: the smallest shape everywhere
        preset = "tiny"
    return compare(preset, False, *mode.precision, SHARED_CORPUS)


def torch_runner(cfg, steps: int):
    """The PyTorch peer's timed run, if torch is installed (a benchmark-only extra)."""
    try:
        from bench.torch_peer import runner
    except ImportError:
        return None
    import jax

    return runner(cfg, steps, on_gpu=jax.default_backend() == "gpu")


def bench_generate(cfg, pairs: int, new_bytes: int, shapes: tuple[str, ...]) -> dict:
    from bardflow.model.inference.sampling import generate, generate_batch
    from bardflow.model.network.transformer import build_model
    from bench.codelab import codelab_generate, codelab_generate_batch

    model = build_model(cfg.model, 1)
    window = cfg.model.max_seq_len
    greedy_codelab = codelab_generate(model, b"ROMEO:", new_bytes, 0.0, 42, window)
    greedy_bardflow = generate(model, "ROMEO:", new_bytes, 0.0, 42, window)

    a, b = alternating(
        [
            timed_n(lambda: codelab_generate(model, b"ROMEO:", new_bytes, 0.8, 42, window), new_bytes),
            timed_n(lambda: generate(model, "ROMEO:", new_bytes, 0.8, 42, window), new_bytes),
        ],
        pairs,
    )
    result = summary(a, b)
    seeded = generate(model, "ROMEO:", new_bytes, 0.8, 7, window) == generate(
        model, "ROMEO:", new_bytes, 0.8, 7, window
    )
    seeds = list(range(8))
    codelab_generate_batch(model, b"ROMEO:", 1, 0.8, seeds, window)  # compile both for batch 8 first
    generate_batch(model, "ROMEO:", 1, 0.8, seeds, window)
    a8, b8 = alternating(
        [
            timed_n(lambda: codelab_generate_batch(model, b"ROMEO:", new_bytes, 0.8, seeds, window), 8 * new_bytes),
            timed_n(lambda: generate_batch(model, "ROMEO:", new_bytes, 0.8, seeds, window), 8 * new_bytes),
        ],
        pairs,
    )
    batch8 = summary(a8, b8)
    within = min(new_bytes, window - len(b"ROMEO:"))  # at most the longest sample that never slides
    a_in, b_in = alternating(
        [
            timed_n(lambda: codelab_generate(model, b"ROMEO:", within, 0.8, 42, window), within),
            timed_n(lambda: generate(model, "ROMEO:", within, 0.8, 42, window), within),
        ],
        pairs,
    )
    inside = summary(a_in, b_in)
    rotary = bench_rotary_generate(pairs, new_bytes, shapes)
    return {
        "rotary": rotary,
        "codelab_bytes_s": result["a_median"],
        "bardflow_bytes_s": result["b_median"],
        "bardflow_over_codelab": result["ratio_median"],
        "greedy_identical": greedy_codelab == greedy_bardflow,
        "sampled_reproducible": seeded,
        "new_bytes": new_bytes,
        "batch": 1,
        "raw": result,
        "batch8": {
            "codelab_bytes_s": batch8["a_median"],
            "bardflow_bytes_s": batch8["b_median"],
            "bardflow_over_codelab": batch8["ratio_median"],
            "raw": batch8,
        },
        "within_context": {
            "new_bytes": within,
            "codelab_bytes_s": inside["a_median"],
            "bardflow_bytes_s": inside["b_median"],
            "bardflow_over_codelab": inside["ratio_median"],
        },
    }


def bench_rotary_generate(pairs: int, new_bytes: int, shapes: tuple[str, ...]) -> dict:
    """``ROMEO:`` + ``new_bytes`` with rotary positions, on the presets' ``shapes`` (``cpu`` and
    ``codelab``) at batch 1 and 8: past either context (128 and 256 bytes) the cache wraps instead of the
    window being recomputed; against the codelab loop on the same model, warm (``alternating``)."""
    from bardflow.config.settings import build_config
    from bardflow.model.network.transformer import build_model

    results = {}
    for preset in shapes:
        cfg = build_config(preset)
        model = build_model(cfg.model.model_copy(update={"positions": "rope"}), 1)
        for batch in (1, 8):
            result = summary(*alternating(_sampler_runs(model, cfg.model.max_seq_len, batch, new_bytes), pairs))
            results[f"{preset}.batch{batch}"] = {
                "codelab_bytes_s": result["a_median"],
                "bardflow_bytes_s": result["b_median"],
                "bardflow_over_codelab": result["ratio_median"],
                "new_bytes": new_bytes,
                "window": cfg.model.max_seq_len,
                "raw": result,
            }
    return results


def _sampler_runs(model, window: int, batch: int, new_bytes: int) -> list:
    """The codelab loop and bardflow's sampler, ``ROMEO:`` + ``new_bytes`` for ``batch`` seeds."""
    from bardflow.model.inference.sampling import generate, generate_batch
    from bench.codelab import codelab_generate, codelab_generate_batch

    seeds = list(range(batch))
    if batch == 1:
        return [
            timed_n(lambda: codelab_generate(model, b"ROMEO:", new_bytes, 0.8, 42, window), new_bytes),
            timed_n(lambda: generate(model, "ROMEO:", new_bytes, 0.8, 42, window), new_bytes),
        ]
    return [
        timed_n(lambda: codelab_generate_batch(model, b"ROMEO:", new_bytes, 0.8, seeds, window), batch * new_bytes),
        timed_n(lambda: generate_batch(model, "ROMEO:", new_bytes, 0.8, seeds, window), batch * new_bytes),
    ]


def timed_n(fn, count: int):
    """A runner of ``fn`` that returns ``count`` (bytes made) per second."""

    def run() -> float:
        started = time.perf_counter()
        fn()
        return count / (time.perf_counter() - started)

    return run


CACHED_ROUNDS = 3  # fully cached runs timed in each setting; the median is reported


def bench_pipeline(preset: str, repo: Path = REPO) -> dict:
    """The preset's whole pipeline from ``repo`` (a checkout), on a fresh store, a fresh
    Prefect home and an empty compilation cache; then again fully cached; then on another
    fresh store with the compilation cache the first run left (a new run of a machine that
    has run before), each with a server of its own (``--server embedded``); then fully cached
    again, ``CACHED_ROUNDS`` times with the run's own server and as many with the kept one
    (started by the first of them, not timed), and ``CACHED_ROUNDS`` runs with the kept server
    that rebuild only ``generate``. Wall time, time in and outside the stages."""
    if not SHARED_CORPUS.exists():
        return {"skipped": f"no offline corpus at {SHARED_CORPUS}"}
    try:
        import prefect  # noqa: F401 - a GPU box may have the JAX stack but not Prefect
    except ImportError:
        return {"skipped": "prefect is not installed"}
    with tempfile.TemporaryDirectory() as tmp:
        env = {
            **os.environ,
            "PREFECT_HOME": f"{tmp}/prefect",
            "JAX_COMPILATION_CACHE_DIR": f"{tmp}/jax",
            "BARDFLOW_SERVER_FILE": f"{tmp}/server.json",
        }
        env.pop("PREFECT_API_URL", None)

        def run(store: str, *extra: str) -> dict:
            where = ["--preset", preset, "--corpus", str(SHARED_CORPUS), "--store", f"{tmp}/{store}"]
            command = bardflow("run", *where, "--json", *(extra or ("--server", "embedded")))
            started = time.perf_counter()
            done = subprocess.run(command, cwd=repo, env=env, check=True, capture_output=True, text=True)
            wall = time.perf_counter() - started
            summary = json.loads(done.stdout)["stages"]
            stages = {name: stage["seconds"] for name, stage in summary.items()}
            # Everything outside the stage calls: interpreter and imports, the embedded
            # Prefect server's start and stop, the flow run's own bookkeeping.
            return {
                "wall_s": wall,
                "stages_s": sum(stages.values()),
                "outside_stages_s": wall - sum(stages.values()),
                "per_stage_s": stages,
                # the model that is checkpointed, verified and sampled
                "val_loss": summary["train_parallel"]["metrics"].get("val_loss"),
            }

        runs = [run(store) for store in ("store", "store", "store-2")]
        embedded = [run("store")["wall_s"] for _ in range(CACHED_ROUNDS)]
        try:
            run("store", "--server", "kept")  # starts it
            kept = [run("store", "--server", "kept")["wall_s"] for _ in range(CACHED_ROUNDS)]
            generate = [
                run("store", "--server", "kept", "--refresh", "generate")["wall_s"] for _ in range(CACHED_ROUNDS)
            ]
        finally:
            server = [sys.executable, "-m", "bardflow", "server"]
            subprocess.run([*server, "stop"], cwd=repo, env=env, check=False, capture_output=True)
    return {
        "preset": preset,
        "fresh_s": runs[0]["wall_s"],
        "cached_rerun_s": runs[1]["wall_s"],
        "warm_compile_s": runs[2]["wall_s"],
        "val_loss": runs[0]["val_loss"],
        "cached_embedded_s": statistics.median(embedded),
        "cached_kept_s": statistics.median(kept),
        "generate_only_kept_s": statistics.median(generate),
        "fresh": runs[0],
        "cached_rerun": runs[1],
        "warm_compile": runs[2],
    }


@contextlib.contextmanager
def checkout(revision: str):
    """``revision`` of this repository in a temporary work tree (removed afterwards)."""
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "tree"
        subprocess.run(
            ["git", "-C", str(REPO), "worktree", "add", "--detach", str(tree), revision],
            check=True,
            capture_output=True,
        )
        try:
            yield tree
        finally:
            subprocess.run(
                ["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)], check=False, capture_output=True
            )


PIPELINE_FIGURES = ("fresh_s", "cached_embedded_s", "cached_kept_s", "generate_only_kept_s", "val_loss")


def pipeline_only(preset: str, against: str | None, folder: Path) -> int:
    """The whole pipeline's figures, this checkout's beside ``against``'s when given."""
    report = {"machine": machine(), "mode": "pipeline", "pipeline": bench_pipeline(preset)}
    flat = {f"pipeline.{key}": report["pipeline"].get(key) for key in PIPELINE_FIGURES}
    if against:
        with checkout(against) as tree:
            report["pipeline_against"] = {"revision": against, **bench_pipeline(preset, tree)}
        flat.update({f"pipeline[{against}].{key}": report["pipeline_against"].get(key) for key in PIPELINE_FIGURES})
    out = write_report(report, flat, folder, "pipeline")
    print(f"written to {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer rounds and steps than the full run")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="every part once at its smallest (the tiny preset's shape, 20 sampled bytes, "
        "2 steps): shows that the benchmark runs; its figures mean nothing",
    )
    parser.add_argument("--steps", type=int, help="training steps per timed run (default 10, quick 3, smoke 2)")
    parser.add_argument("--pairs", type=int, help="A/B pairs (default 6, quick 4, smoke 1)")
    parser.add_argument("--out", type=Path, default=RESULTS, help=f"folder for the JSON (default {RESULTS})")
    parser.add_argument(
        "--no-pipeline",
        action="store_true",
        help="skip the whole-pipeline timing (the GPU check times the pipeline on its own)",
    )
    parser.add_argument("--pipeline-only", action="store_true", help="time the whole pipeline alone")
    parser.add_argument(
        "--against", metavar="REVISION", help="time the whole pipeline of this git revision too, beside this checkout's"
    )
    args = parser.parse_args(argv)
    if args.pipeline_only:
        return pipeline_only(
            MODES["smoke" if args.smoke else "quick" if args.quick else "full"].pipeline, args.against, args.out
        )

    from bardflow.config.settings import build_config

    name = "smoke" if args.smoke else "quick" if args.quick else "full"
    mode = MODES[name]
    cfg, preset = build_config(mode.shape), mode.pipeline
    pairs, steps = args.pairs or mode.pairs, args.steps or mode.steps
    report = {"machine": machine(), "mode": name}
    sections = {
        "train": lambda: bench_train(cfg, pairs, steps),
        "generate": lambda: bench_generate(cfg, pairs, mode.new_bytes, mode.sampler_shapes),
        "precision": lambda: bench_precision(mode),
        "pipeline": lambda: {"skipped": "--no-pipeline"} if args.no_pipeline else bench_pipeline(preset),
    }
    for section, measure in sections.items():
        started = time.perf_counter()
        report[section] = measure()
        # As each section ends, so that a run stopped at a time limit still says how far it got.
        print(f"{section}: measured in {time.perf_counter() - started:.1f} s", flush=True)
    flat = {
        "train.codelab_tok_s": report["train"]["codelab_tok_s"],
        "train.bardflow_tok_s": report["train"]["bardflow_tok_s"],
        "train.torch_tok_s": report["train"]["torch_tok_s"],
        "train.bardflow_over_torch": report["train"]["bardflow_over_torch"],
        "generate.codelab_bytes_s": report["generate"]["codelab_bytes_s"],
        "generate.bardflow_bytes_s": report["generate"]["bardflow_bytes_s"],
        "generate.greedy_identical": report["generate"]["greedy_identical"],
        "generate.batch8_codelab_bytes_s": report["generate"]["batch8"]["codelab_bytes_s"],
        "generate.batch8_bardflow_bytes_s": report["generate"]["batch8"]["bardflow_bytes_s"],
        "generate.within_context_over_codelab": report["generate"]["within_context"]["bardflow_over_codelab"],
        **{
            f"generate.rotary_{shape}_over_codelab": figures["bardflow_over_codelab"]
            for shape, figures in report["generate"]["rotary"].items()
        },
        "train.mfu": report["train"]["mfu"],
        "precision.bfloat16_speedup": report["precision"].get("bfloat16_speedup"),
        "precision.bf16_minus_f32_loss": report["precision"].get("bfloat16_minus_float32_loss"),
        "pipeline.cpu_preset_s": report["pipeline"].get("fresh_s") if preset == "cpu" else None,
        f"pipeline.{preset}_preset_s": report["pipeline"].get("fresh_s"),
        "pipeline.cached_rerun_s": report["pipeline"].get("cached_rerun_s"),
        "pipeline.val_loss": report["pipeline"].get("val_loss"),
        "pipeline.cached_rerun_outside_stages_s": report["pipeline"].get("cached_rerun", {}).get("outside_stages_s"),
        "pipeline.cached_embedded_s": report["pipeline"].get("cached_embedded_s"),
        "pipeline.cached_kept_s": report["pipeline"].get("cached_kept_s"),
        "pipeline.generate_only_kept_s": report["pipeline"].get("generate_only_kept_s"),
    }
    out = write_report(report, flat, args.out, report["mode"])
    versus_torch = report["train"]["bardflow_over_torch"]
    print(
        f"train: bardflow/codelab = {report['train']['bardflow_over_codelab']:.2f}x, bardflow/torch = "
        f"{f'{versus_torch:.2f}x' if versus_torch else 'no torch'} (medians of {pairs} rounds); "
        f"generate: {report['generate']['bardflow_over_codelab']:.1f}x"
    )
    print(f"written to {out}")
    return 0
