"""The README's "On a GPU worker" path, for real and on CPU: a Prefect server on
127.0.0.1, the `gpu` process pool, `prefect deploy --all` from this repository's
prefect.yaml, a worker, and `prefect deployment run ... --watch`. Then a browser
looks at the artifacts as a person would."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.cdp import Browser, chromium_binary
from tests.conftest import REPO, SHARED_CORPUS

pytestmark = pytest.mark.flow
STAGES = ["fetch", "encode", "train_single", "train_parallel", "compare", "checkpoint", "verify", "generate"]
OUTPUT = REPO / "test-output" / "deployment"
BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def stop(process: subprocess.Popen) -> None:
    """TERM, then INT, then KILL, each to the whole process group, until it is gone."""
    for sig, wait_s in ((signal.SIGTERM, 15), (signal.SIGINT, 10), (signal.SIGKILL, 10)):
        if process.poll() is not None:
            return
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            continue


class Server:
    def __init__(self, home: Path, env: dict[str, str]):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = {**env, "PREFECT_HOME": str(home), "PREFECT_API_URL": f"{self.url}/api",
                    "PREFECT_WORKER_QUERY_SECONDS": "2"}
        self.processes: list[subprocess.Popen] = []
        self.logs = home

    def start(self, name: str, *command: str) -> subprocess.Popen:
        log = open(self.logs / f"{name}.log", "w")
        process = subprocess.Popen(command, cwd=REPO, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True)
        self.processes.append(process)
        return process

    def run(self, *command: str, timeout: float = 600) -> subprocess.CompletedProcess:
        return subprocess.run(command, cwd=REPO, env=self.env, capture_output=True, text=True, timeout=timeout)

    def api(self, path: str, body: dict) -> list[dict]:
        request = urllib.request.Request(f"{self.url}/api{path}", data=json.dumps(body).encode(),
                                         headers={"content-type": "application/json"})
        return json.loads(urllib.request.urlopen(request, timeout=30).read())

    def wait_healthy(self, timeout_s: float = 240) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if urllib.request.urlopen(f"{self.url}/api/health", timeout=2).read() == b"true":
                    return
            except OSError:
                time.sleep(0.5)
        raise AssertionError(f"the server did not come up: {(self.logs / 'server.log').read_text()[-2000:]}")

    def stop_all(self) -> None:
        for process in reversed(self.processes):
            stop(process)


@pytest.fixture(scope="module")
def deployed(tmp_path_factory):
    if not SHARED_CORPUS.exists():
        pytest.skip(f"needs the offline TinyShakespeare copy at {SHARED_CORPUS}")
    home = tmp_path_factory.mktemp("prefect-home")
    store = tmp_path_factory.mktemp("deployed-store")
    # The worker's host has an offline mirror of the corpus; flow runs inherit the
    # worker's environment, as on a GPU host.
    server = Server(home, {**os.environ, "BARDFLOW_CORPUS": SHARED_CORPUS.as_uri()})
    try:
        server.start("server", str(BIN / "bardflow"), "ui", "--port", str(server.port))
        server.wait_healthy()
        for command in (["work-pool", "create", "--type", "process", "gpu"], ["--no-prompt", "deploy", "--all"]):
            done = server.run(str(BIN / "prefect"), *command)
            assert done.returncode == 0, done.stdout + done.stderr
        server.start("worker", str(BIN / "prefect"), "worker", "start", "--pool", "gpu")
        yield server, store
    finally:
        server.stop_all()
        for process in server.processes:
            assert process.poll() is not None, "a server or worker was left running"


def deployment_run(server: Server, name: str, *params: str) -> tuple[str, float]:
    """Runs the README's command; returns the flow run id and when the command started."""
    started = time.time()
    args = [arg for p in params for arg in ("--param", p)]
    done = server.run(str(BIN / "prefect"), "deployment", "run", name, *args, "--watch", timeout=900)
    assert done.returncode == 0, f"{name} exited {done.returncode}:\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
    match = re.search(r"UUID:\s*([0-9a-f-]{36})", done.stdout)
    assert match, done.stdout
    return match.group(1), started


def stage_states(server: Server, flow_run_id: str) -> dict[str, str]:
    runs = server.api("/task_runs/filter", {"flow_runs": {"id": {"any_": [flow_run_id]}}})
    return {run["name"].rsplit("-", 1)[0]: run["state"]["name"] for run in runs}


def test_deployment_runs_reruns_one_stage_and_generates_from_cache(deployed):
    server, store = deployed
    timings = {}
    tiny = ["preset=tiny", f"store={store}"]

    run_id, started = deployment_run(server, "bardflow/pipeline", *tiny)
    flow_run = server.api("/flow_runs/filter", {"flow_runs": {"id": {"any_": [run_id]}}})[0]
    assert flow_run["state"]["type"] == "COMPLETED"
    assert set(stage_states(server, run_id).values()) == {"Completed"}
    from datetime import datetime

    timings["deployment_run_to_flow_start_s"] = round(
        datetime.fromisoformat(flow_run["start_time"]).timestamp() - started, 1)
    keys = {a["key"] for a in server.api("/artifacts/filter", {"artifacts": {"flow_run_id": {"any_": [run_id]}}})}
    assert {f"bardflow-{s.replace('_', '-')}" for s in STAGES} <= keys

    started = time.time()
    run_id, _ = deployment_run(server, "bardflow/pipeline", *tiny, 'refresh=["generate"]')
    timings["refresh_generate_run_s"] = round(time.time() - started, 1)
    states = stage_states(server, run_id)
    assert states == {s: ("Completed" if s == "generate" else "Cached") for s in STAGES}

    started = time.time()
    run_id, _ = deployment_run(server, "bardflow/pipeline", *tiny)
    timings["fully_cached_run_s"] = round(time.time() - started, 1)
    assert set(stage_states(server, run_id).values()) == {"Cached"}

    run_id, _ = deployment_run(server, "bardflow/generate", *tiny, 'prompts=["HAMLET:"]')
    states = stage_states(server, run_id)
    assert states["train_single"] == states["train_parallel"] == "Cached"
    assert states["generate"] == "Completed"
    samples = [json.loads(p.read_text()) for p in (store / "generate").glob("*/samples.json")]
    assert any(s[0]["prompt"] == "HAMLET:" for s in samples)

    OUTPUT.mkdir(parents=True, exist_ok=True)
    (OUTPUT / "timings.json").write_text(json.dumps(timings, indent=1))


def test_the_ui_shows_every_stage_and_renders_the_plots(deployed):
    server, _ = deployed
    binary = chromium_binary()
    if binary is None:
        pytest.skip("chromium is not installed (.ci/run installs it)")
    compare = server.api("/artifacts/filter", {"artifacts": {"key": {"any_": ["bardflow-compare"]}},
                                                "sort": "CREATED_DESC", "limit": 1})
    if not compare:
        pytest.skip("needs the deployment run above")
    plots = server.api("/artifacts/filter", {"artifacts": {"key": {"any_": ["bardflow-compare-plots"]}},
                                              "sort": "CREATED_DESC", "limit": 1})[0]
    OUTPUT.mkdir(parents=True, exist_ok=True)
    browser = Browser(binary)
    try:
        browser.open(f"{server.url}/artifacts", "document.body.innerText.includes('bardflow-generate')")
        listing = browser.text()
        browser.screenshot(OUTPUT / "artifacts.png")
        for stage in STAGES:
            assert f"bardflow-{stage.replace('_', '-')}" in listing

        browser.open(f"{server.url}/artifacts/artifact/{plots['id']}",
                     "document.images.length >= 2 && [...document.images].every(i => i.complete)")
        browser.screenshot(OUTPUT / "compare-plots.png")
        page = browser.text()
        # The comparison table's numbers, as the compare stage computed them.
        table = compare[0]["data"]
        for row in json.loads(table) if isinstance(table, str) else table:
            assert str(row["data-parallel (2 devices)"]) in page and str(row["single device"]) in page
        widths = browser.evaluate("[...document.images].map(i => i.naturalWidth)")
        assert len(widths) >= 2 and all(w > 0 for w in widths), widths
    finally:
        browser.close()
