"""The kept Prefect server: what the first run without a server starts and later runs use.
Two starts at once start one server; a kept server killed with ``kill -9`` takes its Prefect
server with it and is replaced by the next start, which says so; one idle for its stretch
stops by itself, leaves nothing running, and its record says it stopped. (The suite's runs
use embedded or shared servers: tests/conftest.py.)"""

from __future__ import annotations

import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.helpers import REPO

pytestmark = pytest.mark.slow  # Prefect servers of its own, started and killed

START = (
    "from bardflow.prefect_server.process import start_kept, wait_until_up\n"
    "server = start_kept()\n"
    "wait_until_up(server.starting) if server.starting else None\n"
    "print(server.api_url)\n"
)


def _env(tmp_path: Path, idle_minutes: str) -> dict[str, str]:
    env = {name: value for name, value in os.environ.items() if name not in ("PREFECT_API_URL", "BARDFLOW_SERVER")}
    env.update(
        PREFECT_HOME=str(tmp_path / "prefect"),  # a setup of its own: its own kept server
        BARDFLOW_CACHE_DIR=str(tmp_path / "cache"),
        BARDFLOW_SERVER_IDLE_MINUTES=idle_minutes,
        PREFECT_UI_ENABLED="false",  # its API is what is tested: the UI's files take seconds to lay out
    )
    env.pop("BARDFLOW_SERVER_FILE", None)
    return env


def _start(env: dict[str, str], command: tuple[str, ...] = ("-c", START)) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, *command], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


A_FLOW_RUN = (  # a run on the server Prefect's settings name, as a pipeline run reports to it
    "from prefect import flow\n"
    "@flow\n"
    "def shortest():\n"
    "    return 1\n"
    "print(shortest(return_state=True).state_details.flow_run_id)\n"
)

THEN_A_KILLED_RUN = (  # then a pipeline's flow run whose process is killed mid-run: no final state is sent
    "import os, signal\n"
    "from prefect.runtime import flow_run\n"
    "from bardflow.flows.environment import label_flow_run\n"
    "@flow\n"
    "def killed():\n"
    "    label_flow_run()\n"
    "    print(flow_run.id, flush=True)\n"
    "    os.kill(os.getpid(), signal.SIGKILL)\n"
    "killed()\n"
)


def _post(url: str, path: str, body: dict) -> dict:
    request = urllib.request.Request(
        f"{url}/api{path}", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    return json.loads(urllib.request.urlopen(request, timeout=10).read())


def _load(url: str, stop: threading.Event, made: list[str]) -> None:
    """Flow runs written as fast as the server takes them (finished ones: none stays in
    progress, so the next server can still go idle), until ``stop`` or the server is gone. A
    503 (SQLite busy) is retried, as Prefect's client does."""
    flow = _post(url, "/flows/", {"name": "load"})["id"]
    while not stop.is_set():
        try:
            made.append(_post(url, "/flow_runs/", {"flow_id": flow, "state": {"type": "COMPLETED"}})["id"])
        except urllib.error.HTTPError as error:
            if error.code != 503:
                raise
            time.sleep(0.05)
        except OSError:
            return


def _record(tmp_path: Path) -> dict:
    (found,) = (tmp_path / "cache" / "servers").glob("*.json")
    return json.loads(found.read_text())


def _answers(url: str) -> bool:
    try:
        return urllib.request.urlopen(f"{url}/api/health", timeout=2).read() == b"true"
    except OSError:
        return False


def _gone(pid: int, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except OSError:
            return True
        time.sleep(0.2)
    return False


def test_one_kept_server_for_two_first_runs_replaced_after_kill_9_and_gone_when_idle(tmp_path):
    env = _env(tmp_path, "60")
    try:
        _story(tmp_path, env)
    finally:  # whatever failed, no server of this test outlives it
        subprocess.run([sys.executable, "-m", "bardflow", "server", "stop"], cwd=REPO, env=env, capture_output=True)


def _story(tmp_path: Path, env: dict[str, str]) -> None:
    # A run and `bardflow ui` at the same second: one server, whose address ui prints (without
    # Prefect's banner, and without touching the user's Prefect profiles).
    first, second = _start(env), _start(env, ("-m", "bardflow", "ui"))
    (out_a, err_a), (out_b, err_b) = first.communicate(timeout=240), second.communicate(timeout=240)
    assert first.returncode == second.returncode == 0, err_a + err_b
    url = out_a.strip().removesuffix("/api")
    assert out_b.startswith(f"Prefect UI:  {url} (the kept server") and f"Artifacts:   {url}/artifacts" in out_b
    assert "prefect config set" not in out_b + err_b and not (tmp_path / "prefect" / "profiles.toml").exists()
    said = [line for line in (err_a + err_b).splitlines() if "kept for later runs" in line]
    assert len(said) == 1 and said[0].startswith("bardflow: Prefect server at http://127.0.0.1:"), err_a + err_b
    assert "stops after 60 min idle (bardflow server stop)" in said[0]
    record = _record(tmp_path)
    assert record["state"] == "running" and record["prefect_home"] == str((tmp_path / "prefect").resolve())
    status = subprocess.run(
        [sys.executable, "-m", "bardflow", "server", "status"], cwd=REPO, env=env, capture_output=True, text=True
    )
    assert status.returncode == 0 and status.stdout.startswith(f"running at {record['url']} (pid {record['pid']}, up ")
    assert "stops after 59 min" in status.stdout or "stops after 60 min" in status.stdout, status.stdout
    # Meanwhile, runs on it: one that ends, one killed with kill -9 (below).
    runs = subprocess.Popen(
        [sys.executable, "-c", A_FLOW_RUN + THEN_A_KILLED_RUN],
        cwd=REPO,
        env={**env, "PREFECT_API_URL": f"{url}/api"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    # `server start` on the server a run started: kept until stopped from now on, and said so;
    # `server env` is the line that points Prefect's own commands at it.
    kept = subprocess.run(
        [sys.executable, "-m", "bardflow", "server", "start"], cwd=REPO, env=env, capture_output=True, text=True
    )
    assert kept.returncode == 0 and "the server a run started is kept until `bardflow server stop`" in kept.stderr
    assert _record(tmp_path)["idle_s"] == 0 and _record(tmp_path)["by"] == "command"
    line = subprocess.run(
        [sys.executable, "-m", "bardflow", "server", "env"], cwd=REPO, env=env, capture_output=True, text=True
    )
    assert line.returncode == 0 and line.stdout == f"export PREFECT_API_URL={url}/api DO_NOT_TRACK=1\n", line

    # A run's record answers after its command has returned (its UI link's page reads it).
    out, err = runs.communicate(timeout=120)
    assert runs.returncode == -signal.SIGKILL, err[-2000:]
    ended, orphan_id = out.split()
    flow_run = json.loads(urllib.request.urlopen(f"{url}/api/flow_runs/{ended}", timeout=10).read())
    assert flow_run["state"]["type"] == "COMPLETED"
    # The killed run stays Running in the database: the server ends it as Crashed (below, once
    # it has a short idle stretch: it could not go idle while the run counted).
    orphan = json.loads(urllib.request.urlopen(f"{url}/api/flow_runs/{orphan_id}", timeout=10).read())
    assert orphan["state"]["type"] == "RUNNING"

    # kill -9 while flow runs are being written: the Prefect server goes with it, and the next
    # start replaces it, saying so, on the same database.
    port = int(record["url"].rsplit(":", 1)[1])
    stop, made = threading.Event(), []
    load = threading.Thread(target=_load, args=(url, stop, made))
    load.start()
    deadline = time.monotonic() + 60
    while len(made) < 20 and load.is_alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(made) >= 20, "the server took no load"
    os.kill(record["pid"], signal.SIGKILL)
    assert _gone(record["pid"], 5)
    deadline = time.monotonic() + 30
    while _answers(record["url"]) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _answers(record["url"])
    stop.set()
    load.join(timeout=30)
    idle = _env(tmp_path, "0.05")  # 3 s
    with socket.socket() as taken:  # its port taken by another program meanwhile: another port
        taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # past the old one's closed connections
        deadline = time.monotonic() + 30
        while True:  # once the old server has let it go
            try:
                taken.bind(("127.0.0.1", port))
                taken.listen()  # as a program serving there does
                break
            except OSError:
                assert time.monotonic() < deadline, f"port {port} never came free"
                time.sleep(0.5)
        again = _start(idle)
        out, err = again.communicate(timeout=240)
    assert again.returncode == 0, err
    assert f"the kept server (pid {record['pid']}) had stopped without a word: started another" in err
    assert out.strip() != f"{record['url']}/api"
    renewed = _record(tmp_path)
    assert renewed["pid"] != record["pid"] and renewed["by"] == "run" and _answers(renewed["url"])
    # What the killed server had committed is there: the run before the load, and the load's.
    for earlier in (ended, made[0]):
        read = json.loads(urllib.request.urlopen(f"{renewed['url']}/api/flow_runs/{earlier}", timeout=10).read())
        assert read["state"]["type"] == "COMPLETED"

    # Idle for its stretch: it stops by itself; nothing of it runs, its record says so.
    assert _gone(renewed["pid"], 60)
    assert not _answers(renewed["url"])
    stopped = _record(tmp_path)
    assert stopped["state"] == "stopped" and stopped["why"] == "idle for 3 s", stopped
    with sqlite3.connect(tmp_path / "prefect" / "prefect.db") as database:
        assert database.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
        (ended,) = database.execute("SELECT state_type, state_name FROM flow_run WHERE id = ?", (orphan["id"],))
    assert ended == ("CRASHED", "Crashed")
    status = subprocess.run(
        [sys.executable, "-m", "bardflow", "server", "status"], cwd=REPO, env=env, capture_output=True, text=True
    )
    assert status.returncode == 3 and status.stdout.strip() == "not running"
    # The next start comes back on the port it had: the links printed before stay live.
    back = _start(idle)
    out, err = back.communicate(timeout=240)
    assert back.returncode == 0 and out.strip() == f"{renewed['url']}/api", err


def test_server_stop_never_signals_a_process_it_did_not_start(tmp_path):
    """After a reboot or pid reuse the record's pid may be any program's, one whose command
    line says "bardflow" among them (a checkout's venv): neither it nor its process group is
    signalled, and the server is not running."""
    env = _env(tmp_path, "60")
    where = subprocess.run(
        [sys.executable, "-c", "from bardflow.prefect_server.process import state_file; print(state_file())"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    state = Path(where.stdout.strip())
    state.parent.mkdir(parents=True, exist_ok=True)
    stranger = subprocess.Popen(  # the leader of its own group, as the kept server is
        [sys.executable, "-c", "import time; time.sleep(120)", "/home/me/bardflow/.venv"], start_new_session=True
    )
    try:
        for process in (None, "another-host/1/1", f"{socket.gethostname()}/{stranger.pid}/1"):
            record = {"pid": stranger.pid, "url": "http://127.0.0.1:9", "state": "running", "started": time.time()}
            state.write_text(json.dumps({**record, **({"process": process} if process else {})}))
            for action, code, said in (("status", 3, "not running"), ("stop", 0, "no background server was running")):
                done = subprocess.run(
                    [sys.executable, "-m", "bardflow", "server", action],
                    cwd=REPO,
                    env=env,
                    capture_output=True,
                    text=True,
                    timeout=60,
                )
                assert done.returncode == code and said in done.stdout, (process, action, done.stdout, done.stderr)
                assert stranger.poll() is None, (process, action)
    finally:
        stranger.kill()
        stranger.wait()
