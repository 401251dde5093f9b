"""``bardflow server start|stop|status``: one Prefect server kept running in the background,
bound to 127.0.0.1, which ``run`` and ``sweep`` then use instead of starting the embedded
one (about 10 s a run on 2 cores). Its address lives in a small file, so any shell finds it."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from ..model.errors import BardflowError
from .prefect_private import ephemeral_server_command


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


@dataclass(frozen=True)
class PrefectServer:
    """The Prefect server a command's runs report to, as the command hands it along: the one
    the user chose (``chosen``: PREFECT_API_URL), bardflow's background one (``background``), or
    the run's own (``embedded``, with its process)."""

    api_url: str
    kind: str
    embedded: EmbeddedServer | None = None

    @property
    def url(self) -> str:
        return self.api_url.rstrip("/").removesuffix("/api")

    @property
    def ui_url(self) -> str:
        """Where a person sees the runs: the user's PREFECT_UI_URL, else the server's own UI,
        or for a run's own server, where `bardflow ui` will serve them once it is gone."""
        return (os.environ.get("PREFECT_UI_URL") or (LATER_UI if self.embedded else self.url)).rstrip("/")


def chosen_server() -> PrefectServer | None:
    """The server that is already there for this command's runs: the user's, else the
    background one; None when a run must start its own (``start_embedded``)."""
    api = os.environ.get("PREFECT_API_URL")
    return PrefectServer(api.rstrip("/"), "chosen") if api else use_running_server()


def _point_prefect_at(server: PrefectServer) -> PrefectServer:
    """Prefect's client, here and in every process a run starts, takes its server from
    Prefect's settings, which read the environment: this is the one place bardflow writes it.
    bardflow's own code is handed the ``PrefectServer`` instead."""
    os.environ["PREFECT_API_URL"] = server.api_url
    return server


def check_chosen_server(server: PrefectServer | None) -> None:
    """A server that is already there must answer before a run starts: otherwise Prefect
    fails deep in its client with a long traceback."""
    api = "" if server is None else server.api_url
    if not api.startswith(("http://", "https://")):
        return
    try:
        _health(api, 5.0)
    except OSError as error:
        reason = getattr(error, "reason", None) or error
        raise ServerError(
            f"cannot reach the Prefect server at {api} ({reason}); start it (`bardflow server "
            "start`), or unset PREFECT_API_URL to run on an embedded server"
        ) from error


def use_running_server() -> PrefectServer | None:
    """The background server, with this process's runs pointed at it, when one is up and the
    user has not chosen a server already (PREFECT_API_URL)."""
    if os.environ.get("PREFECT_API_URL"):
        return None
    record = running()
    if record is None:
        return None
    return _point_prefect_at(PrefectServer(f"{record['url']}/api", "background"))


DATABASE = "PREFECT_API_DATABASE_CONNECTION_URL"


def database_url(url: str) -> str:
    """Prefect's database setting from what a user types: PostgreSQL through asyncpg (the
    driver Prefect ships), or a SQLite file."""
    scheme, sep, rest = url.partition("://")
    if not sep or not rest:
        raise ServerError(
            f"--database {url!r} is no database URL; e.g. postgresql://USER:PASSWORD@127.0.0.1:5432/prefect"
        )
    if scheme in ("postgresql", "postgres", "postgresql+asyncpg"):
        return f"postgresql+asyncpg://{rest}"
    if scheme in ("sqlite", "sqlite+aiosqlite"):
        return f"sqlite+aiosqlite://{rest}"
    raise ServerError(
        f"--database {url!r}: Prefect's server keeps its state in PostgreSQL (postgresql://…) "
        "or SQLite (sqlite:///path)"
    )


def _shown(url: str) -> str:
    """A database URL without its password."""
    return re.sub(r"://([^:/@]+):[^@]*@", r"://\1:***@", url)


def start(port: int, timeout_s: float = 180.0, database: str | None = None) -> tuple[dict, bool]:
    """The background server's record, and whether this call started it (one already up
    is kept, whatever port it has)."""
    found = running()
    if found is not None:
        return found, False
    url = f"http://127.0.0.1:{port}"
    if healthy(url):
        raise ServerError(f"something already answers at {url}; stop it, or pick another port with --port")
    path = state_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    log = path.with_suffix(".log")
    env = dict(os.environ)
    if database is not None:
        env[DATABASE] = database_url(database)
    with open(log, "ab") as out:  # detached: it outlives this command and its terminal
        process = subprocess.Popen(
            [sys.executable, "-m", "bardflow", "ui", "--port", str(port)],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            cwd=Path(__file__).resolve().parents[1],
            env=env,
        )
    record = {
        "pid": process.pid,
        "url": url,
        "log": str(log),
        "database": _shown(env.get(DATABASE) or f"sqlite (in {env.get('PREFECT_HOME', '~/.prefect')})"),
    }
    deadline = time.monotonic() + timeout_s
    while not healthy(url):
        if process.poll() is not None or time.monotonic() > deadline:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
            raise ServerError(
                f"the Prefect server did not come up at {url} within {timeout_s:.0f} s; see its log {log}"
            )
        time.sleep(0.5)
    path.write_text(json.dumps(record))
    return record, True


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


def command(action: str, port: int, database: str | None = None) -> None:
    if action == "start":
        record, started = start(port, database=database)
        if not started and not record["url"].endswith(f":{port}"):
            raise ServerError(
                f"a background Prefect server already runs at {record['url']} (pid {record['pid']}), "
                f"so --port {port} was not used; `bardflow server stop`, then start again to move it "
                f"to port {port}"
            )
        print(
            f"{'' if started else 'already running: '}Prefect server: {record['url']} (pid {record['pid']}, "
            f"log {record['log']}, "
            f"database {record.get('database')})\n"
            f"`bardflow run` and `bardflow sweep` use it while it runs; `bardflow server stop` stops it."
        )
    elif action == "stop":
        print("stopped" if stop() else "no background server was running")
    else:
        record = running()
        print(f"running at {record['url']} (pid {record['pid']})" if record else "not running")
        if record is None:
            raise SystemExit(3)


class EmbeddedServer:
    """The temporary Prefect server of one `bardflow run` or `sweep` when no server is
    chosen: what Prefect's client would start by itself (the same app, UI off, 127.0.0.1),
    but started here, before Prefect and JAX are imported, so it comes up while they load;
    in a session of its own, so a Ctrl-C to the terminal's process group reaches this
    process alone and the run can stop in order and still report it; and tied to this
    process (Linux: it gets SIGTERM if this process dies), so none is ever left behind."""

    def __init__(self) -> None:
        from ..model.training.launch import free_port

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
                preexec_fn=_die_with_parent,
            )

    def wait(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        from ..model.training import stopping

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
        import threading

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


GOING_ON = "finished stages come back cached, training resumes from its checkpoint"
LATER_UI = "http://127.0.0.1:4200"  # where `bardflow ui` serves the runs of this Prefect home
SILENT_FOR_S = 4.0  # a server that answers no health check for this long is gone


def watch_chosen(api: str, every_s: float = 1.0):
    """The same watch over a server the run found (the background one, PREFECT_API_URL),
    which is not this process's child: its health is asked every ``every_s`` seconds, and a
    server silent for ``SILENT_FOR_S`` stops the run in one line. The watch ends when the
    event it returns is set (the run's end: the process may go on, as a caller's does)."""
    import threading

    done = threading.Event()

    def poll() -> None:
        silent_since = None
        while not done.wait(every_s):
            try:
                _health(api, timeout_s=every_s)
                silent_since = None
                continue
            except OSError as error:
                reason = getattr(error, "reason", None) or error
                silent_since = silent_since or time.monotonic()
            if time.monotonic() - silent_since >= SILENT_FOR_S and not done.is_set():
                server_gone(
                    f"the Prefect server at {api} stopped answering mid-run ({reason}); start it again "
                    f"(`bardflow server start`) and rerun the same command to go on ({GOING_ON})"
                )
                return

    threading.Thread(target=poll, name="bardflow-server-watch", daemon=True).start()
    return done


def server_gone(why: str) -> None:
    """Stops the run for a server that is gone. What Prefect still holds for it (events,
    logs, state reports) can no longer be sent: its retries and their warnings are silenced,
    so that the run's last line is the one that says what happened."""
    import logging

    from ..model.training import stopping

    known = [name for name in logging.root.manager.loggerDict if name.startswith("prefect")]
    for name in (*known, "prefect", "EventsWorker", "APILogWorker"):
        # A filter, not a level: Prefect's internal loggers answer to a setting of their own.
        logging.getLogger(name).addFilter(lambda record: False)
    stopping.fail(why)


def _die_with_parent() -> None:
    """In the child before it runs: SIGTERM when the parent dies (Linux prctl; elsewhere nothing)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def start_embedded() -> PrefectServer:
    """Starts the run's own server (when ``chosen_server`` found none) and points this process
    at it. Stopped at exit, or by a forced stop."""
    import atexit

    from ..model.training import stopping

    server = EmbeddedServer()
    chosen = _point_prefect_at(PrefectServer(f"{server.url}/api", "embedded", server))
    # The run's links (Prefect's "View at", MLflow's tag) point where the run can be seen
    # afterwards: `bardflow ui` serves this Prefect home's runs there; this server is gone.
    os.environ.setdefault("PREFECT_UI_URL", LATER_UI)
    print(
        f"bardflow: starting a temporary Prefect server for this run at {server.url} (keep one running with "
        "`bardflow server start` to skip this)",
        file=sys.stderr,
        flush=True,
    )
    atexit.register(server.stop)
    stopping.on_force(server.stop)
    return chosen
