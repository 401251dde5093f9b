"""Stopping when told: SIGINT (Ctrl-C) and SIGTERM (a scheduler's preemption, a Prefect
worker's cancel) ask the run to stop rather than kill it where it stands.

Training stops before its next step, after saving a resumable checkpoint of the steps done
(the preemption case); a stage that does not train finishes and the next one does not start;
training processes this one started are told to do the same. The command then exits 130 or
143 with one line saying where it stopped. A second signal, or a run still going
``GRACE_S`` after the first (an XLA compilation cannot be interrupted), ends the process at
once: the hooks registered with ``on_force`` run first (stop the children, the temporary
Prefect server), so nothing is left behind; a rerun resumes from the newest checkpoint.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable

from ..errors import BardflowError
from . import signals

GRACE_S = 8.0  # then the process ends itself: the promise is a stop within 10 s
SIGNALS = signals.STOP_SIGNALS

_requested: int | None = None
_where = "before the run started"
_children: set[subprocess.Popen] = set()
_force_hooks: list[Callable[[], None]] = []
_timer: threading.Timer | None = None
_failure: str | None = None  # not a signal: what made the run stop (see ``fail``)


class Stopped(BardflowError, RuntimeError):
    """The run stopped because a signal asked it to; its exit status is 128 + the signal."""

    def __init__(self, signum: int, message: str):
        super().__init__(message)
        self.exit_code = 128 + signum


def name(signum: int) -> str:
    return signal.Signals(signum).name


def requested() -> int | None:
    """The signal that asked the run to stop, if one has."""
    return _requested


def where() -> str:
    return _where


def at(where: str) -> None:
    """Says where the run is (a stage, a training step), for the line a forced stop prints."""
    global _where
    _where = where


def check(where: str) -> None:
    """Raises ``Stopped`` if a stop was asked for: at a point where stopping loses nothing."""
    if _requested is not None:
        raise Stopped(
            _requested,
            f"stopped by {name(_requested)} {where}; rerun the same command to go on "
            "(finished stages come back cached)",
        )


def failure() -> str | None:
    """Why the run was stopped from within (``fail``), if it was."""
    return _failure


def fail(why: str) -> None:
    """Stops the run as SIGTERM would (training saves its step), for ``why``, something the
    run cannot go on without; the command then ends with ``why`` as its error line, exit 1."""
    global _failure
    if _requested is None:
        _failure = why
        _handle(signal.SIGTERM, None)


def track(process: subprocess.Popen) -> None:
    """A child that a forced stop must not leave behind (killed with its process group)."""
    _children.add(process)


def untrack(process: subprocess.Popen) -> None:
    _children.discard(process)


def on_force(hook: Callable[[], None]) -> None:
    """Runs ``hook`` should the process be ended at once (each hook once, however often given)."""
    if hook not in _force_hooks:
        _force_hooks.append(hook)


def end_if_failed() -> None:
    """Ends the process now, with the failure's line, when the run was stopped from within
    (``fail``: its server is gone). Called once a stage has unwound and saved what it could:
    nothing is left to do that could still be reported, and waiting out ``GRACE_S`` would only
    delay the line."""
    if _failure is not None:
        force(signal.SIGTERM)


def install() -> bool:
    """Takes SIGINT and SIGTERM for this process (main thread only; False elsewhere).
    Called again inside a flow run, whose engine installs a SIGTERM handler of its own."""
    try:
        signals.install(_handle, SIGNALS)
    except ValueError:  # not the main thread
        return False
    return True


def _handle(signum: int, frame) -> None:
    global _requested, _timer
    if _requested is not None:  # asked twice: now
        force(signum)
    _requested = signum
    if _failure is None:
        print(
            f"bardflow: {name(signum)} received: stopping {_where} (again to stop at once)", file=sys.stderr, flush=True
        )
    _timer = threading.Timer(GRACE_S, force, args=(signum, f"still running {GRACE_S:.0f} s later"))
    _timer.daemon = True
    _timer.start()


def force(signum: int, why: str = "asked twice") -> None:
    """Ends the process now: children killed, hooks run, one line, exit 128 + signal."""
    for child in list(_children):
        try:
            os.killpg(child.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    for hook in _force_hooks:
        try:
            hook()
        except Exception:  # noqa: BLE001 - ending anyway; one hook must not keep the next from running
            pass
    if _failure is not None:
        _last_line(f"bardflow: error: {_failure}")
        os._exit(1)
    _last_line(
        f"bardflow: error: stopped by {name(signum)} {_where} ({why}); rerun the same command to resume "
        "from the newest checkpoint"
    )
    os._exit(128 + signum)


def _last_line(line: str) -> None:
    """Straight to the terminal: inside a flow run, Prefect turns a print into a log record,
    and a run whose server is gone has its records dropped."""
    try:
        sys.stderr.flush()
    except (OSError, ValueError):
        pass
    os.write(2, f"{line}\n".encode())
