"""What a command checks and loads before its run, so that every refusal comes before the
run's server starts and the seconds the server takes to start are not idle: the command
line calls these, not the training code behind them."""

from __future__ import annotations

from ..config.settings import PipelineConfig
from ..processes.distributed import ProcessGroup, hardware, probe_devices


def count_devices_meanwhile() -> None:
    """JAX's count of this host's devices, asked of a process of its own while Prefect loads
    here (``probe_devices``): for a run on a server that answers at once."""
    probe_devices()


def refuse_uneven_processes(config: PipelineConfig, processes: int) -> None:
    """Refuses ``processes`` that cannot share this host's devices out evenly: it needs JAX's
    count of them, so it is asked now rather than once the run has started."""
    if processes > 1:
        from ..tasks.stage import RunPlan

        RunPlan(config, *hardware(), processes).parallel_training()


def refuse_unreadable_corpus(config: PipelineConfig) -> None:
    """A local corpus that cannot be read as one (missing, a device, a FIFO, a link out of its
    folder) is refused now; reading /dev/zero or a FIFO would never end."""
    from ..model.data.sources import check_local

    check_local(config.data.corpus, config.data.glob)


def load_training() -> None:
    """JAX and the training stages' modules, loaded while the run's own server starts (training
    would load them later, on the run's clock). The other stages' modules are light once these
    are in; a cached stage never loads its own. A cluster's process joins its group before JAX
    starts, so it loads nothing here."""
    if ProcessGroup.from_env() is not None:
        return
    from ..tasks.registry import TRAIN_SINGLE

    hardware()
    TRAIN_SINGLE.build()


def memory_table(config: PipelineConfig) -> dict[str, dict]:
    """The memory estimate (``model/training/memory.py``) of ``config`` on a GPU and on a CPU,
    on one device and on eight, with and without remat."""
    from ..model.training.memory import estimate
    from ..model.training.step_settings import resolve

    table = {}
    for platform in ("gpu", "cpu"):
        step = resolve(config.model, config.train, config.data.seq_len, platform)
        for devices in (1, 8):
            for remat in (False, True):
                found = estimate(
                    config.model,
                    config.train,
                    devices,
                    config.data.seq_len,
                    step.rows_per_pass,
                    step.precision,
                    remat=remat,
                    attention=step.attention,
                    platform=platform,
                )
                name = f"{platform}, {devices} device{'s' if devices > 1 else ''}, {found.layout}" + (
                    ", remat" if remat else ""
                )
                table[name] = {**found.as_json(), "rows_per_pass": step.rows_per_pass, "precision": step.precision}
    return table
