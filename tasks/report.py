"""What a stage tells the user as it works — lines, warnings and progress — through the
reporter the flow hands it: Prefect's run log, the terminal's bars and the UI's progress
artifacts (``flows/ui.py``). A stage knows no Prefect: called outside a flow (a test, a
script), its lines go to the ``bardflow`` logger and its progress nowhere."""

from __future__ import annotations

import logging
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Protocol


class Reporter(Protocol):
    def log(self, message: str, *args: Any, terminal: bool = False) -> None: ...

    def say(self, message: str, *args: Any) -> None: ...

    def warning(self, message: str) -> None: ...

    def Progress(
        self, stage: str, total: int, label: str, *, in_bytes: bool = False
    ) -> AbstractContextManager[Any]: ...


class _Logging:
    """Without a flow: lines to the ``bardflow`` logger, no progress."""

    def log(self, message: str, *args: Any, terminal: bool = False) -> None:
        logging.getLogger("bardflow").info(message, *args)

    def say(self, message: str, *args: Any) -> None:
        logging.getLogger("bardflow").info(message, *args)

    def warning(self, message: str) -> None:
        logging.getLogger("bardflow").warning(message)

    def Progress(self, stage: str, total: int, label: str, *, in_bytes: bool = False) -> AbstractContextManager[Any]:
        return nullcontext(_Count(total))


class _Count:
    """Progress told to no one: what it has been told, as a bar would hold it."""

    def __init__(self, total: int):
        self.total, self.done = max(1, total), 0

    def __call__(self, done: int, total: int | None = None) -> None:
        self.total = max(1, total) if total is not None else self.total
        self.done = min(done, self.total)


_reporter: Reporter = _Logging()


def use(reporter: Reporter) -> None:
    """The reporter every stage of this process tells from now on (the flows set theirs)."""
    global _reporter
    _reporter = reporter


def log(message: str, *args: Any, terminal: bool = False) -> None:
    """A line for the run's log; the terminal shows it too with ``terminal``."""
    _reporter.log(message, *args, terminal=terminal)


def say(message: str, *args: Any) -> None:
    """A line a user at the terminal needs (progress, a resume, a wait, a measurement)."""
    _reporter.say(message, *args)


def warning(message: str) -> None:
    _reporter.warning(message)


def progress(stage: str, total: int, label: str, in_bytes: bool = False) -> AbstractContextManager[Any]:
    """A progress bar and its artifact for a long step: ``with progress(...) as advance:``,
    then ``advance(done)`` (or ``advance(done, total)``) as it goes; ``advance.total`` is the
    total as last told."""
    return _reporter.Progress(stage, total, label, in_bytes=in_bytes)
