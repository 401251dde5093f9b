"""``python -m bench.collectives [--quiet-runs N] [--hog-runs N] [--steps S] [--eval-every K]``:
data-parallel training on two emulated CPU devices, repeated on a quiet machine and beside a
CPU hog (a busy loop on every core), counting aborts and stalls and comparing every run's
losses with the first finished run's. Exit status 1 if any run aborted, stalled or trained
differently. Before the fix this loop, beside the hog, aborted in each of its first runs.

Each run is the real training loop (``model.loop.train``) in a fresh process, the ``cpu``
preset's shape on TinyShakespeare (or generated text), validating on the whole split every
``--eval-every`` steps: evaluation is where dozens of programs were once launched back to
back, which could wedge XLA:CPU's client between the two devices until its 40 s rendezvous
timeout aborted the process (docs/reliability.md). A stall is XLA's own report of a
collective that waited ``STALL_S`` seconds for the other device; a step here takes well
under a second even beside the hog.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import subprocess
import sys
import time
from pathlib import Path

from bench.report import REPO, RESULTS, SHARED_CORPUS, machine, write_report

STALL_S = 5  # XLA logs "may be stuck" once a collective has waited this long
ABORT_S = 60  # and ends the process (SIGABRT) after this long
ABORTED = (-6, 134)


def _spin() -> None:
    while True:
        pass


def train_once(steps: int, eval_every: int) -> dict:
    """One run, in this process (the child's side): the losses it recorded."""
    import jax
    import numpy as np

    from bardflow.config.settings import build_config
    from bardflow.model.training.evaluation import val_batches
    from bardflow.model.training.loop import TrainingSetup, train
    from bardflow.model.training.placement import Placement
    from bardflow.model.training.step import init_state
    from bardflow.model.training.step_settings import CPU_TOKENS_PER_PASS, resolve

    cfg = build_config(
        "cpu",
        {
            "train.steps": steps,
            "train.single_device_steps": 0,
            "train.log_every": eval_every,
            "train.eval_every": 0,
            "train.warmup_steps": min(20, steps // 2),
        },
    )
    text = SHARED_CORPUS.read_bytes() if SHARED_CORPUS.exists() else _generated_text()
    seq = cfg.data.seq_len + 1  # every position trained: windows of seq_len + 1 bytes
    data = np.frombuffer(text, np.uint8)
    count = (len(data) - 1) // cfg.data.seq_len
    rows = data[np.arange(count)[:, None] * cfg.data.seq_len + np.arange(seq)[None, :]]
    cut = int(cfg.data.train_fraction * count)
    train_rows, val_rows = rows[:cut], rows[cut:]
    devices = jax.devices()
    placement = Placement.data_parallel(devices)
    train_cfg, step = cfg.train, resolve(cfg.model, cfg.train, seq, "cpu")  # the CPU's defaults
    graphdef, state = init_state(step.model(cfg.model), train_cfg)
    batch = train_cfg.per_device_batch * len(devices)
    # The evaluation batches the training stage uses on a CPU (model/training/training_run.py).
    val = val_batches(val_rows, max(1, 2 * CPU_TOKENS_PER_PASS // seq) * len(devices), multiple=len(devices))
    started = time.perf_counter()
    result = train(
        TrainingSetup(
            graphdef,
            state,
            lambda step: train_rows[(step * batch) % (len(train_rows) - batch) :][:batch].astype(np.int32),
            val,
            placement,
            train_cfg,
            step=step,
        )
    )
    return {
        "seconds": round(time.perf_counter() - started, 2),
        "ms_per_step": round(result.ms_per_step, 1),
        "history": [{k: h[k] for k in ("step", "loss", "val_loss")} for h in result.history],
    }


def _generated_text() -> bytes:
    import numpy as np

    rng = np.random.default_rng(0)
    words = "the of and to my thou thee lord good love what shall not with be is ROMEO JULIET".split()
    return " ".join(rng.choice(words, size=200_000)).encode()


def run_child(steps: int, eval_every: int, hog: bool, timeout_s: float) -> dict:
    env = {
        **os.environ,
        "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=2 "
        f"--xla_cpu_collective_call_warn_stuck_timeout_seconds={STALL_S} "
        f"--xla_cpu_collective_call_terminate_timeout_seconds={ABORT_S}".strip(),
        "JAX_PLATFORMS": "cpu",
    }
    hogs = [multiprocessing.Process(target=_spin, daemon=True) for _ in range(os.cpu_count() or 1)] if hog else []
    for process in hogs:
        process.start()
    started = time.monotonic()
    try:
        done = subprocess.run(
            [sys.executable, "-m", "bench.collectives", "--child", str(steps), str(eval_every)],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
        code, out, err = done.returncode, done.stdout, done.stderr
    except subprocess.TimeoutExpired as expired:
        code, out, err = None, expired.stdout or "", (expired.stderr or "") if isinstance(expired.stderr, str) else ""
    finally:
        for process in hogs:
            process.terminate()
    last = out.strip().splitlines()[-1] if out.strip() else ""
    record = {
        "hog": hog,
        "exit": code,
        "wall_s": round(time.monotonic() - started, 1),
        "stalls": err.count("may be stuck"),
        "aborted": code in ABORTED,
        "timed_out": code is None,
    }
    if code == 0 and last.startswith("{"):
        record.update(json.loads(last))
    else:
        record["stderr_tail"] = err[-1500:]
    return record


def main(argv: list[str] | None = None) -> int:
    if argv is None and sys.argv[1:2] == ["--child"]:
        print(json.dumps(train_once(int(sys.argv[2]), int(sys.argv[3]))), flush=True)
        return 0
    parser = argparse.ArgumentParser(
        prog="python -m bench.collectives", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quiet-runs", type=int, default=1, help="runs on a quiet machine (default 1)")
    parser.add_argument("--hog-runs", type=int, default=2, help="runs beside a busy loop on every core (default 2)")
    parser.add_argument("--steps", type=int, default=150, help="training steps a run (default 150)")
    parser.add_argument("--eval-every", type=int, default=1, help="validate every K steps (default 1)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds a run may take (default 900)")
    parser.add_argument("--out", type=Path, default=RESULTS, help=f"folder for the JSON (default {RESULTS})")
    args = parser.parse_args(argv)

    runs = []
    for hog in [False] * args.quiet_runs + [True] * args.hog_runs:
        record = run_child(args.steps, args.eval_every, hog, args.timeout)
        runs.append(record)
        print(
            f"{'beside a hog' if hog else 'quiet':>12}: exit {record['exit']}, {record['stalls']} stall(s), "
            f"{record['wall_s']} s" + (f", {record['ms_per_step']} ms/step" if "ms_per_step" in record else ""),
            flush=True,
        )
    reference = next((r["history"] for r in runs if "history" in r), None)
    for record in runs:
        record["same_losses"] = "history" in record and record["history"] == reference
    bad = [r for r in runs if r["exit"] != 0 or r["stalls"] or not r["same_losses"]]
    flat = {
        "runs": len(runs),
        "aborted": sum(r["aborted"] for r in runs),
        "timed_out": sum(r["timed_out"] for r in runs),
        "stalls": sum(r["stalls"] for r in runs),
        "losses_differ": sum(not r["same_losses"] for r in runs),
        "evaluations_per_run": args.steps // args.eval_every + 1,
        "stall_bound_s": STALL_S,
    }
    report = {"machine": machine(), "steps": args.steps, "eval_every": args.eval_every, "runs": runs}
    out = write_report(report, flat, args.out, "collectives")
    print(f"written to {out}")
    for record in bad:
        print(
            f"FAILED ({'beside a hog' if record['hog'] else 'quiet'}): exit {record['exit']}, {record['stalls']} "
            f"stall(s), losses {'equal' if record['same_losses'] else 'differ'}\n{record.get('stderr_tail', '')}",
            file=sys.stderr,
        )
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
