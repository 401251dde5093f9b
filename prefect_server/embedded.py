"""A run's own Prefect server (``--server embedded``, or ``BARDFLOW_SERVER=embedded`` where no
server is up): started before Prefect and JAX are imported, so that it comes up while they
load, and gone when the run ends."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from ..config.line_width import fit
from . import keeper
from .prefect_private import ephemeral_server_command
from .process import GOING_ON, LATER_UI, PrefectServer, ServerError, healthy, point_prefect_at, server_gone


class EmbeddedServer:
    """The temporary Prefect server of one `bardflow run` or `sweep` when no server is
    chosen: what Prefect's client would start by itself (the same app, UI off, 127.0.0.1),
    but started here, before Prefect and JAX are imported, so it comes up while they load;
    in a session of its own, so a Ctrl-C to the terminal's process group reaches this
    process alone and the run can stop in order and still report it; and tied to this
    process (Linux: it gets SIGTERM if this process dies), so none is ever left behind."""

    def __init__(self) -> None:
        from ..processes.launch import free_port

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        command, env = ephemeral_server_command(self.port)
        home = Path(os.environ.get("PREFECT_HOME", "~/.prefect")).expanduser()
        home.mkdir(parents=True, exist_ok=True)  # its database lives there; Prefect's client would make it
        self.log = home / "bardflow-embedded-server.log"
        self.stopping = False
        with open(self.log, "wb") as log:  # the server's own output stays out of the run's
            self.process = subprocess.Popen(
                command,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=keeper.die_with_parent,
            )

    def wait(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        from ..processes import stopping

        while not healthy(self.url, timeout_s=1.0):
            stopping.check("before the run started")
            if self.process.poll() is not None:
                raise ServerError(
                    f"the embedded Prefect server exited with status {self.process.returncode} while "
                    f"starting; its log {self.log} says why (or start one with `bardflow server start`)"
                )
            if time.monotonic() > deadline:
                self.stop()
                raise ServerError(
                    f"the embedded Prefect server did not answer within {timeout_s:.0f} s; raise "
                    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS, or keep one running with "
                    "`bardflow server start`"
                )
            time.sleep(0.1)

    def watch(self) -> None:
        """From now on, the server exiting stops the run (training saves its step) with one
        line: without it, every report of the run would be retried for minutes."""

        def wait() -> None:
            code = self.process.wait()
            if not self.stopping:
                server_gone(
                    f"the run's Prefect server (pid {self.process.pid}) exited with status {code} mid-run; "
                    f"rerun the same command to go on ({GOING_ON})"
                )

        threading.Thread(target=wait, daemon=True).start()

    def stop(self) -> None:
        self.stopping = True
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()


def start_embedded() -> PrefectServer:
    """Starts the run's own server (when ``chosen_server`` found none) and points this process
    at it. Stopped at exit, or by a forced stop."""
    import atexit

    from ..processes import stopping

    server = EmbeddedServer()
    chosen = point_prefect_at(PrefectServer(f"{server.url}/api", "embedded", server))
    # The run's links (Prefect's "View at", MLflow's tag) point where the run can be seen
    # afterwards: `bardflow ui` serves this Prefect home's runs there; this server is gone.
    os.environ.setdefault("PREFECT_UI_URL", LATER_UI)
    print(
        fit(
            f"bardflow: starting a temporary Prefect server for this run at {server.url} (keep one running "
            "with `bardflow server start` to skip this)"
        ),
        file=sys.stderr,
        flush=True,
    )
    atexit.register(server.stop)
    stopping.on_force(server.stop)
    return chosen
