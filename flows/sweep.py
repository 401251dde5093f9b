"""A sweep: one pipeline per configuration, as child flow runs of one parent flow.

Every child asks the same store, so what configurations share (the corpus, its encoding,
a model trained with the same settings) is built once and comes back cached for the rest.
The parent ends with one comparison: a table whose first columns are the settings that
differ, and the validation-loss curves of every run overlaid (artifact ``bardflow-sweep``).

With a work pool (``pool``), each configuration is a run of the ``bardflow-pipeline/sweep``
deployment on that pool instead, all submitted at once, so N workers train N
configurations at the same time; the parent waits for them, and reads each child's
summary from its ``bardflow-run`` artifact and the store they share.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from prefect import flow
from prefect.logging import get_run_logger

from ..artifacts.objects import checked_store
from ..config.settings import ConfigError, Overrides, PipelineConfig
from ..model.training.run_records import HistoryEntry
from ..prefect_server import notify
from ..processes import stopping
from ..tasks.compare import plot_validation_curves
from . import ui
from .environment import label_flow_run, store_location
from .pipeline import RUN_ARTIFACT, Preset, opened, pipeline
from .records import BestRun, RunSummary, StageRow, SweepResult, Trial
from .run_config import pick_preset
from .sweep_configs import SearchSpec, run_configuration
from .terminal import quiet_explained_errors

if TYPE_CHECKING:
    from prefect.client.schemas.objects import FlowRun

SWEEP = "sweep"
DEPLOYMENT = "bardflow-pipeline/sweep"  # prefect.yaml's `sweep`: the pipeline, one configuration per run
POLL_S = 2.0


def _shown(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def comparison_rows(runs: list[Trial]) -> list[dict[str, Any]]:
    """One row per run: the settings that vary first, then the figures, then the versions."""
    keys = list(dict.fromkeys(key for run in runs for key in run.varying))
    rows = []
    for number, run in enumerate(runs, 1):
        row: dict[str, Any] = {"run": run.trial or number}
        row.update({key: _shown(run.varying.get(key, "(preset)")) for key in keys})
        trained, generated = run.stages.get("train_parallel"), run.stages.get("generate")
        metrics = trained.metrics if trained else {}
        row.update(
            {
                "status": run.status,
                "val_loss": metrics.get("val_loss"),
                "val_bpb": metrics.get("val_bpb"),
                "tokens_per_s": metrics.get("tokens_per_s"),
                "training_s": metrics.get("elapsed_s"),
                "train_parallel": trained.key if trained else None,
                "generate": generated.key if generated else None,
            }
        )
        rows.append(row)
    return rows


def set_line(varying: Overrides) -> str:
    """A configuration as the ``--set`` options that give it, ready to paste."""
    import shlex

    return " ".join(f"--set {shlex.quote(f'{key}={_shown(value)}')}" for key, value in varying.items())


def best_run(rows: list[dict[str, Any]], runs: list[Trial]) -> BestRun | None:
    """The finished run with the lowest validation loss: its number, its loss and its ``--set``
    line (``rows`` as ``comparison_rows`` made them from ``runs``, in the same order)."""
    finished = [
        (row["val_loss"], row["run"], run)
        for row, run in zip(rows, runs, strict=True)
        if row["status"] == "completed" and row["val_loss"] is not None
    ]
    if not finished:
        return None
    val_loss, number, run = min(finished, key=lambda entry: entry[:2])
    line = set_line(run.varying)
    return {
        "run": number,
        "val_loss": val_loss,
        "set": line,
        "line": f"run {number}, validation loss {val_loss:.4f}: {line}",
    }


def _histories(runs: list[Trial], root: str) -> list[tuple[str, list[HistoryEntry]]]:
    """(label, train_parallel's history) of every run that finished."""
    store = checked_store(root)
    curves = []
    for number, run in enumerate(runs, 1):
        stage = run.stages.get("train_parallel")
        version = stage and store.lookup("train_parallel", stage.key)
        if version is None:
            continue
        shown = ", ".join(f"{k.split('.')[-1]}={_shown(v)}" for k, v in run.varying.items())
        label = f"{run.trial or number}: {shown}"
        curves.append((label, json.loads(version.file("history.json").read_text())))
    return curves


@flow(name="bardflow-sweep", log_prints=True, persist_result=False)
def sweep(
    configurations: list[Overrides],
    preset: Preset = "auto",
    settings: Overrides = {},  # noqa: B006 - Prefect needs a literal default for the form
    corpus: str | None = None,
    store: str | None = None,
    processes: int = 1,
    pool: str | None = None,
    search: SearchSpec | None = None,
) -> SweepResult:
    """One pipeline per configuration (its ``section.field`` settings over ``settings`` and the
    preset): in turn as child flow runs here, or, with ``pool``, all at once as runs of the
    ``bardflow-pipeline/sweep`` deployment on that work pool. A failed run fails its row, not the sweep.

    With ``search`` (``trials``, ``parallel``, ``space``, ``seed``, ``study``: what ``bardflow
    sweep --search`` makes), Optuna proposes the configurations instead, ``parallel`` at a
    time on the pool, ``configurations`` tried first (flows/search.py)."""
    quiet_explained_errors()
    label_flow_run()
    chosen, root = pick_preset(preset), store_location(store)
    opened(root)
    where = f" on work pool {pool}" if pool else ""
    place = Place(chosen, settings, corpus, root, processes, pool)
    if search is not None:
        runs = _search(search, configurations, place, where)
    else:
        configs = [place.config(varying) for varying in configurations]
        with ui.Progress(SWEEP, len(configs), f"sweep of {len(configs)} runs, preset {chosen}{where}") as progress:
            runs = (_on_pool if pool else _here)(configurations, configs, place, progress)
    rows = comparison_rows(runs)
    best = best_run(rows, runs)
    if search is not None:  # ranked: the best first
        rows.sort(key=lambda row: (row["status"] != "completed", row["val_loss"] is None, row["val_loss"] or 0))
    publish(rows, _histories(runs, root), chosen, best, study=search["study"] if search else None)
    failed = sum(row["status"] != "completed" for row in rows)
    notify.emit(
        notify.SWEEP_FINISHED,
        {"summary": f"{len(rows)} runs, {failed} failed", "best": best["line"] if best else "none: every run failed"},
    )
    from prefect.runtime import flow_run

    result = SweepResult(
        preset=chosen,
        store=root,
        pool=pool,
        flow_run=flow_run.id,
        rows=rows,
        runs=[run.to_json() for run in runs],
        best=best,
    )
    if search:
        result["study"] = search["study"]
    return result


class Place:
    """Where and how a sweep's children run: their common settings, and here or on a pool."""

    def __init__(
        self, preset: str, settings: Overrides, corpus: str | None, root: str, processes: int, pool: str | None
    ):
        self.preset, self.settings, self.corpus, self.root, self.processes = preset, settings, corpus, root, processes
        self.pool = pool
        if pool:
            check_pool(pool)

    def config(self, varying: Overrides) -> PipelineConfig:
        return _in_one_experiment(run_configuration(self.preset, self.settings, varying))

    def run_here(self, number: int, total: int, varying: Overrides, config: PipelineConfig) -> Trial:
        """A child flow run of this process, to its end."""
        child = pipeline.with_options(flow_run_name=_child_name(number, total))
        state = child(
            preset=self.preset,
            config=config,
            corpus=self.corpus,
            store=self.root,
            processes=self.processes,
            return_state=True,
        )
        stopping.check(f"during sweep run {number} of {total}")  # a stopped child stops the sweep
        run = Trial(varying, number=number)
        if state.is_completed():
            summary: RunSummary = state.result()
            run.completed(summary.stages, summary.flow_run)
        else:
            _failed(number, total, run, str(state.message or state.name))
        return run

    def submit(self, number: int, total: int, varying: Overrides, config: PipelineConfig) -> Trial:
        """A run of the ``sweep`` deployment on the pool, started; it runs when a worker takes it."""
        from prefect.deployments import run_deployment

        child = run_deployment(
            DEPLOYMENT,
            timeout=0,
            flow_run_name=_child_name(number, total),
            parameters={
                "preset": self.preset,
                "config": config.model_dump(mode="json"),
                "corpus": self.corpus,
                "store": self.root,
                "processes": self.processes,
            },
        )
        return Trial(varying, number=number, flow_run=str(cast("FlowRun", child).id))  # the synchronous call's result

    def ended(self, client, run: Trial, total: int) -> bool:
        """Whether the submitted ``run`` has ended; if so, ``run`` now says how."""
        state = client.read_flow_run(run.flow_run).state
        if state is None or not state.is_final():
            return False
        if state.is_completed():
            run.completed(_child_stages(client, run.flow_run, self.root), run.flow_run)
        else:
            _failed(run.number or 0, total, run, state.message or state.name)
        return True

    def cancel_if_stopped(self, client, running: list[Trial], total: int) -> None:
        """A stopped sweep cancels its runs on the workers, then stops."""
        if stopping.requested() is None:
            return
        from prefect.states import Cancelling

        for run in running:
            client.set_flow_run_state(run.flow_run, Cancelling(message="the sweep was stopped"), force=True)
        stopping.check(f"with {len(running)} of {total} sweep runs unfinished (cancelled)")


def _in_one_experiment(config: PipelineConfig) -> PipelineConfig:
    """Every child tracked in MLflow is a run of one experiment named after the sweep, so
    that MLflow's compare view lines them up (unless the sweep names its own)."""
    if config.track.mlflow is None or config.track.experiment is not None:
        return config
    from prefect.runtime import flow_run

    experiment = f"sweep-{flow_run.name}"
    return config.model_copy(update={"track": config.track.model_copy(update={"experiment": experiment})})


def _child_name(number: int, total: int) -> str:
    return f"sweep-run-{number}-of-{total}"


def _failed(number: int, total: int, run: Trial, why: str) -> None:
    run.failed(why)
    get_run_logger().warning("sweep run %d of %d failed: %s", number, total, why)


def _here(configurations, configs, place: Place, progress) -> list[Trial]:
    """Each configuration in turn, as a child flow run of this process."""
    total, runs = len(configs), []
    for number, (varying, config) in enumerate(zip(configurations, configs, strict=True), 1):
        runs.append(place.run_here(number, total, varying, config))
        progress(number)
        get_run_logger().info("sweep: %d of %d done", number, total, extra=ui.TERMINAL)
    return runs


def check_pool(pool: str) -> None:
    """The deployment the children run as must exist on ``pool``: one line with the fix
    before anything is submitted. A pool without a worker only gets a warning (workers
    may start later; the runs wait for them)."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    with get_client(sync_client=True) as client:
        try:
            deployment = client.read_deployment_by_name(DEPLOYMENT)
        except ObjectNotFound:
            raise ConfigError(
                f"there is no deployment {DEPLOYMENT} on this server; from the repository folder run "
                f"`prefect --no-prompt deploy --name sweep --pool {pool}`"
            ) from None
        if deployment.work_pool_name != pool:
            raise ConfigError(
                f"deployment {DEPLOYMENT} runs on work pool {deployment.work_pool_name!r}, not {pool!r}; "
                f"pass --pool {deployment.work_pool_name} or deploy it on {pool}: "
                f"`prefect --no-prompt deploy --name sweep --pool {pool}`"
            )
        workers = client.read_workers_for_work_pool(pool)
    if not any(worker.status == "ONLINE" for worker in workers):
        get_run_logger().warning(
            "no worker is polling work pool %s; the sweep's runs wait until one starts "
            "(`prefect worker start --pool %s`)",
            pool,
            pool,
        )


def _on_pool(configurations, configs, place: Place, progress) -> list[Trial]:
    """Every configuration submitted at once as a run of the ``sweep`` deployment, then
    waited for: the workers that poll the pool take them as they free up."""
    from prefect.client.orchestration import get_client

    logger, total = get_run_logger(), len(configs)
    runs = [
        place.submit(number, total, varying, config)
        for number, (varying, config) in enumerate(zip(configurations, configs, strict=True), 1)
    ]
    logger.info("sweep: %d runs submitted to work pool %s", total, place.pool, extra=ui.TERMINAL)
    done = 0
    with get_client(sync_client=True) as client:
        while done < total:
            time.sleep(POLL_S)
            place.cancel_if_stopped(client, [run for run in runs if run.status == "running"], total)
            for run in runs:
                if run.status == "running" and place.ended(client, run, total):
                    done += 1
                    progress(done)
                    logger.info(
                        "sweep: %d of %d done (run %d: %s)", done, total, run.number, run.status, extra=ui.TERMINAL
                    )
    return runs


def _search(spec: SearchSpec, listed: list[Overrides], place: Place, where: str) -> list[Trial]:
    """Optuna's trials, ``spec["parallel"]`` at a time (on the pool; one at a time here), until
    the study has ``spec["trials"]`` finished ones; every finished trial of the study is a row."""
    from prefect.client.orchestration import get_client

    from .search import Search

    logger, total = get_run_logger(), spec["trials"]
    study = Search(spec, place.root, listed)
    if study.resumed:
        logger.info(
            "search %s: resuming with %d of %d trials finished", study.name, study.finished(), total, extra=ui.TERMINAL
        )
    else:
        logger.info("search %s: a new study of %d trials in %s", study.name, total, place.root, extra=ui.TERMINAL)

    def ask() -> tuple[int, Overrides, PipelineConfig | None]:
        number, params = study.ask()
        try:
            return number, params, place.config(params)
        except ConfigError as error:  # a proposal the settings refuse: a failed trial, not a failed search
            study.tell(number, Trial(params, "failed", error=str(error)))
            return number, params, None

    with ui.Progress(SWEEP, total, f"search of {total} trials, preset {place.preset}{where}") as progress:
        progress(min(study.finished(), total))
        if not place.pool:
            while study.finished() < total:
                number, params, config = ask()
                if config is not None:
                    study.tell(number, place.run_here(study.finished() + 1, total, params, config))
                progress(min(study.finished(), total))
            return study.runs()
        running: list[Trial] = []
        with get_client(sync_client=True) as client:
            while study.finished() + len(running) < total or running:
                while study.finished() + len(running) < total and len(running) < spec["parallel"]:
                    number, params, config = ask()
                    if config is not None:
                        shown = study.finished() + len(running) + 1  # the run's place in the table
                        submitted = place.submit(shown, total, params, config)
                        submitted.optuna_trial = number
                        running.append(submitted)
                time.sleep(POLL_S)
                place.cancel_if_stopped(client, running, total)
                for run in [run for run in running if place.ended(client, run, total)]:
                    running.remove(run)
                    assert run.optuna_trial is not None  # set when submitted
                    study.tell(run.optuna_trial, run)
                    progress(min(study.finished(), total))
                    logger.info("search: trial %d %s", run.number, run.status, extra=ui.TERMINAL)
    return study.runs()


def _child_stages(client, run_id, root: str) -> dict[str, StageRow]:
    """The stage rows of a child run on a worker, rebuilt from its ``bardflow-run`` artifact
    (stage, state, version key, seconds) and the shared store (each version's metrics)."""
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey, FlowRunFilter, FlowRunFilterId

    summary = ArtifactFilter(key=ArtifactFilterKey(any_=[ui.artifact_key(RUN_ARTIFACT)]))
    child = FlowRunFilter(id=FlowRunFilterId(any_=[run_id]))
    artifacts = client.read_artifacts(artifact_filter=summary, flow_run_filter=child)
    rows = json.loads(artifacts[0].data) if artifacts else []
    store = checked_store(root)
    stages = {}
    for row in rows:
        version = store.lookup(row["stage"], row["key"])
        stages[row["stage"]] = StageRow(
            row["state"],
            row["key"],
            version.location if version else "",
            version.metrics if version else {},
            row["seconds"],
        )
    return stages


def publish(
    rows: list[dict[str, Any]],
    curves: list[tuple[str, list[HistoryEntry]]],
    preset: str,
    best: BestRun | None = None,
    study: str | None = None,
) -> None:
    """The sweep's artifact: the table, the overlaid curves (embedded: they render offline)
    and the best run as a ready ``--set`` line."""
    header = list(rows[0])
    text = ui.markdown_table(header, [[row[key] if row[key] is not None else "—" for key in header] for row in rows])
    if curves:
        with tempfile.TemporaryDirectory() as tmp:
            png = Path(tmp) / "curves.png"
            plot_validation_curves(curves, png, "Validation loss of each sweep run")
            text += "\n" + ui.png_markdown("Validation loss against tokens and against seconds", png)
    if best is not None:
        text += f"\n\n**Best**: run {best['run']}, validation loss {best['val_loss']:.4f}: `{best['set']}`\n"
    failed = sum(row["status"] != "completed" for row in rows)
    what = f"search {study}: {len(rows)} trials" if study else f"sweep of {len(rows)} runs"
    ui.markdown(SWEEP, text, description=f"{what}, preset {preset}" + (f", {failed} failed" if failed else ""))
