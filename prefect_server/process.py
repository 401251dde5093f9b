"""The Prefect server runs report to. By default the first ``bardflow run`` or ``sweep`` that
finds none starts one in the background, bound to 127.0.0.1, and later runs use it, as build
tools keep their daemons; it stops after ``BARDFLOW_SERVER_IDLE_MINUTES`` with no run (0: kept
until ``bardflow server stop``). ``bardflow server start|stop|status`` operate it by hand;
``--server embedded`` gives a run a server of its own that ends with it. The kept server
belongs to the Prefect home it serves (and the cache folder its record lives in): its record
is a small file there, so any shell of that setup finds it, and another setup does not."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from ..config.line_width import fit
from ..config.machine import cache_dir
from ..errors import BardflowError
from . import keeper
from .status import server_status

SERVER_MODE = "BARDFLOW_SERVER"  # kept (the default) or embedded
IDLE_MINUTES = "BARDFLOW_SERVER_IDLE_MINUTES"
DEFAULT_IDLE_MINUTES = 30.0
DEFAULT_PORT = 4200


class RunOwnServer(Protocol):
    """A run's own server (``prefect_server/embedded.py``), as the command waits on, watches and stops it."""

    def wait(self, timeout_s: float) -> None: ...
    def watch(self) -> None: ...
    def stop(self) -> None: ...


class ServerError(BardflowError, RuntimeError):
    """The background server could not be started or reached."""


def prefect_home() -> Path:
    return Path(os.environ.get("PREFECT_HOME", "~/.prefect")).expanduser().resolve()


def state_file() -> Path:
    """The kept server's record for this setup: one per Prefect home, in this cache folder."""
    named = os.environ.get("BARDFLOW_SERVER_FILE")
    if named:
        return Path(named).expanduser()
    return cache_dir() / "servers" / f"{hashlib.sha256(str(prefect_home()).encode()).hexdigest()[:12]}.json"


def versions() -> dict[str, str | None]:
    """What a kept server runs: one of other versions (after an upgrade) is replaced, not used."""
    from importlib import metadata

    found: dict[str, str | None] = {}
    for name in ("bardflow", "prefect"):
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    return found


def idle_minutes() -> float:
    raw = os.environ.get(IDLE_MINUTES, "").strip()
    try:
        value = float(raw) if raw else DEFAULT_IDLE_MINUTES
    except ValueError:
        raise ServerError(f"{IDLE_MINUTES}={raw!r} is no number of minutes; e.g. 30, or 0 to keep it up") from None
    if value < 0:
        raise ServerError(f"{IDLE_MINUTES}={raw!r}: give 0 (kept up) or more minutes")
    return value


def _record() -> dict | None:
    try:
        record = json.loads(state_file().read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def _ours(record: dict) -> bool:
    """Whether the process ``record`` names is alive and is the kept server it started: the
    same pid with the same start time (a pid reused after a reboot, by any program, is not),
    and the leader of its own process group (what ``stop`` may signal whole)."""
    pid = record.get("pid")
    if not isinstance(pid, int):
        return False
    try:
        os.kill(pid, 0)
        if os.getpgid(pid) != pid:
            return False
    except OSError:
        return False
    try:
        if "\nState:\tZ" in Path(f"/proc/{pid}/status").read_text():
            return False  # exited, not yet reaped
    except OSError:
        return not Path("/proc/self").exists()  # no /proc: its being alive must do
    return keeper.process_identity(pid) == record.get("process")


def _health(api: str, timeout_s: float) -> bool:
    """Whether the Prefect API at ``api`` (…/api) says it is healthy; OSError if nothing answers."""
    return urllib.request.urlopen(f"{api}/health", timeout=timeout_s).read() == b"true"


def healthy(url: str, timeout_s: float = 2.0) -> bool:
    try:
        return _health(f"{url}/api", timeout_s)
    except OSError:
        return False


def running(wait_s: float = 0.0) -> dict | None:
    """The kept server's record, if it is up and answering; one still starting (another
    run's) is waited for up to ``wait_s``."""
    deadline = time.monotonic() + wait_s
    while True:
        record = _record()
        if record is None or record.get("state", "running") == "stopped" or not _ours(record):
            return None
        if healthy(record["url"]):
            return record
        if record.get("state") != "starting" or time.monotonic() > deadline:
            return None
        time.sleep(0.25)


@dataclass(frozen=True)
class PrefectServer:
    """The Prefect server a command's runs report to, as the command hands it along: the one
    the user chose (``chosen``: PREFECT_API_URL), bardflow's background one (``background``), or
    the run's own (``embedded``, with its process)."""

    api_url: str
    kind: str
    embedded: RunOwnServer | None = None
    starting: dict | None = None  # a kept server this command started: its record, until it answers
    # A kept server a run started by itself: the next run starts another if it is gone. One a
    # person started (``bardflow server start``, perhaps on PostgreSQL) is theirs to start again.
    by_a_run: bool = False

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


def point_prefect_at(server: PrefectServer) -> PrefectServer:
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
    return point_prefect_at(_kept(record))


def start_kept(port: int | None = None) -> PrefectServer:
    """The kept server, for this run and the later ones: started now when none is up (another
    run's still starting is waited for), with this process pointed at it; one line says so
    when this run started it, and what became of an earlier one."""
    idle_s = 60 * idle_minutes()
    poll_s = max(0.5, min(15.0, idle_s / 4)) if idle_s else 15.0
    record, started, earlier = start(port=port, idle_s=idle_s, poll_s=poll_s, by="run")
    if earlier:
        print(fit(f"bardflow: {earlier}"), file=sys.stderr, flush=True)
    if started:
        minutes = record["idle_s"] / 60
        stays = f"stops after {minutes:g} min idle" if minutes else "kept until stopped"
        print(
            fit(f"bardflow: Prefect server at {record['url']} — kept for later runs, {stays} (bardflow server stop)"),
            file=sys.stderr,
            flush=True,
        )
    return point_prefect_at(_kept(record, starting=record if started else None))


def _kept(record: dict, starting: dict | None = None) -> PrefectServer:
    return PrefectServer(f"{record['url']}/api", "kept", starting=starting, by_a_run=record.get("by") == "run")


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


# A run writes a few MB of records (states, logs, events) into the server's database, and
# SQLite needs room for its journal beside them: less free than this is refused before a run.
DATABASE_ROOM = 32 * 2**20


def database_folder(server: PrefectServer | None) -> Path | None:
    """Where the SQLite database of the server a run reports to lies on this machine: the one
    a run would start (``server`` None), its own or a kept one; None for PostgreSQL or a server
    chosen with PREFECT_API_URL, whose disk is not this command's to judge."""
    url = os.environ.get(DATABASE, "")
    if server is not None and server.kind == "kept":
        record = _record() or {}
        url = str(record.get("database", ""))
        url = "" if url.startswith("sqlite (in ") else url
    elif server is not None and server.kind != "embedded":
        return None
    if not url:
        return prefect_home()
    scheme, _, rest = url.partition("://")
    return Path(rest.lstrip("/")).parent if scheme.startswith("sqlite") else None


def database_room_problem(folder: Path, need: int = DATABASE_ROOM) -> str | None:
    """Why a run cannot keep its records in the SQLite database in ``folder`` (its disk full,
    or nearly), in one line; None when there is room."""
    existing = next((p for p in (folder, *folder.parents) if p.exists()), Path("/"))
    free = shutil.disk_usage(existing).free
    if free >= need:
        return None
    return (
        f"the disk under the Prefect database in {folder} has {free / 2**20:.1f} MiB free, and a run's records "
        f"need room there ({need // 2**20} MiB); free some space on it, or set PREFECT_HOME to a folder on a disk "
        "with room"
    )


def _no_room(server: PrefectServer | None) -> str | None:
    """``database_room_problem`` of ``server``'s SQLite database, where it has one here."""
    folder = database_folder(server)
    return None if folder is None else database_room_problem(folder)


def refuse_full_database(server: PrefectServer | None) -> None:
    """Before a run: a ServerError when its server's SQLite database has no room to grow."""
    problem = _no_room(server)
    if problem is not None:
        raise ServerError(problem)


def full_database(error: BaseException, server: PrefectServer | None) -> str | None:
    """One line for a run that failed because its server could not write its SQLite database
    (the disk filled mid-run: Prefect answers 500, the server's log says "database or disk is
    full"); None for any other error."""
    if type(error).__name__ != "PrefectHTTPStatusError" and "database or disk is full" not in str(error):
        return None
    problem = _no_room(server)
    if problem is None:
        return None
    return f"{problem}, then rerun the same command to go on ({GOING_ON})"


def serving_this_process() -> PrefectServer | None:
    """The server this process's runs report to (PREFECT_API_URL, as bardflow set it), as
    ``database_folder`` judges it: the kept one where its record names that address."""
    api = os.environ.get("PREFECT_API_URL", "").rstrip("/")
    record = _record() or {}
    if api and api == f"{record.get('url')}/api":
        return PrefectServer(api, "kept")
    return PrefectServer(api, "embedded") if api.startswith("http://127.0.0.1:") else None


def _shown(url: str) -> str:
    """A database URL without its password."""
    return re.sub(r"://([^:/@]+):[^@]*@", r"://\1:***@", url)


@contextlib.contextmanager
def _start_lock():
    """Held while a kept server is chosen and started: two first runs at once start one."""
    folder = state_file().parent
    folder.mkdir(parents=True, exist_ok=True)
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX)
        yield
    finally:
        os.close(descriptor)


def _port_free(port: int) -> bool:
    import socket

    with socket.socket() as probe:
        # As the server's own socket does: a port left in TIME_WAIT by a server just stopped is free.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _write(record: dict) -> None:
    path = state_file()
    try:
        keeper.write_record(path, record)
    except OSError as error:
        raise ServerError(
            f"cannot write the kept server's record {path} ({error.strerror}); free some space there, or run "
            "with --server embedded"
        ) from error


def start(
    port: int | None = None,
    database: str | None = None,
    idle_s: float = 0.0,
    poll_s: float = 15.0,
    wait_s: float = 180.0,
    by: str = "command",
) -> tuple[dict, bool, str]:
    """The kept server's record, whether this call started it, and what became of an earlier
    one ('' when nothing is to be said). One already up of these versions is kept, whatever
    its port; one of other versions is replaced. A port given is used or refused; without one,
    4200 if it is free, else another free port. ``by``: who starts it, "run" (by itself) or
    "command" (``bardflow server start``), as its record keeps. Returns once the new server's process runs;
    ``wait_until_up`` waits for its API."""
    with _start_lock():
        found = running(wait_s=wait_s)
        if found is not None and found.get("versions", versions()) == versions():
            return found, False, ""
        earlier = ""
        if found is not None:
            was = found.get("versions") or {}
            earlier = (
                f"the kept server at {found['url']} ran bardflow {was.get('bardflow')} and Prefect "
                f"{was.get('prefect')}: replaced"
            )
            stop()
        elif (old := _record()) is not None and old.get("state", "running") != "stopped":
            earlier = f"the kept server (pid {old.get('pid')}) had stopped without a word: started another"
        chosen = _port_for(port)
        path = state_file()
        log = path.with_suffix(".log")
        env = dict(os.environ)
        if database is not None:
            env[DATABASE] = database_url(database)
        command = [sys.executable, "-m", keeper.__name__, "--port", str(chosen), "--state", str(path)]
        command += ["--idle-s", str(idle_s), "--poll-s", str(poll_s)]
        with open(log, "ab") as out:  # detached: it outlives this command and its terminal
            process = subprocess.Popen(
                command,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                cwd=Path(__file__).resolve().parents[1],
                env=env,
            )
        record = {
            "pid": process.pid,
            "process": keeper.process_identity(process.pid),
            "url": f"http://127.0.0.1:{chosen}",
            "log": str(log),
            "database": _shown(env.get(DATABASE) or f"sqlite (in {prefect_home()})"),
            "prefect_home": str(prefect_home()),
            "versions": versions(),
            "started": time.time(),
            "idle_s": idle_s,
            "by": by,
            "state": "starting",
        }
        _write(record)
    return record, True, earlier


def _port_for(port: int | None) -> int:
    """The port asked for, or refused when taken; without one, the port the kept server had
    (the links printed before stay live), else 4200, else a free one."""
    had = str((_record() or {}).get("url", "")).rpartition(":")[2]
    chosen = port if port is not None else int(had) if had.isdigit() else DEFAULT_PORT
    if _port_free(chosen) and not healthy(f"http://127.0.0.1:{chosen}"):
        return chosen
    if port is not None:
        raise ServerError(
            f"something already answers at http://127.0.0.1:{port}; stop it, or pick another port with --port"
        )
    from ..processes.launch import free_port

    return DEFAULT_PORT if chosen != DEFAULT_PORT and _port_free(DEFAULT_PORT) else free_port()


def wait_until_up(record: dict, timeout_s: float = 180.0) -> None:
    """Waits for a kept server just started to answer; a ``ServerError`` naming its log if it
    does not."""
    deadline = time.monotonic() + timeout_s
    while not healthy(record["url"], timeout_s=1.0):
        alive = _ours(record)
        if not alive or time.monotonic() > deadline:
            if alive:
                with contextlib.suppress(OSError):
                    os.killpg(record["pid"], signal.SIGTERM)
            raise ServerError(
                f"the Prefect server did not come up at {record['url']} within {timeout_s:.0f} s; see its log "
                f"{record['log']}, or run with --server embedded"
            )
        time.sleep(0.25)
    now = _record()
    if now is not None and now.get("pid") == record["pid"] and now.get("state") == "starting":
        _write({**now, "state": "running"})  # as its keeper notes too, at its next look


def stop() -> bool:
    """Stops the kept server; False if none was running. Its record then says it stopped."""
    record = _record()
    if record is None or record.get("state") == "stopped" or not _ours(record):
        return False
    try:
        os.kill(record["pid"], signal.SIGTERM)  # the keeper stops its server, then itself
    except OSError:
        return False
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and _ours(record):
        time.sleep(0.2)
    if _ours(record):
        with contextlib.suppress(OSError):
            os.killpg(record["pid"], signal.SIGKILL)
    now = _record()
    if now is not None and now.get("pid") == record["pid"] and now.get("state") != "stopped":
        _write({**now, "state": "stopped", "stopped": time.time(), "why": "stopped by `bardflow server stop`"})
    return True


def command(
    action: str, port: int | None, database: str | None = None, idle_minutes_given: float | None = None
) -> None:
    if action == "start":
        idle_s = 60 * (idle_minutes_given or 0.0)  # started by hand: kept until stopped, unless asked
        record, started, earlier = start(port, database=database, idle_s=idle_s)
        if started:
            wait_until_up(record)
        elif float(record.get("idle_s") or 0) != idle_s:  # a run's, which would stop when idle: kept now
            record = {**record, "idle_s": idle_s, "by": "command"}
            _write(record)  # its keeper reads its idle stretch from the record at each look
            earlier = earlier or (
                "the server a run started is kept until `bardflow server stop`"
                if not idle_s
                else f"the server now stops after {idle_minutes_given:g} min idle"
            )
        if earlier:
            print(fit(f"bardflow: {earlier}"), file=sys.stderr)
        if not started and port is not None and not record["url"].endswith(f":{port}"):
            raise ServerError(
                f"a background Prefect server already runs at {record['url']} (pid {record['pid']}), "
                f"so --port {port} was not used; `bardflow server stop`, then start again to move it "
                f"to port {port}"
            )
        said = (
            f"{'' if started else 'already running: '}Prefect server: {record['url']} (pid {record['pid']}, "
            f"log {record['log']}, database {record.get('database')})\n"
            "`bardflow run` and `bardflow sweep` use it while it runs; `bardflow server stop` stops it."
        )
        print(fit(said, sys.stdout))
    elif action == "stop":
        print("stopped" if stop() else "no background server was running")
    elif action == "env":
        record = running()
        if record is None:
            print("bardflow: no kept server is running; start it with `bardflow server start`", file=sys.stderr)
            raise SystemExit(3)
        # DO_NOT_TRACK: Prefect's own commands then send no telemetry, as bardflow's servers do not.
        print(f"export PREFECT_API_URL={record['url']}/api DO_NOT_TRACK=1")
    else:
        record = running()
        print(fit(server_status(record), sys.stdout) if record else "not running")
        if record is None:
            raise SystemExit(3)


GOING_ON = "finished stages come back cached, training resumes from its checkpoint"
LATER_UI = "http://127.0.0.1:4200"  # where `bardflow ui` serves the runs of this Prefect home
SILENT_FOR_S = 4.0  # a server that answers no health check for this long is gone


def watch_chosen(api: str, every_s: float = 1.0, rerun_starts_one: bool = False):
    """The same watch over a server the run found (the background one, PREFECT_API_URL),
    which is not this process's child: its health is asked every ``every_s`` seconds, and a
    server silent for ``SILENT_FOR_S`` stops the run in one line. The watch ends when the
    event it returns is set (the run's end: the process may go on, as a caller's does).
    ``rerun_starts_one``: the server is a kept one a run started, which the rerun replaces by itself."""
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
                again = (
                    "rerun the same command: it starts another and goes on"
                    if rerun_starts_one
                    else "start it again (`bardflow server start`) and rerun the same command to go on"
                )
                server_gone(f"the Prefect server at {api} stopped answering mid-run ({reason}); {again} ({GOING_ON})")
                return

    threading.Thread(target=poll, name="bardflow-server-watch", daemon=True).start()
    return done


def server_gone(why: str) -> None:
    """Stops the run for a server that is gone, or cannot write its database: the run's last
    line is ``why`` (``silence_prefect``)."""
    from ..processes import stopping

    silence_prefect()
    stopping.fail(why)


def silence_prefect() -> None:
    """What Prefect still holds for a server that cannot take it (events, logs, state reports)
    can no longer be sent: its retries and their warnings are silenced, so that the line that
    says what happened is the command's last."""
    import logging

    known = [name for name in logging.root.manager.loggerDict if name.startswith("prefect")]
    for name in (*known, "prefect", "EventsWorker", "APILogWorker"):
        # A filter, not a level: Prefect's internal loggers answer to a setting of their own.
        logging.getLogger(name).addFilter(lambda record: False)
    # Prefect's log worker writes its failures to send straight to stderr unless this stdlib flag is off.
    logging.raiseExceptions = False
