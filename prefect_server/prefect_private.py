"""Every use bardflow makes of Prefect's internals, in one place. Each is something Prefect
itself does, for which it offers no public API; ``tests/test_prefect_private.py`` fails on a
Prefect release that changes any of them, before a run would.

- The run's own server (``bardflow run`` with no server chosen) is the app Prefect's client
  starts for its ephemeral mode: ``create_app`` served by uvicorn, with the two environment
  variables that make it ephemeral (the services a run needs, no UI) and final. Prefect's own
  ``SubprocessASGIServer`` does the same; bardflow starts it itself so that it comes up while
  Prefect and JAX load, and stops with the run.
- What Prefect still holds for the server when a run fails (its events and log lines) is sent
  by its two background workers' ``drain_all``, before the run's error line.

The background server (``bardflow server start``) is ``prefect server start``, Prefect's
documented command; nothing here concerns it."""

from __future__ import annotations

import os
import sys
from importlib.util import find_spec
from pathlib import Path

APP_FACTORY = "prefect.server.api.server:create_app"
EPHEMERAL_ENV = {"PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1", "PREFECT__SERVER_FINAL": "1"}


def ephemeral_server_command(port: int) -> tuple[list[str], dict[str, str]]:
    """The command and environment of a run's own server on 127.0.0.1:``port``."""
    spec = find_spec("prefect")  # found, not imported (that takes a second)
    if spec is None or spec.origin is None:
        raise ImportError("Prefect is not installed: pip install bardflow")
    app_dir = str(Path(spec.origin).parent.parent)
    command = [
        sys.executable,
        "-m",
        "uvicorn",
        "--app-dir",
        app_dir,
        "--factory",
        APP_FACTORY,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--log-level",
        "error",
        "--lifespan",
        "on",
    ]
    return command, {**os.environ, **EPHEMERAL_ENV}


def drain_reports(timeout_s: float) -> None:
    """Sends the events and log lines Prefect's background workers still hold."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    for worker in (APILogWorker, EventsWorker):
        try:
            worker.drain_all(timeout=timeout_s)
        except Exception:  # noqa: BLE001 - reports are a courtesy here: the error line matters
            pass
