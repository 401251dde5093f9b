"""``python -m bench.pipeline [--preset cpu] [--baseline REV] [--rounds N]``: the whole
pipeline's wall time and final validation loss, fresh (an empty compilation cache too),
fully cached, and on a fresh store with the compilation cache warm, for this checkout
and, with ``--baseline``, for another revision of it checked out beside (a ``git
worktree``), alternating the two so that a noisy machine hits both alike.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
from pathlib import Path

from bench.report import REPO, RESULTS, machine, write_report
from bench.run import bench_pipeline


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.pipeline", description=__doc__)
    parser.add_argument("--preset", default="cpu")
    parser.add_argument("--baseline", metavar="REV", help="a git revision to measure in the same run, e.g. HEAD~3")
    parser.add_argument("--rounds", type=int, default=1, help="runs of each tree (default 1)")
    parser.add_argument("--out", type=Path, default=RESULTS, help=f"folder for the JSON (default {RESULTS})")
    args = parser.parse_args(argv)

    trees = {"this": REPO}
    with tempfile.TemporaryDirectory() as tmp:
        if args.baseline:
            trees["baseline"] = Path(tmp) / "baseline"
            subprocess.run(
                ["git", "worktree", "add", "--detach", str(trees["baseline"]), args.baseline],
                cwd=REPO,
                check=True,
                capture_output=True,
            )
        try:
            runs: dict[str, list[dict]] = {name: [] for name in trees}
            for _ in range(args.rounds):
                for name, tree in trees.items():
                    runs[name].append(bench_pipeline(args.preset, tree))
        finally:
            if args.baseline:
                subprocess.run(["git", "worktree", "remove", "--force", str(trees["baseline"])], cwd=REPO, check=False)
    flat = {}
    for name, results in runs.items():
        if "skipped" in results[0]:
            print(f"{name}: skipped: {results[0]['skipped']}")
            return 1
        flat[f"{name}.fresh_s"] = statistics.median(r["fresh_s"] for r in results)
        flat[f"{name}.cached_rerun_s"] = statistics.median(r["cached_rerun_s"] for r in results)
        flat[f"{name}.warm_compile_s"] = statistics.median(r["warm_compile_s"] for r in results)
        flat[f"{name}.val_loss"] = results[-1]["val_loss"]
    if args.baseline:
        flat["this_over_baseline_wall"] = flat["this.fresh_s"] / flat["baseline.fresh_s"]
    report = {"machine": machine(), "preset": args.preset, "baseline": args.baseline, "runs": runs}
    out = write_report(report, flat, args.out, f"pipeline-{args.preset}")
    print(f"written to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
