"""How a command ends when something went wrong: one line for a process short of memory or
threads, Prefect's pending reports sent before the error line, and whether checkpoint writers
are stuck waiting on each other."""

from __future__ import annotations

import sys

from ..processes import stopping


def out_of_resources(error: BaseException) -> str | None:
    """One line for a process that could not get memory or a thread, naming the limits."""
    if isinstance(error, MemoryError) or "can't start new thread" in str(error):
        what = "memory" if isinstance(error, MemoryError) else "a new thread"
        return (
            f"the run could not get {what} ({type(error).__name__}: {str(error)[:80]}); check this shell's limits "
            "(ulimit -v for virtual memory, ulimit -u for processes) and the memory free, then rerun the same "
            "command to go on (finished stages come back cached)"
        )
    return None


def settle_reports(timeout_s: float = 5.0) -> None:
    """Sends what Prefect still holds for the server (the failed run's events and logs)
    before the error line, so that its own drain messages ("Still processing items") come
    before that line rather than after it."""
    if "prefect" not in sys.modules or stopping.failure():
        return
    from ..prefect_server.prefect_private import drain_reports

    drain_reports(timeout_s)


def writers_stuck() -> bool:
    import threading

    return any(type(t).__name__ == "_SignalingThread" and t.is_alive() for t in threading.enumerate())
