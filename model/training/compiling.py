"""What compiling costs a process: how many programs XLA compiled, in how many seconds, and how
many came from the persistent compilation cache instead (JAX's monitoring events, heard from
every thread), and programs compiled side by side on the host's cores."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import NamedTuple

import jax

COMPILED = "/jax/core/compile/backend_compile_duration"  # a program XLA compiled
FROM_CACHE = "/jax/compilation_cache/cache_hits"  # one read from the persistent cache instead


@dataclass(frozen=True)
class CompileCount:
    asked: int = 0  # programs asked of XLA's compile step (JAX records one read from the cache too)
    seconds: float = 0.0  # their time, summed over threads
    cached: int = 0  # of them, read from the persistent compilation cache

    @property
    def programs(self) -> int:
        """Compiled by XLA, not read from the cache."""
        return self.asked - self.cached

    def __sub__(self, other: CompileCount) -> CompileCount:
        return CompileCount(self.asked - other.asked, self.seconds - other.seconds, self.cached - other.cached)

    def as_json(self) -> dict[str, float | int]:
        return {"programs": self.programs, "seconds": round(self.seconds, 3), "from_cache": self.cached}


class _Counter:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.count = CompileCount()
        self.listening = False

    def heard_duration(self, event: str, duration_secs: float, **_) -> None:
        if event == COMPILED:
            with self.lock:
                self.count = CompileCount(self.count.asked + 1, self.count.seconds + duration_secs, self.count.cached)

    def heard(self, event: str, **_) -> None:
        if event == FROM_CACHE:
            with self.lock:
                self.count = CompileCount(self.count.asked, self.count.seconds, self.count.cached + 1)


_COUNTER = _Counter()


def compiled_so_far() -> CompileCount:
    """The process's compiles since it first asked (subtract two of these for a span)."""
    with _COUNTER.lock:
        if not _COUNTER.listening:
            jax.monitoring.register_event_duration_secs_listener(_COUNTER.heard_duration)
            jax.monitoring.register_event_listener(_COUNTER.heard)
            _COUNTER.listening = True
        return _COUNTER.count


def compile_workers(programs: int, one_on_cpu: bool = False) -> int:
    """Compiles to run at once: one a host core, since compiling one program keeps one core
    busy (a run's programs side by side were ready sooner on 2 cores too, docs/benchmarks.md).
    ``one_on_cpu``: one at a time where XLA compiles for a CPU, as the serving engine's many
    small programs compiled faster there (docs/journal.md)."""
    if one_on_cpu and jax.default_backend() == "cpu":
        return 1
    return max(1, min(programs, os.cpu_count() or 1))


class Timed(NamedTuple):
    executable: jax.stages.Compiled
    seconds: float  # its own compile, timed on its thread (beside the others, sharing the host)


def _timed_compile(program: jax.stages.Lowered, options: dict) -> Timed:
    started = time.perf_counter()
    executable = program.compile(compiler_options=options)
    return Timed(executable, time.perf_counter() - started)


def compile_all(lowered: Sequence[jax.stages.Lowered], options: Sequence[dict] | None = None) -> list[Future]:
    """The lowered programs compiled side by side (``compile_workers``): the futures of their
    executables, each with its own compile time (``Timed``), in order. The caller goes on
    meanwhile (a restore, opening data)."""
    pool = ThreadPoolExecutor(compile_workers(len(lowered)), "bardflow-compile")
    try:
        return [
            pool.submit(_timed_compile, program, (options or [{}] * len(lowered))[at])
            for at, program in enumerate(lowered)
        ]
    finally:
        pool.shutdown(wait=False)  # the compiles run on; the threads end with them
