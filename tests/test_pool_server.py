"""`bardflow server start --database`: the pool's server on PostgreSQL (Debian's, which
.ci/run installs), with what the pool keeps there: a training slot, a notification's block
and automations. (The load of a pool — a sweep over four workers — is `python -m bench.pool`,
which CI runs on PostgreSQL and on SQLite.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from bardflow.flows.server import ServerError, database_url

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

    from bardflow.flows import notify
    from bardflow.flows.slots import training_slot
    from tests.helpers import REPO
    from tests.servers import PostgresServer, Server

    if PostgresServer.binaries() is None:
        pytest.skip("PostgreSQL is not installed (.ci/run installs it)")
    postgres = PostgresServer().serve()
    server = Server(tmp_path, {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"})
    try:
        started = server.run(sys.executable, "-m", "bardflow", "server", "start", "--port", str(server.port),
                             "--database", postgres.url.replace("bardflow@", "bardflow:secret@"))
        assert started.returncode == 0, started.stderr[-2000:]
        assert f"database postgresql+asyncpg://bardflow:***@127.0.0.1:{postgres.port}/prefect" in started.stdout
        with temporary_settings(updates={PREFECT_API_URL: server.env["PREFECT_API_URL"]}):
            said = []
            with training_slot("train_single", said.append, name="bardflow-training-pg-host"):
                assert server.api("/v2/concurrency_limits/bardflow-training-pg-host")["active_slots"] == 1
            assert server.api("/v2/concurrency_limits/bardflow-training-pg-host")["active_slots"] == 0
            notify.add("http://127.0.0.1:9/hook", "pg")
            assert notify.listed() == [{"name": "pg", "messages": ["crashed", "failed", "sweep"], "enabled": True}]
        # The server's tables are PostgreSQL's: the automations are rows there.
        rows = subprocess.run(
            postgres._as_owner(str(postgres.binaries() / "psql"), "-h", "127.0.0.1", "-p", str(postgres.port), "-U",
                               postgres.USER, "-d", postgres.DATABASE, "-tAc", "select name from automation"),
            capture_output=True, text=True, cwd=REPO)
        assert sorted(rows.stdout.split()) == [f"bardflow-notify-pg-{what}" for what in ("crashed", "failed", "sweep")]
        assert json.loads((tmp_path / "server.json").read_text())["database"].startswith("postgresql+asyncpg://")
    finally:
        server.stop_all()
        postgres.stop()
