"""What every process of a multi-process ``train_parallel`` does (its command is
``tasks/train_process.py``, which knows where the files come from).

Who is who comes from the environment (``processes/distributed.py``). Every process trains the
same replicated model on its own rows of each global batch (``model/training/training_run.py``); process 0
alone writes and reads checkpoints (``model.checkpoint``), and writes the run's summary,
from which the stage writes the version.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from ...config.settings import TrainingRequest
from ...processes.distributed import DistributedError, ProcessGroup, initialize
from ...processes.launch import NOTE, PROGRESS, WARNING
from .multihost import broadcast_json

if TYPE_CHECKING:
    from .training_run import RunFiles


def run_process(spec_path: Path | None, join_timeout_s: int, files_of: Callable[[dict, bool], RunFiles]) -> None:
    """Joins the group, learns the run from process 0's ``spec_path`` and trains;
    ``files_of(spec, leader)`` says where this process finds its files."""
    group = ProcessGroup.from_env()
    if group is None and spec_path is None:
        raise DistributedError(
            "no process group: set BARDFLOW_COORDINATOR, BARDFLOW_NUM_PROCESSES and "
            "BARDFLOW_PROCESS_ID (or start the processes with srun)"
        )
    leader = group is None or group.leader  # no group: one supervised process, with every device
    if leader and spec_path is None:
        raise DistributedError("process 0 describes the run: pass the spec file it was launched with")
    spec = json.loads(spec_path.read_text()) if leader and spec_path is not None else None
    if group is not None:
        initialize(group, timeout_s=join_timeout_s)
        spec = broadcast_json(spec)
    assert spec is not None  # process 0's, read or received

    import jax

    from .step import TrainingError
    from .training_run import run_training

    request = TrainingRequest.model_validate(spec["request"])
    devices = jax.devices()
    if len(devices) != request.devices:
        raise TrainingError(
            f"the {jax.process_count()} processes have {len(devices)} devices in all but the run "
            f"asked for {request.devices}; give each process the same share of the devices"
        )

    def report(done: int, total: int) -> None:
        if leader:
            print(f"{PROGRESS} {done} {total}", flush=True)

    def warn(message: str) -> None:  # to the stage's log, through the launcher
        print(f"{WARNING} {message}", flush=True)

    def note(message: str) -> None:  # to the stage's log and the terminal, through the launcher
        if leader:
            print(f"{NOTE} {message}", flush=True)

    files = files_of(spec, leader)
    summary = run_training(request, files, devices, parallel=True, on_step=report, warn=warn, note=note)
    if leader:  # the stage makes the version's other files and its manifest from this
        Path(spec["result"]).write_text(summary.to_json())
