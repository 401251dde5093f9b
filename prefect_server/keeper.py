"""The kept Prefect server's own process (``prefect_server/process.py`` starts it). It runs
``prefect server start`` on 127.0.0.1 as its child (which dies with it), and stops it once no
flow run has been in progress or started for ``--idle-s`` seconds (0: never), or on SIGTERM;
then its state file says it stopped, and nothing of it is left running."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from ..processes import signals

ACTIVE = ["RUNNING", "PENDING", "CANCELLING"]


def _count(api: str, body: dict) -> int | None:
    """A count of flow runs from the API; None when it does not answer."""
    request = urllib.request.Request(
        f"{api}/flow_runs/count", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        return int(urllib.request.urlopen(request, timeout=10).read())
    except (OSError, ValueError):
        return None


def activity(api: str) -> tuple[int | None, int | None]:
    """The flow runs in progress now, and all the server has seen (a new one: a run started)."""
    return _count(api, {"flow_runs": {"state": {"type": {"any_": ACTIVE}}}}), _count(api, {})


# On a flow run: which process runs it (host, pid, and the pid's start time, so that a pid
# reused by another program is not taken for it). The flow labels its own run as it starts.
PROCESS_LABEL = "bardflow.process"


def process_identity(pid: int | None = None) -> str:
    pid = pid or os.getpid()
    return f"{socket.gethostname()}/{pid}/{_start_time(pid)}"


def _start_time(pid: int) -> str:
    """The process's start, in clock ticks since boot (``/proc``); "?" where there is none."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        return fields[19]
    except (OSError, IndexError):
        return "?"


def process_gone(identity: str) -> bool:
    """Whether the process a flow run's label names has ended; another host's process is
    its own host's (or its worker's) to judge."""
    try:
        host, pid, started = identity.split("/")
        number = int(pid)
    except ValueError:
        return False
    if host != socket.gethostname():
        return False
    if started != "?":
        return _start_time(number) != started
    try:
        os.kill(number, 0)
    except ProcessLookupError:
        return True
    except OSError:
        pass
    return False


def _post(url: str, body: dict) -> bytes:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    return urllib.request.urlopen(request, timeout=10).read()


ORPHAN_GRACE_S = 5.0  # a worker reports its own flow run's end (Crashed) within a second or two


def end_orphaned_runs(api: str, gone_since: dict[str, float]) -> list[str]:
    """Sets Prefect's own ``Crashed`` on each running flow run of this host whose process has
    ended without saying so (``kill -9``, a forced exit, the out-of-memory killer) at least
    ``ORPHAN_GRACE_S`` ago, so that it stops counting as activity; returns their ids.
    ``gone_since``: when each run was first seen without its process (kept between looks);
    a run being cancelled is its worker's to end."""
    try:
        runs = json.loads(_post(f"{api}/flow_runs/filter", {"flow_runs": {"state": {"type": {"any_": ["RUNNING"]}}}}))
    except (OSError, ValueError):
        return []
    ended, now = [], time.monotonic()
    for run in runs:
        identity = (run.get("labels") or {}).get(PROCESS_LABEL)
        if not isinstance(identity, str) or not process_gone(identity):
            gone_since.pop(run["id"], None)
            continue
        if now - gone_since.setdefault(run["id"], now) < ORPHAN_GRACE_S:
            continue
        state = {
            "type": "CRASHED",
            "name": "Crashed",
            "message": f"its process ({identity}) ended without reporting a final state",
        }
        with contextlib.suppress(OSError, ValueError):
            _post(f"{api}/flow_runs/{run['id']}/set_state", {"state": state, "force": True})
            ended.append(run["id"])
            gone_since.pop(run["id"], None)
    return ended


def note(path: Path, **fields) -> None:
    """``fields`` into the state file, if it is still this process's record (a newer server's
    is left alone)."""
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return
    if record.get("pid") != os.getpid():
        return
    record.update(fields)
    with contextlib.suppress(OSError):  # a full disk: the record stays as it was
        write_record(path, record)


def _idle_stretch(path: Path, idle_s: float) -> float:
    """The idle stretch this process's record now gives (``idle_s`` where it gives none)."""
    try:
        record = json.loads(path.read_text())
        return float(record["idle_s"]) if record.get("pid") == os.getpid() else idle_s
    except (OSError, ValueError, KeyError, TypeError):
        return idle_s


def write_record(path: Path, record: dict) -> None:
    """``record`` as ``path``'s whole content, or (OSError) the file as it was: never half written."""
    partial = path.with_name(f".{path.name}.{os.getpid()}")
    try:
        partial.write_text(json.dumps(record))
        os.replace(partial, path)
    except OSError:
        partial.unlink(missing_ok=True)
        raise


def die_with_parent() -> None:
    """In a child before it runs: SIGTERM when its parent dies (Linux prctl; elsewhere nothing)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _stop(server: subprocess.Popen) -> None:
    if server.poll() is None:
        server.terminate()
        try:
            server.wait(timeout=15)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


class _AskedToStop(Exception):
    pass


def keep(port: int, state: Path, idle_s: float, poll_s: float) -> str:
    """Runs the server until it has been idle for ``idle_s`` (or exits, or SIGTERM comes);
    returns why it stopped."""
    url = f"http://127.0.0.1:{port}"
    env = {
        **os.environ,
        # The UI's browser code asks the server where its API is: this port, not 4200.
        "PREFECT_UI_API_URL": f"{url}/api",
        "PREFECT_UI_URL": url,
        "PREFECT_SERVER_API_HOST": "127.0.0.1",
        "PREFECT_SERVER_API_PORT": str(port),
    }
    command = [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)]
    server = subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL, preexec_fn=die_with_parent)
    asked = signals.Raising(_AskedToStop)
    signals.install(asked, (signal.SIGTERM,))
    last_active, seen, up = time.monotonic(), None, False
    orphans: dict[str, float] = {}
    try:
        while True:
            time.sleep(poll_s if up else min(poll_s, 0.5))
            asked.check()  # a SIGTERM whose exception Python dropped (it landed in a __del__)
            if server.poll() is not None:
                return f"the Prefect server exited with status {server.returncode}"
            end_orphaned_runs(f"{url}/api", orphans)
            active, total = activity(f"{url}/api")
            if active is not None and not up:  # it answers: runs may use it
                up = True
                note(state, state="running")
            if active is None or active > 0 or total != seen:
                last_active, seen = time.monotonic(), total if total is not None else seen
                note(state, idle_since=time.time())
            idle_s = _idle_stretch(state, idle_s)  # `bardflow server start` may have made it kept
            if idle_s > 0 and time.monotonic() - last_active >= idle_s:
                return f"idle for {idle_s:.0f} s"
    except _AskedToStop:
        return "stopped by `bardflow server stop` or SIGTERM"
    finally:
        signals.ignore((signal.SIGTERM,))  # it is stopping already
        _stop(server)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--state", type=Path, required=True)
    parser.add_argument("--idle-s", type=float, default=0.0)
    parser.add_argument("--poll-s", type=float, default=15.0)
    args = parser.parse_args(argv)
    why = keep(args.port, args.state, args.idle_s, args.poll_s)
    note(args.state, state="stopped", stopped=time.time(), why=why)
    print(f"bardflow: the kept Prefect server stopped: {why}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
