"""A cluster's processes other than process 0 (a multi-host train_parallel: a Kubernetes Job,
a SLURM script): they run no flow of their own; each joins process 0's train_parallel, which
tells it what to train, and ends with it."""

from __future__ import annotations

import subprocess
import sys

from ..errors import BardflowError
from ..processes.distributed import ProcessGroup
from .environment import prepare_environment


class FollowerError(BardflowError, RuntimeError):
    """A cluster process other than 0 failed; its own output says why."""


def follower() -> ProcessGroup | None:
    """This process's group when it is a cluster process other than process 0."""
    group = ProcessGroup.from_env()
    return group if group is not None and not group.leader else None


def follow(group: ProcessGroup, join_timeout: int, cpu_devices: int | None) -> None:
    """Joins process 0's train_parallel as process ``group.process_id``, until it ends."""
    prepare_environment(cpu_devices)
    print(
        f"bardflow: process {group.process_id} of {group.num_processes}: joining the train_parallel run of "
        f"process 0 at {group.coordinator or 'the coordinator the cluster names'}",
        file=sys.stderr,
        flush=True,
    )
    from ..processes.launch import process_command
    from ..tasks import train_process

    code = subprocess.call(process_command(train_process, None, join_timeout))
    if code:
        raise FollowerError(
            f"process {group.process_id} of {group.num_processes} failed (exit status {code}); see its output above"
        )
