"""`bardflow server start --database`: the pool's server on PostgreSQL (Debian's, which
.ci/run installs), with what the pool keeps there: a training slot, a notification's block
and automations; and what a run that uses such a background server does when the server
dies under it. (The load of a pool — a sweep over four workers — is `python -m bench.pool`,
which CI runs on PostgreSQL and on SQLite.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bardflow.prefect_server.process import ServerError, database_url
from bench.commands import bardflow, tiny

pytestmark = pytest.mark.flow


def test_a_database_url_becomes_prefect_s_and_anything_else_is_refused():
    assert database_url("postgresql://u:p@127.0.0.1:5432/prefect") == "postgresql+asyncpg://u:p@127.0.0.1:5432/prefect"
    assert database_url("postgres://u@h/db") == "postgresql+asyncpg://u@h/db"
    assert database_url("sqlite:////srv/prefect.db") == "sqlite+aiosqlite:////srv/prefect.db"
    for bad in ("mysql://u@h/db", "127.0.0.1:5432"):
        with pytest.raises(ServerError, match="--database"):
            database_url(bad)


def test_the_server_keeps_the_pool_s_state_in_postgresql(tmp_path):
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from bardflow.prefect_server import notify
    from bardflow.prefect_server.slots import training_slot
    from tests.helpers import REPO
    from tests.servers import PostgresServer, Server

    if PostgresServer.binaries() is None:
        pytest.skip("PostgreSQL is not installed (.ci/run installs it)")
    postgres = PostgresServer().serve()
    server = Server(tmp_path, {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"})
    try:
        database = postgres.url.replace("bardflow@", "bardflow:secret@")
        started = server.run(*bardflow("server", "start", "--port", str(server.port), "--database", database))
        assert started.returncode == 0, started.stderr[-2000:]
        assert f"database postgresql+asyncpg://bardflow:***@127.0.0.1:{postgres.port}/prefect" in started.stdout
        with temporary_settings(updates={PREFECT_API_URL: server.env["PREFECT_API_URL"]}):
            said = []
            with training_slot("train_single", said.append, name="bardflow-training-pg-host"):
                assert server.api("/v2/concurrency_limits/bardflow-training-pg-host")["active_slots"] == 1
            assert server.api("/v2/concurrency_limits/bardflow-training-pg-host")["active_slots"] == 0
        # The operator's commands for a host's slot (docs/operations.md).
        prefect = str(Path(sys.executable).parent / "prefect")
        shown = server.run(prefect, "gcl", "inspect", "bardflow-training-pg-host")
        assert shown.returncode == 0 and "bardflow-training-pg-host" in shown.stdout, shown.stdout + shown.stderr
        raised = server.run(prefect, "gcl", "update", "bardflow-training-pg-host", "--limit", "8")
        assert raised.returncode == 0, raised.stdout + raised.stderr
        assert server.api("/v2/concurrency_limits/bardflow-training-pg-host")["limit"] == 8
        with temporary_settings(updates={PREFECT_API_URL: server.env["PREFECT_API_URL"]}):
            notify.add("http://127.0.0.1:9/hook", "pg")
            assert notify.listed() == [{"name": "pg", "messages": ["crashed", "failed", "sweep"], "enabled": True}]
        # The server's tables are PostgreSQL's: the automations are rows there.
        rows = subprocess.run(
            postgres._as_owner(
                str(postgres.binaries() / "psql"),
                "-h",
                "127.0.0.1",
                "-p",
                str(postgres.port),
                "-U",
                postgres.USER,
                "-d",
                postgres.DATABASE,
                "-tAc",
                "select name from automation",
            ),
            capture_output=True,
            text=True,
            cwd=REPO,
            check=False,
        )
        assert sorted(rows.stdout.split()) == [f"bardflow-notify-pg-{what}" for what in ("crashed", "failed", "sweep")]
        record = json.loads((tmp_path / "server.json").read_text())
        assert record["database"].startswith("postgresql+asyncpg://")
        dies_under_a_run(server, record["pid"], tmp_path)
    finally:
        if (tmp_path / "server.json").exists():
            server.stop_all()
        server.stop_processes()
        postgres.stop()


def dies_under_a_run(server, pid: int, tmp_path) -> None:
    """A run that found the background server (no PREFECT_API_URL), whose server is killed
    during training (a crash, the out-of-memory killer): the run ends within seconds in one
    line, exit 1, the step's checkpoint saved. (It used to retry every progress report for a
    minute while training stood still, then hang until Ctrl-C.)"""
    import signal
    import time

    from tests.helpers import REPO, play_text

    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(play_text(64_000, seed=7))
    store, steps = tmp_path / "store", 4000
    env = {k: v for k, v in server.env.items() if k != "PREFECT_API_URL"}  # found through BARDFLOW_SERVER_FILE
    settings = [f"train.steps={steps}", f"train.log_every={steps // 10}", f"train.checkpoint_every={steps}"]
    command = bardflow("run", *tiny(corpus, store, settings=settings))
    process = subprocess.Popen(
        command,
        cwd=REPO,
        env={**env, "PYTHONUNBUFFERED": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        for line in process.stderr:
            assert "temporary Prefect server" not in line  # it found the background one
            if "train_single (" in line and f"/{steps} (" in line:
                break
        os.killpg(pid, signal.SIGKILL)  # gone at once, as a crashed or OOM-killed server is
        stopped = time.monotonic()
        rest = process.stderr.read()
        process.wait(timeout=60)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    took_s = time.monotonic() - stopped
    # Silent for SILENT_FOR_S (4 s), then the step's checkpoint and out: 12-14 s while the run
    # waited out its 8 s grace.
    assert process.returncode == 1 and took_s < 8, (took_s, rest[-3000:])
    assert not [p for p in store.glob("*/.*") if p.name.startswith((".build-", ".lock-"))]
    last = rest.strip().splitlines()[-1]
    assert last.startswith(f"bardflow: error: the Prefect server at {server.url}/api stopped answering mid-run"), last
    assert "bardflow server start" in last and "Traceback" not in rest and "EventsWorker" not in rest, rest[-3000:]
    assert [p for p in store.glob("train_single/.resume-*/*") if p.name.isdigit()], "the step reached was not saved"
    (tmp_path / "server.json").unlink()
