"""Publishing stage outputs to the Prefect UI, and progress for long steps.

Every artifact of a stage uses the stable key ``bardflow-<stage>[-<what>]`` so the
UI's artifact page shows one history per stage. Outside a Prefect run these
helpers do nothing, so stages can also run as plain functions.
"""

from __future__ import annotations

import base64
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from prefect.artifacts import (
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)
from prefect.context import FlowRunContext, TaskRunContext
from rich.console import Console
from rich.file_proxy import FileProxy
from rich.progress import (
    BarColumn,
    DownloadColumn,
    MofNCompleteColumn,
    ProgressColumn,
    Task,
    TimeRemainingColumn,
    TransferSpeedColumn,
)
from rich.progress import Progress as Bar
from rich.text import Text

if TYPE_CHECKING:
    from collections.abc import Callable
    from uuid import UUID


def artifact_key(stage: str, what: str = "") -> str:
    return "-".join(part for part in ("bardflow", stage.replace("_", "-"), what) if part)


def _in_run() -> bool:
    return TaskRunContext.get() is not None or FlowRunContext.get() is not None


TERMINAL = {"bardflow_terminal": True}  # a record's mark: the terminal shows this INFO line too


def log(message: str, *args: Any, terminal: bool = False) -> None:
    """To the run's log in the UI when inside a run, else to the ``bardflow`` logger. A
    terminal run shows INFO lines only with ``terminal`` (the rest: the log, the UI, --verbose)."""
    import logging

    from prefect.logging import get_run_logger

    logger = get_run_logger() if _in_run() else logging.getLogger("bardflow")
    logger.info(message, *args, extra=TERMINAL if terminal else None)


def say(message: str, *args: Any) -> None:
    """An INFO line a user at the terminal needs (progress, a resume, a wait, a measurement)."""
    log(message, *args, terminal=True)


def warning(message: str) -> None:
    """A warning line, to the run's log in the UI when inside a run."""
    import logging

    from prefect.logging import get_run_logger

    (get_run_logger() if _in_run() else logging.getLogger("bardflow")).warning(message)


def table(stage: str, rows: list[dict[str, Any]], description: str, what: str = "") -> None:
    if _in_run():
        create_table_artifact(table=rows, key=artifact_key(stage, what), description=description)


def markdown(stage: str, text: str, description: str, what: str = "") -> None:
    if _in_run():
        create_markdown_artifact(markdown=text, key=artifact_key(stage, what), description=description)


def png_markdown(title: str, png: Path) -> str:
    """Embeds a PNG in markdown as a data URI: it renders in the UI with no network."""
    data = base64.b64encode(png.read_bytes()).decode()
    return f"### {title}\n\n![{title}](data:image/png;base64,{data})\n"


def markdown_table(header: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def time_left(seconds: float) -> str:
    """An estimate of the time left as a log line says it: ``"done"``, ``"ETA 42 s"``, ``"ETA 3 min 05 s"``."""
    if seconds <= 0:
        return "done"
    whole = round(seconds)
    return f"ETA {whole} s" if whole < 60 else f"ETA {whole // 60} min {whole % 60:02d} s"


def _log_lines_through(stream: Any, proxy: Any) -> list[Callable[[], None]]:
    """While a bar is live, ``proxy`` prints each line written to it above the bar; log
    handlers hold the stream they were made with and would write over the bar's line. Each
    handler on ``stream`` (Prefect's console handler prints through a rich console of its
    own) writes through ``proxy`` until the returned calls undo it."""
    import logging

    loggers = [
        logging.getLogger(),
        *(v for v in logging.root.manager.loggerDict.values() if isinstance(v, logging.Logger)),
    ]
    undo: list[Callable[[], None]] = []
    for handler in {h for logger in loggers for h in logger.handlers}:
        console = getattr(handler, "console", None)
        if console is not None and getattr(console, "file", None) is stream:
            console.file = proxy
            undo.append(lambda console=console: setattr(console, "file", stream))
        elif isinstance(handler, logging.StreamHandler) and handler.stream is stream:
            handler.setStream(proxy)
            undo.append(lambda handler=handler: handler.setStream(stream))
    return undo


class _AboveTheBar(FileProxy):
    """A file whose lines the live bar's console prints above the bar. Rich's own proxy names
    the file it stands for, and a rich console handed it writes to that file directly, over
    the bar: this one names itself."""

    @property
    def rich_proxied_file(self) -> Any:
        return self


class _LabelColumn(ProgressColumn):
    def render(self, task: Task) -> Text:
        return Text(task.description, style="bold")


class _SizedBarColumn(BarColumn):
    """Each bar as wide as its own label leaves room for (its task's ``bar_width``)."""

    def render(self, task: Task) -> Any:
        self.bar_width = task.fields.get("bar_width", 40)
        return super().render(task)


class _CountColumn(ProgressColumn):
    """Bytes and their rate for a transfer, steps done of all for the rest."""

    def __init__(self) -> None:
        super().__init__()
        self.parts = {True: (DownloadColumn(), TransferSpeedColumn()), False: (MofNCompleteColumn(),)}

    def render(self, task: Task) -> Text:
        return Text(" ").join(part.render(task) for part in self.parts[bool(task.fields.get("in_bytes"))])


class _Display:
    """The one live display on the terminal: a bar opened while another is drawn (a
    sweep's, then each stage's of its runs) is a row of it, gone when that bar closes, so
    that nested bars never draw over each other. Log lines print above it."""

    def __init__(self) -> None:
        stream = sys.stderr
        self.bar = Bar(
            _LabelColumn(),
            _SizedBarColumn(),
            _CountColumn(),
            TimeRemainingColumn(),
            transient=False,
            console=Console(stderr=True),  # beside the log, off stdout (which --json keeps for itself)
        )
        self.users = 0
        self.bar.start()
        self.undo = _log_lines_through(stream, _AboveTheBar(self.bar.console, stream))

    def stop(self) -> None:
        self.bar.stop()
        for undo in self.undo:
            undo()


_DISPLAY: _Display | None = None


class Progress:
    """A terminal bar plus a throttled progress artifact in the UI (each update is an
    HTTP call of tens of milliseconds, so at most one every ``every_s`` seconds).
    Without a terminal (a worker's log, CI) it logs every 10 % instead of drawing.

    The artifact is updated from a thread of its own, the newest value replacing any not yet
    sent: a server that answers slowly or not at all (Prefect's client retries for over a
    minute) never holds up the step that reports."""

    CLOSE_WAIT_S = 5.0  # the last value gets this long to reach the server

    def __init__(
        self,
        stage: str,
        total: int,
        label: str,
        every_s: float = 2.0,
        in_bytes: bool = False,
        clock: Callable[[], float] = time.monotonic,
    ):
        import contextvars
        import threading

        self.total, self.every_s, self.label = max(1, total), every_s, label
        self._clock = clock
        self._logged, self._started = 0, clock()
        self._first: tuple[float, int] | None = None  # the first report: the pace is measured from it
        self._last = 0.0
        self._artifact = None
        self._pending: float | None = None
        self._wake = threading.Condition()
        self._closed = False
        self._sender: threading.Thread | None = None
        if _in_run():
            self._artifact = cast(
                "UUID",
                create_progress_artifact(  # the synchronous call's result
                    progress=0.0, key=artifact_key(stage, "progress"), description=label
                ),
            )
            # In this run's context (its settings: which server), as Prefect's own threads are.
            self._sender = threading.Thread(
                target=contextvars.copy_context().run, args=(self._send,), name="bardflow-progress", daemon=True
            )
            self._sender.start()
        import shutil

        # The label, the count and the time left keep their room on a narrow terminal; the bar takes the rest.
        self.in_bytes = in_bytes
        room = shutil.get_terminal_size().columns - len(label) - (30 if in_bytes else 2 * len(str(total))) - 12
        self._live = sys.stderr.isatty()
        self._task = None
        if self._live:
            global _DISPLAY
            if _DISPLAY is None:
                _DISPLAY = _Display()
            _DISPLAY.users += 1
            self._task = _DISPLAY.bar.add_task(label, total=total, in_bytes=in_bytes, bar_width=max(5, min(40, room)))

    def __call__(self, done: int, total: int | None = None) -> None:
        if total is not None and total != self.total:  # a download's size comes with its answer
            self.total = max(1, total)
            self._update(total=self.total)
        done = min(done, self.total)  # an archive's raw bytes overrun its member's size by its directory
        self._update(completed=done)
        now = self._clock()
        seconds = max(now - self._started, 1e-9)
        if self._first is None:
            self._first = (now, done)
            if not self.in_bytes:
                # Steps done before the first report are a resumed run's earlier ones: no pace
                # to tell a time left from yet (it said "ETA 4 s", then "ETA 42 s"); the next
                # tenth's line has one.
                self._logged = max(self._logged, done)
        if (
            not self._live
            and done * 10 // self.total > self._logged * 10 // self.total
            and (not self.in_bytes or seconds > 2.0)
        ):  # bytes: a second's copy needs no account
            left = time_left(self._seconds_left(now, done, seconds))
            if self.in_bytes:
                say(
                    "%s: %.1f of %.1f MB (%d%%), %.1f MB/s, %s",
                    self.label,
                    done / 1e6,
                    self.total / 1e6,
                    100 * done // self.total,
                    done / 1e6 / seconds,
                    left,
                )
            else:
                say("%s: %d/%d (%d%%), %s", self.label, done, self.total, 100 * done // self.total, left)
        self._logged = done
        if self._artifact is not None and (now - self._last >= self.every_s or done == self.total):
            self._last = now
            with self._wake:
                self._pending = 100.0 * done / self.total
                self._wake.notify()

    def _update(self, **values: Any) -> None:
        if self._task is not None and _DISPLAY is not None:
            _DISPLAY.bar.update(self._task, **values)

    def _end_bar(self) -> None:
        """The outermost bar stays on the screen, finished; a nested one's row goes."""
        global _DISPLAY
        if self._task is None or _DISPLAY is None:
            return
        task, self._task = self._task, None
        _DISPLAY.users -= 1
        if _DISPLAY.users == 0:
            _DISPLAY.stop()
            _DISPLAY = None
        else:
            _DISPLAY.bar.remove_task(task)

    def _seconds_left(self, now: float, done: int, seconds: float) -> float:
        """The time left at the pace since the first report: what came before it (a first
        step's compilation, a connection) would stretch every estimate."""
        first_at, first_done = self._first or (self._started, 0)
        if done > first_done and now > first_at:
            return (now - first_at) * (self.total - done) / (done - first_done)
        return seconds * (self.total - done) / max(done, 1)

    def _send(self) -> None:
        artifact = self._artifact  # made before this thread starts
        if artifact is None:
            return
        while True:
            with self._wake:
                while self._pending is None and not self._closed:
                    self._wake.wait()
                value, self._pending = self._pending, None
                if value is None:  # closed with nothing left to send
                    return
            try:
                update_progress_artifact(artifact, progress=value)
            except Exception:  # noqa: BLE001 - progress is a courtesy: a lost update costs nothing
                pass

    def close(self, wait: bool = True) -> None:
        """Ends the bar; the last update goes to the server (waited for up to CLOSE_WAIT_S
        unless ``wait`` is false: a stage that failed or stopped, maybe for want of a server)."""
        self._end_bar()
        if self._sender is not None:
            with self._wake:
                self._closed = True
                self._wake.notify()
            if wait:
                self._sender.join(self.CLOSE_WAIT_S)

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, kind, *exc) -> None:
        self.close(wait=kind is None)
