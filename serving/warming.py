"""The serving engine's faster programs, compiled after it is ready: on daemon threads, so that
a server stopped meanwhile does not wait for XLA's compiles (which cannot be interrupted) to
end, each program's key handed to ``ready`` once it is compiled. The engine then uses it from
its next call (``engine.py``)."""

from __future__ import annotations

import queue
import sys
import threading
from collections.abc import Callable

from ..model.training.compiling import compile_workers


class LaterCompiles:
    """Lowers ``programs`` ((key, lowering, first run) each) on one thread and compiles them on
    ``compile_workers`` (one on a CPU); ``done`` is set when every one is compiled or failed."""

    def __init__(self, programs: list, ready: Callable[[tuple], None]):
        self.done = threading.Event()
        self.failed: list[str] = []
        self._ready = ready
        self._lowered: queue.Queue = queue.Queue()
        self._left = len(programs)
        self._lock = threading.Lock()
        if not programs:
            self.done.set()
            return
        workers = compile_workers(len(programs), one_on_cpu=True)
        threading.Thread(target=self._lower, args=(programs, workers), name="bardflow-lower", daemon=True).start()
        for _ in range(workers):
            threading.Thread(target=self._compile, name="bardflow-compile", daemon=True).start()

    def _lower(self, programs: list, workers: int) -> None:
        for key, lower, _ in programs:
            try:
                self._lowered.put((key, lower()))
            except Exception as error:  # noqa: BLE001 - the engine serves on with what it has
                self._lowered.put((key, error))
        for _ in range(workers):
            self._lowered.put(None)

    def _compile(self) -> None:
        while (item := self._lowered.get()) is not None:
            key, lowered = item
            try:
                if isinstance(lowered, Exception):
                    raise lowered
                lowered.compile()
                self._ready(key)
            except Exception as error:  # noqa: BLE001 - a faster program lost, not the server
                self.failed.append(f"{key}: {type(error).__name__}: {error}")
                print(
                    f"bardflow: the serving program {key} did not compile ({error}); served without it",
                    file=sys.stderr,
                    flush=True,
                )
            with self._lock:
                self._left -= 1
                if not self._left:
                    self.done.set()
