"""What the terminal shows of a run's log, apart from the run's story (``pipeline.py``): an
explained error once, in one line, without its traceback; a quiet terminal's short lines;
Prefect's drain notice kept to its own services."""

from __future__ import annotations

import logging
from typing import ClassVar

from ..config.line_width import fit
from ..errors import BardflowError
from .environment import debugging


def one_line(error: BaseException) -> str:
    """An error as one line: an explained error's own first line, else its type and text."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return (text if isinstance(error, BardflowError) else f"{type(error).__name__}: {text}".rstrip(": "))[:500]


class ExplainedErrorFilter(logging.Filter):
    """Explained errors name the problem and the fix in their message; a traceback in the
    log would only bury that line (unless debugging). Other errors keep theirs.

    On the terminal (``terminal=True``), Prefect's own reports of an explained error (the task
    failed, the task's state, the flow's exception, the flow's state: the same line four more
    times) are left out: the command ends with that line once. With ``quiet`` (a run at the
    terminal, without --verbose), the terminal shows warnings, errors and the INFO lines marked
    for it (``ui.say``: a stage's end, progress, a wait); the log and the UI keep everything."""

    explained: ClassVar[set[str]] = set()  # the explained errors' lines seen in this process
    quiet: ClassVar[bool] = False  # set by the command line

    def __init__(self, terminal: bool = False):
        super().__init__()
        self.terminal = terminal

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if type(error).__name__ == "CancelledRun" and not debugging():
            # The engine reading a run that ended Cancelled (a deployment's run cancelled: the
            # flow returns that state) is no error: the run's state and its stage's line say it.
            return False
        if isinstance(error, BardflowError) and not debugging():
            record.exc_info, record.exc_text = None, None
            ExplainedErrorFilter.explained.add(one_line(error))
            return not self.terminal
        if self.terminal and record.name.startswith("prefect.") and not debugging():
            if self.quiet and record.levelno < logging.WARNING and not getattr(record, "bardflow_terminal", False):
                return False
            message = record.getMessage()
            return not any(line and line[:200] in message for line in ExplainedErrorFilter.explained)
        return True


class TerminalFormatter(logging.Formatter):
    """A quiet terminal's lines: the time and the message (a level only where it is not INFO),
    short enough for 80 columns; the log and the UI keep Prefect's full form."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(message)s", datefmt="%H:%M:%S")

    def formatMessage(self, record: logging.LogRecord) -> str:
        line = super().formatMessage(record)
        line = line if record.levelno == logging.INFO else line.replace(" ", f" {record.levelname.lower()}: ", 1)
        return fit(line)  # the terminal handler writes to stderr


# Prefect's services that send logs and events say, when the process ends with some still
# queued (a run that failed at once), "Still processing items: 5 items remaining...": they are
# sent all the same, so the line only stands after the run's own last line.
QUEUE_SERVICES = ("EventsWorker", "APILogWorker")
DRAIN_NOTICE = "Still processing items"


def _not_a_drain_notice(record: logging.LogRecord) -> bool:
    return not (record.levelno == logging.WARNING and record.getMessage().startswith(DRAIN_NOTICE))


def quiet_explained_errors() -> None:
    """Each log handler gets the filter above (once); with ``ExplainedErrorFilter.quiet``, the
    terminal's handler also the short form. Prefect's queue services keep their drain notice
    to themselves."""
    for name in QUEUE_SERVICES:
        service = logging.getLogger(name)
        if _not_a_drain_notice not in service.filters:
            service.addFilter(_not_a_drain_notice)
    loggers = [logging.getLogger(name) for name in ("", "prefect", "prefect.flow_runs", "prefect.task_runs")]
    for handler in (h for logger in loggers for h in logger.handlers):
        terminal = isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler)
        if not any(isinstance(f, ExplainedErrorFilter) for f in handler.filters):
            handler.addFilter(ExplainedErrorFilter(terminal=terminal))
        if terminal and ExplainedErrorFilter.quiet and not debugging():
            handler.setFormatter(TerminalFormatter())
