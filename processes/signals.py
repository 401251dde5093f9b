"""The one place bardflow installs signal handlers: a run's stop in order (``stopping``), the
kept Prefect server's keeper, and ``bardflow serve`` all take their signals here, so that
what handles SIGINT, SIGTERM or SIGHUP at a moment is found in one module's callers."""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Callable, Iterator
from typing import Any

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)  # Ctrl-C; a scheduler's preemption, a worker's cancel

Handler = Callable[[int, Any], Any] | int  # a function (signum, frame), or signal.SIG_IGN / SIG_DFL


def install(handler: Handler, signals: tuple[int, ...] = STOP_SIGNALS) -> dict[int, Any]:
    """``handler`` for ``signals`` from now on (the main thread only: ValueError elsewhere);
    the handlers before, by signal."""
    return {signum: signal.signal(signum, handler) for signum in signals}


def ignore(signals: tuple[int, ...] = STOP_SIGNALS) -> None:
    """``signals`` ignored from now on (a process already stopping)."""
    install(signal.SIG_IGN, signals)


@contextlib.contextmanager
def handled(handler: Handler, signals: tuple[int, ...] = STOP_SIGNALS) -> Iterator[None]:
    """``signals`` go to ``handler`` within the block; to the handlers before, after it."""
    previous = install(handler, signals)
    try:
        yield
    finally:
        for signum, before in previous.items():
            signal.signal(signum, before)


class Raising:
    """A handler that raises ``raised(signum)`` where the signal lands, and keeps the signal:
    Python prints and drops an exception raised inside a garbage-collection callback (JAX
    has one) or a ``__del__``, so ``check`` raises it again where the caller looks."""

    def __init__(self, raised: Callable[[int], BaseException]):
        self.raised = raised
        self.signum: int | None = None

    def __call__(self, signum: int, frame: Any) -> None:
        self.signum = signum
        raise self.raised(signum)

    def check(self) -> None:
        """Raises for the signal that came, if one has."""
        if self.signum is not None:
            raise self.raised(self.signum)
