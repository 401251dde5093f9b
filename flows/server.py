"""``bardflow server start|stop|status``: one Prefect server kept running in the background,
bound to 127.0.0.1, which ``run`` and ``sweep`` then use instead of starting the embedded
one (about 10 s a run on 2 cores). Its address lives in a small file, so any shell finds it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from model.errors import BardflowError


class ServerError(BardflowError, RuntimeError):
    """The background server could not be started or reached."""


def state_file() -> Path:
    return Path(os.environ.get("BARDFLOW_SERVER_FILE", "~/.cache/bardflow/server.json")).expanduser()


def _health(api: str, timeout_s: float) -> bool:
    """Whether the Prefect API at ``api`` (…/api) says it is healthy; OSError if nothing answers."""
    return urllib.request.urlopen(f"{api}/health", timeout=timeout_s).read() == b"true"


def healthy(url: str, timeout_s: float = 2.0) -> bool:
    try:
        return _health(f"{url}/api", timeout_s)
    except OSError:
        return False


def running() -> dict | None:
    """The background server's record, if it is up and answering."""
    try:
        record = json.loads(state_file().read_text())
        os.kill(record["pid"], 0)
    except (OSError, ValueError, KeyError):
        return None
    return record if healthy(record["url"]) else None


def check_chosen_server() -> None:
    """A server named by PREFECT_API_URL must answer before a run starts: otherwise Prefect
    fails deep in its client with a long traceback."""
    api = os.environ.get("PREFECT_API_URL", "").rstrip("/")
    if not api or not api.startswith(("http://", "https://")):
        return
    try:
        _health(api, 5.0)
    except OSError as error:
        reason = getattr(error, "reason", None) or error
        raise ServerError(f"cannot reach the Prefect server at {api} ({reason}); start it (`bardflow server "
                          "start`), or unset PREFECT_API_URL to run on an embedded server") from error


def use_running_server() -> str | None:
    """Points this process's runs at the background server when one is up and the user has
    not chosen a server already (PREFECT_API_URL); returns its API URL."""
    if os.environ.get("PREFECT_API_URL"):
        return None
    record = running()
    if record is None:
        return None
    os.environ["PREFECT_API_URL"] = f"{record['url']}/api"
    return os.environ["PREFECT_API_URL"]


def start(port: int, timeout_s: float = 180.0) -> dict:
    found = running()
    if found is not None:
        return found
    url = f"http://127.0.0.1:{port}"
    if healthy(url):
        raise ServerError(f"something already answers at {url}; stop it, or pick another port with --port")
    path = state_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    log = path.with_suffix(".log")
    with open(log, "ab") as out:  # detached: it outlives this command and its terminal
        process = subprocess.Popen([sys.executable, "-m", "flows.cli", "ui", "--port", str(port)],
                                   stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   start_new_session=True, cwd=Path(__file__).resolve().parents[1])
    record = {"pid": process.pid, "url": url, "log": str(log)}
    deadline = time.monotonic() + timeout_s
    while not healthy(url):
        if process.poll() is not None or time.monotonic() > deadline:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
            raise ServerError(f"the Prefect server did not come up at {url} within {timeout_s:.0f} s; "
                              f"see its log {log}")
        time.sleep(0.5)
    path.write_text(json.dumps(record))
    return record


def stop() -> bool:
    """Stops the background server; False if none was running."""
    try:
        record = json.loads(state_file().read_text())
    except (OSError, ValueError):
        return False
    state_file().unlink(missing_ok=True)
    try:
        os.killpg(record["pid"], signal.SIGTERM)
    except (OSError, KeyError):
        return False
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        try:
            os.killpg(record["pid"], 0)
        except OSError:
            return True
        time.sleep(0.2)
    os.killpg(record["pid"], signal.SIGKILL)
    return True


def command(action: str, port: int) -> None:
    if action == "start":
        record = start(port)
        print(f"Prefect server: {record['url']} (pid {record['pid']}, log {record['log']})\n"
              f"`bardflow run` and `bardflow sweep` use it while it runs; `bardflow server stop` stops it.")
    elif action == "stop":
        print("stopped" if stop() else "no background server was running")
    else:
        record = running()
        print(f"running at {record['url']} (pid {record['pid']})" if record else "not running")
        if record is None:
            raise SystemExit(3)
