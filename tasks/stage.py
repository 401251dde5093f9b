"""The stage contract: what a stage is, and how its version is found or built.

A stage is one entry in ``tasks/registry.py`` and one ``build`` function in its module:

    def build(settings, out: Builder, **upstream: Version) -> None

``settings`` is the part of the run's configuration that decides the stage, ``out`` the
private folder its new version is written into, and each version it reads arrives as a
keyword argument named after its stage, already checked against its manifest. Nothing here
imports Prefect: the flow wraps ``produce`` in a task.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

from ..artifacts.manifest import version_key
from ..artifacts.store import Builder, Version, VersionStore
from ..config.settings import ConfigError, PipelineConfig, TrainingRequest
from ..errors import (
    FREE_SPACE_FIX,
    NOT_WRITABLE_FIX,
    BardflowError,
    DiskFullError,
    NotWritableError,
    is_disk_full,
    is_not_writable,
)
from ..model.training.memory import check_fits
from ..processes.distributed import ProcessGroup, free_bytes_per_device


def jsonable(settings: Any) -> Any:
    """Pydantic models become plain data; plain data passes through."""
    if hasattr(settings, "model_dump"):
        return settings.model_dump(mode="json")
    return settings


@dataclass(frozen=True)
class RunPlan:
    """What a run knows before its first stage: the configuration, the devices this
    process sees, and how many processes ``train_parallel`` runs as on this host."""

    config: PipelineConfig
    devices: int
    platform: str
    processes: int = 1

    def training(self, devices: int, processes: int = 1, stop_after: int | None = None) -> TrainingRequest:
        """The request, once its estimated memory per device is known to fit (``model/training/memory.py``)."""
        check_fits(
            self.config.model,
            self.config.train,
            devices,
            self.platform,
            self.config.data.seq_len,
            free_bytes_per_device(),
        )
        return TrainingRequest(
            model=self.config.model,
            train=self.config.train,
            devices=devices,
            platform=self.platform,
            processes=processes,
            stop_after=stop_after,
        )

    def single_device_training(self) -> TrainingRequest:
        """train_single: the first ``train.single_device_steps`` steps (all when 0) on one device."""
        return self.training(devices=1, stop_after=self.config.train.single_device_steps or None)

    def parallel_training(self) -> TrainingRequest:
        """Every device of this host, shared out among ``processes`` local processes, or,
        under a cluster scheduler, every device of every host."""
        group = ProcessGroup.from_env()
        if group is not None:
            if self.processes > 1:
                raise ConfigError(
                    f"processes={self.processes} starts processes on this host, but this is process "
                    f"{group.process_id} of {group.num_processes} of a cluster job already; leave processes at 1"
                )
            return self.training(self.devices * group.num_processes, group.num_processes)
        if self.processes < 1 or self.devices % self.processes:
            hint = " (on a CPU, emulate devices with --cpu-devices)" if self.platform == "cpu" else ""
            raise ConfigError(
                f"processes={self.processes} cannot share out the {self.devices} {self.platform} device(s) of "
                f"this host evenly; use a divisor of {self.devices}{hint}"
            )
        return self.training(self.devices, self.processes)


@dataclass(frozen=True)
class Stage:
    name: str
    code_version: str  # bump when the stage's output for the same inputs changes
    reads: tuple[str, ...]  # the stages whose versions it reads; they reach ``build`` by these names
    settings: Callable[[RunPlan], Any]  # the part of the run's configuration that decides it
    builds: tuple[str, ...]  # the files (or folders) of its version
    headline: tuple[str, ...]  # the metrics worth a glance in a summary row
    recipe: Callable[[Any], Any] = jsonable  # what of ``settings`` enters the version key
    # Its build: "module:function" of a module of this package (imported when the stage has
    # work, so reading the registry stays cheap), default "<name>:build"; or the function itself.
    function: str | Callable[..., None] = ""
    # The read versions whose fingerprints enter the key (default: all it reads). A stage
    # may read one only to save work: what it builds does not depend on it.
    keyed_by: tuple[str, ...] | None = None
    # "module:function" that checks a stored version the lookup found, against what this run
    # knows of its input (fetch: the local corpus's sha256), raising if it is not the one.
    accept: str = ""
    # Whether a run has the stage at all (tokenize: only where data.tokenizer is not bytes). A
    # stage that reads one a run lacks is built without it, and keyed as it was before it.
    wanted: Callable[[RunPlan], bool] = lambda run: True

    def key(self, settings: Any, upstream: Mapping[str, Version]) -> str:
        """The version key: the only place one is computed."""
        keyed = self.reads if self.keyed_by is None else self.keyed_by
        return version_key(
            self.name,
            self.code_version,
            self.recipe(settings),
            {name: version.fingerprint for name, version in upstream.items() if name in keyed},
        )

    @property
    def module(self) -> str:
        """The module of its build."""
        if callable(self.function):
            return self.function.__module__
        return f"{__package__}.{(self.function or self.name).partition(':')[0]}"

    def acceptance(self) -> Callable[[Any, Version], None] | None:
        """The check of a stored version found for this run (``accept``), if the stage has one."""
        if not self.accept:
            return None
        module, _, function = self.accept.partition(":")
        return getattr(importlib.import_module(f"{__package__}.{module}"), function)

    def build(self) -> Callable[..., None]:
        if callable(self.function):
            return self.function
        return getattr(importlib.import_module(self.module), self.function.partition(":")[2] or "build")


def produce(
    stage: Stage,
    settings: Any,
    upstream: Mapping[str, Version],
    store: VersionStore,
    force: bool = False,
    notice: Callable[[str], None] | None = None,
    around: Callable[[], AbstractContextManager] | None = None,
) -> tuple[Version, bool]:
    """``stage``'s version for these settings and upstream versions: the one in the store if
    it is there and intact (unless ``force``), else built now, inside ``around()`` when given
    (the flow holds the host's training slot there). Returns it and whether it was built.
    This answer is the one cache decision: the flow reports it to Prefect as the task's
    state, and the run summary reads that state."""
    checked = {name: store.require(version) for name, version in upstream.items()}

    def work(out: Builder) -> None:
        with around() if around is not None else nullcontext():
            stage.build()(settings, out, **checked)  # imported only when it has work to do
        out.record["code_version"] = stage.code_version  # for `bardflow runs --diff`
        missing = [name for name in stage.builds if not (out.dir / name).exists()]
        if missing:  # a broken contract, not bad input: a bug in the stage
            raise RuntimeError(f"stage {stage.name} did not write {', '.join(missing)}")

    try:
        version, built = store.produce(
            stage.name, stage.key(settings, checked), stage.recipe(settings), checked, work, force=force, notice=notice
        )
        accept = stage.acceptance()
        if not built and accept is not None:
            accept(settings, version)
        return version, built
    except BardflowError:
        raise
    except Exception as error:
        if is_disk_full(error):  # in a version's files, a checkpoint or the store's own records
            raise DiskFullError(
                f"the disk is full: {stage.name} could not write to the store {store.location} "
                f"({error.__class__.__name__}: {str(error)[:160]}); {FREE_SPACE_FIX}"
            ) from error
        if is_not_writable(error):  # the store's permissions changed under a running stage
            raise NotWritableError(
                f"cannot write to the store at {store.location}: {stage.name} was refused "
                f"({error.__class__.__name__}: {str(error)[:160]}); {NOT_WRITABLE_FIX}"
            ) from error
        raise
