"""Resuming a training build: the folder its checkpoints are kept in between runs (one writer
at a time, a record of the training they are of), and which checkpoint a run starts from, its
own or one the same training left on another layout. On an object store the folder is kept in
step with the bucket by ``objects.RemoteResumeFolder``; Orbax writes and reads the checkpoints
themselves (``model/training/checkpoint.py``)."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from ..config.settings import TrainingRequest
from ..errors import StoreError


class ResumeFolder:
    """Where an interrupted build keeps what it can pick up again (training checkpoints):
    a local folder, stable across processes. On an object store, ``pull`` and ``push``
    keep it in step with the bucket; here they have nothing to do."""

    url = ""  # the copy on an object store, if any
    # What the folder's build is (the training its checkpoints are of): no reason to keep it.
    RECORD = "record.json"
    # Held by whoever writes checkpoints here, for as long as it can write: one writer at a
    # time. It names its holder's process id.
    WRITER = ".writer.lock"
    WRITER_WAIT_S = 60.0  # a training process of a run that is gone stops within its grace (8 s)

    def __init__(self, path: Path):
        self.path = path

    def pull(self) -> int | None:
        return None

    def push(self) -> None:
        pass

    def clear(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)

    def siblings(self) -> list[Path]:
        """The resume folders of the same stage's other versions in this store: a training of
        the same recipe on another layout may have left checkpoints there."""
        return sorted(p for p in self.path.parent.glob(".resume-*") if p != self.path and p.is_dir())

    def steps(self) -> list[int]:
        return checkpoint_steps(self.path)

    def drop_if_empty(self) -> None:
        """Removes the folder if no file but its record was written in it (a run that failed
        before its first checkpoint); anything a rerun could resume from, or a log, stays."""
        own = (self.path / self.RECORD, self.path / self.WRITER)
        if self.path.is_dir() and not any(p.is_file() and p not in own for p in self.path.rglob("*")):
            shutil.rmtree(self.path, ignore_errors=True)

    @contextlib.contextmanager
    def writing(self, say: Callable[[str], None] | None = None, wait_s: float | None = None) -> Iterator[None]:
        """This process as the folder's one writer while the block runs. Another (a training
        process whose run was killed, still stopping) is waited for up to ``wait_s``, ``say``
        told once; past that, one line names it."""
        wait_s = self.WRITER_WAIT_S if wait_s is None else wait_s
        self.path.mkdir(parents=True, exist_ok=True)
        descriptor = os.open(self.path / self.WRITER, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
        try:
            deadline, told = time.monotonic() + wait_s, False
            while True:
                try:
                    fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    holder = os.pread(descriptor, 32, 0).decode(errors="replace").strip() or "?"
                    if time.monotonic() > deadline:
                        raise StoreError(
                            f"process {holder} still writes checkpoints into {self.path} (the training of an earlier "
                            f"run); wait for it to end or stop it (kill {holder}), then rerun"
                        ) from None
                    if not told and say is not None:
                        say(
                            f"waiting for process {holder}, the training of an earlier run, to stop writing into "
                            f"{self.path}"
                        )
                        told = True
                    time.sleep(0.1)
            os.ftruncate(descriptor, 0)
            os.pwrite(descriptor, str(os.getpid()).encode(), 0)
            yield
        finally:
            os.close(descriptor)


def checkpoint_steps(folder: Path) -> list[int]:
    """The steps of the checkpoints in ``folder``, oldest first: Orbax names each finished one by
    its step, and its unfinished ones otherwise."""
    found = folder.iterdir() if folder.is_dir() else []
    return sorted(int(p.name) for p in found if p.name.isdigit() and p.is_dir())


def same_training(request: TrainingRequest) -> dict[str, Any]:
    """What a training checkpoint stands for on any device count: the recipe with the global
    batch in place of the devices, processes and batch per device (and without how far a
    stage runs: the schedule is the same)."""
    recipe = request.recipe()
    devices = recipe.pop("devices")
    for layout_only in ("processes", "stop_after"):
        recipe.pop(layout_only, None)
    recipe["train"]["global_batch"] = recipe["train"].pop("per_device_batch") * devices
    return recipe


def adopt_checkpoints(resume: ResumeFolder, request: TrainingRequest) -> tuple[int, int] | None:
    """With no checkpoint of its own, a training run takes the newest checkpoint of the same
    training that another run of this stage left on another layout (say four devices, now
    two: Orbax reads it onto this run's shardings), in the store's other resume folders.
    Returns its step and device count."""
    resume.path.mkdir(parents=True, exist_ok=True)
    mine = same_training(request)
    (resume.path / ResumeFolder.RECORD).write_text(json.dumps({"training": mine, "devices": request.devices}))
    if resume.steps():
        return None
    found = None
    for other in resume.siblings():
        try:
            record = json.loads((other / ResumeFolder.RECORD).read_text())
        except (OSError, ValueError):
            continue
        steps = checkpoint_steps(other)
        if record.get("training") == mine and steps and (found is None or steps[-1] > found[1]):
            found = (other, steps[-1], record.get("devices"))
    if found is None:
        return None
    other, step, devices = found
    shutil.copytree(other / str(step), resume.path / str(step))
    return step, devices


def resume_or_adopt(resume: ResumeFolder, request: TrainingRequest, say: Callable[[str], None]) -> None:
    """Before training starts: the folder's last writer gone (a training process of a run that
    was killed stops first), the checkpoint of another layout taken where the run has none of
    its own (``adopt_checkpoints``), and which one it resumes from said (the resume itself is
    reported when it ends)."""
    with resume.writing(say=say):
        adopted = adopt_checkpoints(resume, request)
    if adopted is not None:
        step, devices = adopted
        say(f"resuming from the checkpoint of step {step} of the same training on {devices} device(s)")
        return
    kept = resume.steps()
    if kept:
        say(f"resuming from its checkpoint of step {kept[-1]}")
