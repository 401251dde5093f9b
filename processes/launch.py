"""Starting and supervising the processes of a multi-process run on this host.

The first process to fail stops the others (they would otherwise wait in a collective for
its data), and its log's last lines name the failure. No JAX and no Prefect are imported
here: a launcher only starts processes, follows process 0's progress and waits.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

from ..errors import BardflowError
from . import stopping
from .distributed import CPU_DEVICE_FLAG, NUM_PROCESSES, ProcessGroup

PROGRESS = "bardflow-progress"  # process 0's progress lines in its log: "bardflow-progress 40 200"
WARNING = "bardflow-warning"  # and its warnings, passed on to the stage's log: "bardflow-warning text"
NOTE = "bardflow-note"  # and what the terminal shows of it besides (a measurement): "bardflow-note text"


LAUNCHER = "BARDFLOW_LAUNCHER_PID"  # a launched process's parent: it stops should that one die
LAUNCHER_POLL_S = 0.5


class ProcessFailure(BardflowError, RuntimeError):
    """A process of the run failed; the message names it, how, the step it had reached and
    its log (a native abort is summed up in its fatal line; any other failure shows the
    log's last lines). ``signalled``: it was killed by a signal, not ended by an error of its own."""

    def __init__(self, message: str, signalled: bool = False):
        super().__init__(message)
        self.signalled = signalled


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def process_env(
    index: int, processes: int, port: int, devices_per_process: int, platform: str, base: dict[str, str] | None = None
) -> dict[str, str]:
    """Process ``index``'s environment: its place in the group (coordinator on loopback) and
    its share of the devices. GPU processes never preallocate: each takes the memory it uses."""
    env = {
        **(os.environ if base is None else base),
        **ProcessGroup(processes, index, f"127.0.0.1:{port}").env(),
        "PYTHONUNBUFFERED": "1",
    }
    if platform == "cpu":
        flags = re.sub(rf"{CPU_DEVICE_FLAG}=\d+", "", env.get("XLA_FLAGS", ""))
        env["XLA_FLAGS"] = f"{flags} {CPU_DEVICE_FLAG}={devices_per_process}".strip()
        env["JAX_PLATFORMS"] = "cpu"
    elif platform == "gpu":
        visible = env.get("CUDA_VISIBLE_DEVICES")
        ids = visible.split(",") if visible else [str(i) for i in range(devices_per_process * processes)]
        env["CUDA_VISIBLE_DEVICES"] = ",".join(ids[index * devices_per_process : (index + 1) * devices_per_process])
        env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    return env


def launch_local(
    main: ModuleType,
    spec_path: Path,
    processes: int,
    devices_per_process: int,
    platform: str,
    on_step: Callable[[int, int], None] | None = None,
    on_warning: Callable[[str], None] | None = None,
    on_note: Callable[[str], None] | None = None,
) -> None:
    """Runs the spec as ``processes`` processes of ``main`` on this host, on 127.0.0.1, each
    with its share of the devices, and waits for all of them (see ``supervise``)."""
    port = free_port()
    envs = [process_env(i, processes, port, devices_per_process, platform) for i in range(processes)]
    supervise(main, spec_path, envs, on_step, on_warning=on_warning, on_note=on_note)


def launch_leader(
    main: ModuleType,
    spec_path: Path,
    on_step: Callable[[int, int], None] | None = None,
    on_warning: Callable[[str], None] | None = None,
    on_note: Callable[[str], None] | None = None,
) -> None:
    """Runs process 0 of a group that a cluster scheduler started: the others are
    ``bardflow run`` on the other hosts, following it."""
    supervise(
        main, spec_path, [{**os.environ, "PYTHONUNBUFFERED": "1"}], on_step, on_warning=on_warning, on_note=on_note
    )


def process_command(main: ModuleType, spec_path: Path | None, join_timeout_s: int | None = None) -> list[str]:
    """``python -m`` of the process module ``main`` (imported by the caller, so the direction
    of the dependency is in the code): process 0 gets the spec; every other process follows
    and learns it from process 0."""
    command = [sys.executable, "-m", main.__name__] + ([str(spec_path)] if spec_path else ["--follow"])
    return command + ([] if join_timeout_s is None else ["--join-timeout", str(join_timeout_s)])


def supervise(
    main: ModuleType,
    spec_path: Path,
    envs: list[dict[str, str]],
    on_step,
    poll_s: float = 0.2,
    on_warning: Callable[[str], None] | None = None,
    on_note: Callable[[str], None] | None = None,
) -> None:
    """Starts one process per environment (the first is process 0) and waits for all,
    raising ``ProcessFailure`` on the first failure. Logs: ``process-<i>.log`` beside the
    spec; each process's id in ``process-<i>.pid``."""
    processes = int(envs[0].get(NUM_PROCESSES, len(envs)))
    envs = [{**env, LAUNCHER: str(os.getpid())} for env in envs]
    logs = [spec_path.parent / f"process-{i}.log" for i in range(len(envs))]
    running = []
    try:
        for index, (env, log) in enumerate(zip(envs, logs, strict=True)):
            with log.open("w") as sink:
                running.append(
                    subprocess.Popen(
                        process_command(main, spec_path if index == 0 else None),
                        stdout=sink,
                        stderr=subprocess.STDOUT,
                        env=env,
                        start_new_session=True,
                    )
                )
            log.with_suffix(".pid").write_text(str(running[-1].pid))
            stopping.track(running[-1])
        seen, forwarded = 0, False
        reached: list[tuple[int, int] | None] = [None]

        def progress(done: int, total: int) -> None:
            reached[0] = (done, total)
            if on_step is not None:
                on_step(done, total)

        while True:
            codes = [p.poll() for p in running]
            seen = _follow_progress(logs[0], seen, progress, on_warning, on_note)
            signum = stopping.requested()
            if signum is not None:
                # Each process has a session of its own, out of reach of a terminal's Ctrl-C:
                # told here, they agree on a step, save its checkpoint together and exit.
                if not forwarded:
                    for process in running:
                        if process.poll() is None:
                            os.killpg(process.pid, signal.SIGTERM)
                    forwarded = True
                if all(code is not None for code in codes):
                    raise stopping.Stopped(signum, f"stopped by {stopping.name(signum)}")
                time.sleep(poll_s)
                continue
            failed = next((i for i, code in enumerate(codes) if code not in (None, 0)), None)
            if failed is not None:
                raise _failure(failed, processes, codes[failed], logs[failed], reached[0])
            if all(code == 0 for code in codes):
                return
            time.sleep(poll_s)
    finally:
        stop(running)
        for process in running:
            stopping.untrack(process)


def _failure(index: int, processes: int, code: int, log: Path, reached: tuple[int, int] | None) -> ProcessFailure:
    """One line for a process killed by a signal (XLA's abort is SIGABRT: its stack trace
    stays in the log, whose fatal line is quoted); a process that exited with an error gets
    its log's last lines, where its own error line is."""
    who = "the training process" if processes == 1 else f"process {index} of {processes}"
    where = f" at step {reached[0]} of {reached[1]}" if reached else ""
    others = "" if processes == 1 else "; the others were stopped"
    if code < 0:
        fatal = _fatal_line(log)
        said = f" (XLA: {fatal})" if fatal else ""
        return ProcessFailure(f"{who} {_how(code)}{where}{said}{others}; its log is {log}", signalled=True)
    return ProcessFailure(f"{who} {_how(code)}{where}{others}. Last lines of {log}:\n{_tail(log)}")


def _fatal_line(path: Path, limit: int = 200) -> str | None:
    """The message of the first fatal log line (absl's ``F1201 08:16:43.1 123 file.cc:161] …``)."""
    text = path.read_text(errors="replace") if path.exists() else ""
    found = re.search(r"^F\d{4} [\d:.]+\s+\d+ ([^\]]+)\] (.+)$", text, re.MULTILINE)
    if found is None:
        return None
    text = re.sub(r"\s*RendezvousKey\{[^}]*\}", "", found.group(2))  # which run and devices: noise in one line
    text = re.sub(r"^\[id=\d+\]\s*", "", text).strip()
    message = f"{found.group(1)}: {text}"
    return message if len(message) <= limit else message[: limit - 1] + "…"


def _tail(path: Path, lines: int = 15) -> str:
    text = path.read_text(errors="replace") if path.exists() else ""
    kept = [line for line in text.splitlines() if not line.startswith(PROGRESS)]
    return "\n".join(kept[-lines:])


def _how(code: int) -> str:
    if code < 0:
        return f"was killed by signal {-code} ({signal.Signals(-code).name})"
    return f"exited with status {code}"


def _follow_progress(
    log: Path,
    seen: int,
    on_step: Callable[[int, int], None],
    on_warning: Callable[[str], None] | None = None,
    on_note: Callable[[str], None] | None = None,
) -> int:
    try:
        with log.open("rb") as source:
            source.seek(seen)
            chunk = source.read()
    except FileNotFoundError:
        return seen
    complete = chunk[: chunk.rfind(b"\n") + 1]
    for line in complete.decode(errors="replace").splitlines():
        if line.startswith(PROGRESS):
            done, total = map(int, line.split()[1:3])
            on_step(done, total)
        elif line.startswith(WARNING) and on_warning is not None:
            on_warning(line[len(WARNING) + 1 :])
        elif line.startswith(NOTE) and on_note is not None:
            on_note(line[len(NOTE) + 1 :])
    return seen + len(complete)


def stop(running: list[subprocess.Popen], grace_s: float = 2.0) -> None:
    """SIGTERM to each process group still running, SIGKILL to those left after ``grace_s``
    (a process waiting in a collective for a dead peer may not get to handle the first)."""
    for process in running:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for process in running:
        try:
            process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def follow_launcher(poll_s: float = LAUNCHER_POLL_S) -> None:
    """In a launched process (``LAUNCHER`` set): once the launcher is gone (killed with its run,
    ``kill -9`` of its process group: each launched process has a session of its own, out of
    that group's reach), stop as SIGTERM would, at a step, checkpointed, or at once after the
    grace; never train on for a run that no longer exists, or beside its rerun. Its parent
    process id is watched, which any platform has (Linux's parent-death signal is tied to the
    thread that started the process, which a task's thread pool may end)."""
    launcher = os.environ.get(LAUNCHER)
    if not launcher:
        return
    import threading

    def watch() -> None:
        while os.getppid() == int(launcher):
            time.sleep(poll_s)
        stopping.fail(
            f"the run that started this training process (pid {launcher}) is gone; its rerun resumes "
            "from the newest checkpoint"
        )

    threading.Thread(target=watch, name="bardflow-launcher-watch", daemon=True).start()
