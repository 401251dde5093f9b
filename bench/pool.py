"""``python -m bench.pool --database postgresql|sqlite [--workers 4] [--configs 8]``: a pool of
GPU hosts, on this machine. One Prefect server (``bardflow server start``, its state in a
PostgreSQL server of its own or in SQLite), one bucket (SeaweedFS), ``--workers`` process
workers on one pool, each standing for a host of its own (a training slot each), and one
``bardflow sweep --pool`` of ``--configs`` configurations over them.

It checks what an operator needs of a server: every child run completes, each version is
built once (the stages the configurations share, once for all), no run is lost or left
running, and no log says "database is locked"; it reports the time per child, the wall time
and the server's CPU time. Exit status 1 if a check fails (with ``--expect-clean``, which CI
passes for PostgreSQL; on SQLite the report is the finding, whatever it is).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

from bench.commands import bardflow, tiny
from bench.report import REPO, RESULTS, machine, write_report

LOCKED = "database is locked"


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of ``pid`` and every process under it, so far."""
    import subprocess

    listed = subprocess.run(
        ["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True, check=False
    ).stdout.split()
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        own = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except OSError:
        own = 0.0
    return own + sum(_cpu_seconds(int(child)) for child in listed)


def _outcome(server, bucket, store: str, swept) -> dict:
    """What the sweep left: its children's end states and times, the versions in the bucket,
    and the lock errors in every log of the server, the workers and the sweep."""
    result = json.loads(swept.stdout) if swept.returncode in (0, 1) and swept.stdout.strip() else {}
    children = [server.api(f"/flow_runs/{run['flow_run']}") for run in result.get("runs", []) if run.get("flow_run")]
    durations = [
        (datetime.fromisoformat(c["end_time"]) - datetime.fromisoformat(c["start_time"])).total_seconds()
        for c in children
        if c.get("start_time") and c.get("end_time")
    ]
    per_stage: dict[str, int] = {}
    for path in bucket.filesystem().glob(f"{store[5:]}/*/*/manifest.json"):
        per_stage[path.split("/")[-3]] = per_stage.get(path.split("/")[-3], 0) + 1
    locked = sum(log.read_text(errors="replace").count(LOCKED) for log in server.home.glob("*.log"))
    return {
        "child_states": [c["state"]["type"] for c in children],
        "versions_per_stage": per_stage,
        "database_is_locked": locked + swept.stderr.count(LOCKED),
        "child_s": sorted(round(d, 1) for d in durations),
    }


def run(database: str, workers: int, configs: int, steps: int) -> dict:
    from tests.helpers import play_text
    from tests.servers import ObjectServer, PostgresServer, Server

    root = Path(tempfile.mkdtemp(prefix="bardflow-bench-pool-"))
    postgres = PostgresServer().serve() if database == "postgresql" else None
    bucket = ObjectServer(root / "s3")
    (root / "s3").mkdir()
    bucket.serve()
    # The pool's operation is measured, not each export's transformers check (torch's import
    # in every run's export: tests/test_hf_export.py covers it).
    env = {
        **os.environ,
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "DO_NOT_TRACK": "1",
        "BARDFLOW_CPU_TUNING": "off",
        "BARDFLOW_HF_CHECK": "off",
        "PREFECT_HOME": str(root / "prefect"),
    }
    env.pop("PREFECT_API_URL", None)
    (root / "prefect").mkdir()
    server = Server(root / "prefect", {**env, **bucket.env})  # every command here reaches the bucket
    prefect = str(Path(sys.executable).parent / "prefect")
    try:
        database_option = ["--database", postgres.url] if postgres else []
        started = server.run(*bardflow("server", "start", "--port", str(server.port), *database_option), timeout=300)
        assert started.returncode == 0, started.stderr[-2000:]
        server_pid = json.loads((root / "prefect" / "server.json").read_text())["pid"]
        for command in (
            ["work-pool", "create", "--overwrite", "--type", "process", "bench"],
            ["--no-prompt", "deploy", "--name", "sweep", "--pool", "bench"],
        ):
            done = server.run(prefect, *command)
            assert done.returncode == 0, done.stdout + done.stderr
        for index in range(workers):  # a host each: a training slot of its own
            server.start(
                f"worker-{index}",
                prefect,
                "worker",
                "start",
                "--pool",
                "bench",
                "--limit",
                "1",
                env={
                    **server.env,
                    "BARDFLOW_TRAINING_SLOT": f"bench-host-{index}",
                    "BARDFLOW_WORKDIR": str(root / f"host-{index}"),
                },
            )
        corpus = root / "corpus.txt"
        corpus.write_bytes(play_text(64_000))
        store = bucket.prefix("pool")
        rates = ",".join(f"{0.001 * (1.5**i):.5f}" for i in range(configs))
        cpu_before, clock = _cpu_seconds(server_pid), time.monotonic()
        sweep = tiny(
            corpus,
            store,
            "--pool",
            "bench",
            "--grid",
            f"train.learning_rate={rates}",
            "--json",
            settings=[f"train.steps={steps}"],
        )
        swept = server.run(*bardflow("sweep", *sweep), timeout=1800)
        wall_s, server_cpu_s = time.monotonic() - clock, _cpu_seconds(server_pid) - cpu_before
        outcome = _outcome(server, bucket, store, swept)
        states, per_stage = outcome["child_states"], outcome["versions_per_stage"]
        report = {
            "database": database,
            "workers": workers,
            "configs": configs,
            "steps": steps,
            "sweep_exit": swept.returncode,
            **outcome,
            "wall_s": round(wall_s, 1),
            "server_cpu_s": round(server_cpu_s, 1),
            "sweep_stderr_tail": swept.stderr[-3000:] if swept.returncode else "",
        }
        checks = {
            "every child completed": states == ["COMPLETED"] * configs,
            "each shared version built once": per_stage.get("fetch") == 1
            and per_stage.get("encode") == 1
            and per_stage.get("train_single") == configs
            and per_stage.get("generate") == configs,
            "no run lost or left running": len(states) == configs
            and all(s in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED") for s in states),
            "no 'database is locked'": outcome["database_is_locked"] == 0,
        }
        report["checks"] = checks
        return report
    finally:
        server.stop_all()
        bucket.stop()
        if postgres is not None:
            postgres.stop()
            shutil.rmtree(postgres.home, ignore_errors=True)
        shutil.rmtree(root, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.pool", description=__doc__)
    parser.add_argument("--database", choices=("postgresql", "sqlite"), default="postgresql")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--configs", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--expect-clean", action="store_true", help="exit 1 unless every check passes")
    args = parser.parse_args(argv)
    os.chdir(REPO)
    report = run(args.database, args.workers, args.configs, args.steps)
    report["machine"] = machine()
    children = report["child_s"] or [0.0]
    flat = {
        "database": args.database,
        "workers": args.workers,
        "configs": args.configs,
        "wall_s": report["wall_s"],
        "child_s_median": children[len(children) // 2],
        "child_s_max": max(children),
        "server_cpu_s": report["server_cpu_s"],
        "database_is_locked": report["database_is_locked"],
        **{check: "yes" if passed else "NO" for check, passed in report["checks"].items()},
    }
    write_report(report, flat, args.out, f"pool-{args.database}")
    return 0 if all(report["checks"].values()) or not args.expect_clean else 1


if __name__ == "__main__":
    sys.exit(main())
