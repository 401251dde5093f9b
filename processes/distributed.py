"""One training run across several processes (hosts), on JAX's multi-controller runtime.

Every process runs the same program. ``jax.distributed.initialize`` joins them into
one runtime whose ``jax.devices()`` lists every device of every process, so the
``data`` mesh of ``Placement.data_parallel`` spans them all. Each process feeds
only the rows of a global batch that its own devices hold.

Who is who comes from ``BARDFLOW_COORDINATOR`` (host:port of process 0),
``BARDFLOW_NUM_PROCESSES`` and ``BARDFLOW_PROCESS_ID`` (or a Kubernetes Indexed Job's
``JOB_COMPLETION_INDEX``); without them, a SLURM job step (``srun``), an Open MPI launch
(``mpirun``) or a multi-host Cloud TPU slice is recognised from its own variables, and
JAX's cluster detection supplies the coordinator.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass

from ..errors import DistributedError

COORDINATOR, NUM_PROCESSES, PROCESS_ID = "BARDFLOW_COORDINATOR", "BARDFLOW_NUM_PROCESSES", "BARDFLOW_PROCESS_ID"
HEARTBEAT = "BARDFLOW_HEARTBEAT_TIMEOUT_S"
LOOPBACK = {"127.0.0.1", "localhost", "[::1]"}
SCHEDULERS = [("SLURM_NTASKS", "SLURM_PROCID"), ("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK")]


def heartbeat_timeout_s(env: Mapping[str, str] = os.environ) -> int:
    """A process that stops answering is declared dead after this long (default 30 s) and
    the others stop. Raise it where the network between hosts is slow to answer."""
    try:
        return int(env.get(HEARTBEAT) or 30)
    except ValueError as error:
        raise DistributedError(f"{HEARTBEAT} must be a whole number of seconds, got {env[HEARTBEAT]!r}") from error


@dataclass(frozen=True)
class ProcessGroup:
    num_processes: int
    process_id: int
    coordinator: str | None = None  # None: JAX's cluster detection finds it (SLURM)

    @property
    def leader(self) -> bool:
        return self.process_id == 0

    def env(self) -> dict[str, str]:
        return {
            COORDINATOR: self.coordinator or "",
            NUM_PROCESSES: str(self.num_processes),
            PROCESS_ID: str(self.process_id),
        }

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> ProcessGroup | None:
        """The group this process belongs to, or None for a run on its own."""
        if env.get(NUM_PROCESSES):
            # A Kubernetes Indexed Job gives each pod its index as JOB_COMPLETION_INDEX.
            index_text = env.get(PROCESS_ID, env.get("JOB_COMPLETION_INDEX", ""))
            try:
                count, index = int(env[NUM_PROCESSES]), int(index_text)
            except ValueError as error:
                raise DistributedError(
                    f"{NUM_PROCESSES} and {PROCESS_ID} must be integers (got {env.get(NUM_PROCESSES)!r}, "
                    f"{env.get(PROCESS_ID)!r}); set both, e.g. {NUM_PROCESSES}=2 {PROCESS_ID}=0"
                ) from error
            if not 0 <= index < count:
                raise DistributedError(f"{PROCESS_ID}={index} is outside 0..{count - 1}; number processes from 0")
            if count > 1 and not env.get(COORDINATOR):
                raise DistributedError(f"{COORDINATOR} is not set; give every process host:port of process 0")
            return cls(count, index, env.get(COORDINATOR) or None) if count > 1 else None
        # Schedulers whose own variables say who is who; JAX's cluster detection reads the
        # same ones (and finds the coordinator) when the process joins.
        for size, rank in SCHEDULERS:
            if int(env.get(size, "1") or 1) > 1 and rank in env:
                return cls(int(env[size]), int(env[rank]))
        hosts = [h for h in env.get("TPU_WORKER_HOSTNAMES", "").split(",") if h]
        if len(hosts) > 1 and "TPU_WORKER_ID" in env:  # a multi-host Cloud TPU slice
            return cls(len(hosts), int(env["TPU_WORKER_ID"]))
        return None


CPU_DEVICE_FLAG = "--xla_force_host_platform_device_count"


def requested_cpu_devices(flags: str) -> int | None:
    """The emulated CPU device count that ``XLA_FLAGS`` asks for (its last word on it, as XLA reads it)."""
    found = re.findall(rf"{CPU_DEVICE_FLAG}=(\d+)", flags)
    return int(found[-1]) if found else None


MAX_CPU_DEVICES = 512  # emulated ones; each is a thread pool and a copy of the parameters
PROBE_TIMEOUT_S = 120  # a first start of an accelerator's runtime takes seconds, not minutes
_probe: subprocess.Popen | None = None
_probed_answer: tuple[int, str] | None = None
_probed_free: int | None = None  # an accelerator's free bytes (device 0), as the probe saw them
# What the probe prints: the device count, the platform, and an accelerator's free bytes.
_PROBE = (
    "import jax; d = jax.devices(); s = (d[0].memory_stats() or {}) if d[0].platform != 'cpu' else {}; "
    "print(len(d), jax.default_backend(), s.get('bytes_limit', 0) - s.get('bytes_in_use', 0))"
)


def probe_devices() -> None:
    """Asks JAX for this host's devices in a process of its own, from now on (the environment,
    XLA_FLAGS included, is final): JAX loads there while Prefect loads here, and a run whose
    stages all come from the store never loads it here (a second of a cached run's four). A
    process of a group asks in-process, once joined (``hardware``)."""
    global _probe
    if _probe is None and "jax" not in sys.modules and ProcessGroup.from_env() is None:
        _probe = subprocess.Popen(
            [sys.executable, "-c", _PROBE],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )


def _probed() -> tuple[int, str] | None:
    global _probe, _probed_answer, _probed_free
    if "jax" in sys.modules:  # JAX is here already: its own answer is the one
        return None
    if _probe is not None:
        try:
            out, _ = _probe.communicate(timeout=PROBE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            _probe.kill()
            _probe.communicate()
            _probe = None
            raise DistributedError(
                f"JAX did not list this host's devices within {PROBE_TIMEOUT_S} s (XLA_FLAGS="
                f"{os.environ.get('XLA_FLAGS', '')!r}); check XLA_FLAGS and --cpu-devices, or the accelerator's driver"
            ) from None
        words = out.split()
        if _probe.returncode == 0 and len(words) == 3 and words[0].isdigit():
            _probed_answer, _probed_free = (int(words[0]), words[1]), int(words[2])
        _probe = None
    return _probed_answer


def free_bytes_per_device() -> int | None:
    """What one training device has free: an accelerator's own memory (what its allocator
    may still hand out), or on a CPU the host's available memory shared among the emulated
    devices; None where nothing says."""
    count, platform = hardware()
    if platform == "cpu":
        try:
            with open("/proc/meminfo") as meminfo:
                available = next(int(line.split()[1]) * 1024 for line in meminfo if line.startswith("MemAvailable:"))
        except (OSError, StopIteration):
            return None
        return available // max(1, count)
    if _probed() is not None:
        return _probed_free or None
    import jax

    stats = jax.devices()[0].memory_stats() or {}
    return (stats.get("bytes_limit", 0) - stats.get("bytes_in_use", 0)) or None


def hardware() -> tuple[int, str]:
    """How many devices this process trains on (every process's, once joined), and their platform."""
    found = _probed()
    if found is not None:
        count, platform, processes = *found, 1
    else:
        import jax

        count, platform, processes = len(jax.devices()), jax.default_backend(), jax.process_count()
    requested = requested_cpu_devices(os.environ.get("XLA_FLAGS", ""))
    if platform == "cpu" and processes == 1 and requested:
        # JAX reads XLA_FLAGS once, when it starts: a run called in a process whose JAX
        # already emulates more devices than its --cpu-devices asks for takes the first ones.
        count = min(count, requested)
    return count, platform


def initialize(group: ProcessGroup, timeout_s: int = 300) -> None:
    """Joins this process to the group; must run before anything else touches JAX."""
    import jax

    # CPU devices of different processes exchange gradients over TCP with gloo (GPUs use NCCL).
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    host = (group.coordinator or "").rpartition(":")[0]
    try:
        jax.distributed.initialize(
            coordinator_address=group.coordinator,
            num_processes=group.num_processes if group.coordinator else None,
            process_id=group.process_id if group.coordinator else None,
            initialization_timeout=timeout_s,
            heartbeat_timeout_seconds=heartbeat_timeout_s(),
            # Process 0's service listens on every interface unless told otherwise: when
            # the group lives on this machine, keep it on loopback.
            coordinator_bind_address=group.coordinator if host in LOOPBACK else None,
        )
    except Exception as error:
        raise DistributedError(
            f"process {group.process_id} of {group.num_processes} could not join the run at "
            f"{group.coordinator or 'the cluster-detected coordinator'} within {timeout_s} s: "
            f"{str(error).splitlines()[0]}; check that process 0 runs and that the address is reachable"
        ) from error
