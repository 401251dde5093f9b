"""A Prefect server (``bardflow ui``) and the processes that talk to it, for the end-to-end
tests: started once, stopped for sure."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


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
    """``bardflow ui`` on a free loopback port with a Prefect home of its own."""

    def __init__(self, home: Path, env: dict[str, str]):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.home = home
        self.env = {**env, "PREFECT_HOME": str(home), "PREFECT_API_URL": f"{self.url}/api",
                    "PREFECT_WORKER_QUERY_SECONDS": "2"}
        self.processes: list[subprocess.Popen] = []

    def start(self, name: str, *command: str, env: dict[str, str] | None = None) -> subprocess.Popen:
        log = open(self.home / f"{name}.log", "w")
        process = subprocess.Popen(command, cwd=REPO, env=env or self.env, stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True)
        self.processes.append(process)
        return process

    def run(self, *command: str, timeout: float = 600) -> subprocess.CompletedProcess:
        return subprocess.run(command, cwd=REPO, env=self.env, capture_output=True, text=True, timeout=timeout)

    def api(self, path: str, body: dict) -> list[dict]:
        request = urllib.request.Request(f"{self.url}/api{path}", data=json.dumps(body).encode(),
                                         headers={"content-type": "application/json"})
        return json.loads(urllib.request.urlopen(request, timeout=30).read())

    def serve(self, timeout_s: float = 240) -> Server:
        self.start("server", sys.executable, "-m", "flows.cli", "ui", "--port", str(self.port))
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if urllib.request.urlopen(f"{self.url}/api/health", timeout=2).read() == b"true":
                    return self
            except OSError:
                assert self.processes[0].poll() is None, (self.home / "server.log").read_text()[-2000:]
                time.sleep(0.5)
        raise AssertionError(f"the server did not come up: {(self.home / 'server.log').read_text()[-2000:]}")

    def stop(self, process: subprocess.Popen) -> None:
        stop(process)
        self.processes.remove(process)

    def stop_all(self) -> None:
        for process in reversed(self.processes):
            stop(process)
