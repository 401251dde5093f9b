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
from typing import Any

from prefect import flow
from prefect.logging import get_run_logger

from bardflow.artifacts import ui
from bardflow.artifacts.objects import checked_store
from bardflow.flows import notify
from bardflow.flows.pipeline import RUN_ARTIFACT, Preset, pipeline, quiet_explained_errors
from bardflow.flows.settings import pick_preset, store_location
from bardflow.model.config import ConfigError, PipelineConfig, build_config
from bardflow.runtime import stopping
from bardflow.tasks.compare import plot_validation_curves

SWEEP = "sweep"
DEPLOYMENT = "bardflow-pipeline/sweep"  # prefect.yaml's `sweep`: the pipeline, one configuration per run
POLL_S = 2.0


def _shown(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def comparison_rows(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per run: the settings that vary first, then the figures, then the versions."""
    keys = list(dict.fromkeys(key for run in runs for key in run["varying"]))
    rows = []
    for number, run in enumerate(runs, 1):
        row: dict[str, Any] = {"run": number}
        row.update({key: _shown(run["varying"].get(key, "(preset)")) for key in keys})
        stages = run.get("stages") or {}
        metrics = stages.get("train_parallel", {}).get("metrics", {})
        row.update({
            "status": run["status"],
            "val_loss": metrics.get("val_loss"), "val_bpb": metrics.get("val_bpb"),
            "tokens_per_s": metrics.get("tokens_per_s"), "training_s": metrics.get("elapsed_s"),
            "train_parallel": stages.get("train_parallel", {}).get("key"),
            "generate": stages.get("generate", {}).get("key"),
        })
        rows.append(row)
    return rows


def set_line(varying: dict[str, Any]) -> str:
    """A configuration as the ``--set`` options that give it, ready to paste."""
    import shlex

    return " ".join(f"--set {shlex.quote(f'{key}={_shown(value)}')}" for key, value in varying.items())


def best_run(rows: list[dict[str, Any]], runs: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The finished run with the lowest validation loss: its number, its loss and its ``--set`` line."""
    finished = [(row["val_loss"], row["run"]) for row in rows if row["status"] == "completed"
                and row["val_loss"] is not None]
    if not finished:
        return None
    val_loss, number = min(finished)
    line = set_line(runs[number - 1]["varying"])
    return {"run": number, "val_loss": val_loss, "set": line,
            "line": f"run {number}, validation loss {val_loss:.4f}: {line}"}


def _histories(runs: list[dict[str, Any]], root: str) -> list[tuple[str, list[dict[str, Any]]]]:
    """(label, train_parallel's history) of every run that finished."""
    store = checked_store(root)
    curves = []
    for number, run in enumerate(runs, 1):
        stage = (run.get("stages") or {}).get("train_parallel")
        version = stage and store.lookup("train_parallel", stage["key"])
        if version is None:
            continue
        label = f"{number}: " + ", ".join(f"{k.split('.')[-1]}={_shown(v)}" for k, v in run["varying"].items())
        curves.append((label, json.loads(version.file("history.json").read_text())))
    return curves


@flow(name="bardflow-sweep", log_prints=True, persist_result=False)
def sweep(
    configurations: list[dict[str, Any]],
    preset: Preset = "auto",
    settings: dict[str, Any] = {},  # noqa: B006 - Prefect needs a literal default for the form
    corpus: str | None = None,
    store: str | None = None,
    processes: int = 1,
    pool: str | None = None,
) -> dict[str, Any]:
    """One pipeline per configuration (its ``section.field`` settings over ``settings`` and the
    preset): in turn as child flow runs here, or, with ``pool``, all at once as runs of the
    ``bardflow-pipeline/sweep`` deployment on that work pool. A failed run fails its row, not the sweep."""
    quiet_explained_errors()
    chosen, root = pick_preset(preset), store_location(store)
    configs = [_in_one_experiment(build_config(chosen, {**settings, **varying})) for varying in configurations]
    total = len(configs)
    where = f" on work pool {pool}" if pool else ""
    with ui.Progress(SWEEP, total, f"sweep of {total} runs, preset {chosen}{where}") as progress:
        if pool:
            runs = _on_pool(pool, configurations, configs, chosen, corpus, root, processes, progress)
        else:
            runs = _here(configurations, configs, chosen, corpus, root, processes, progress)
    rows = comparison_rows(runs)
    best = best_run(rows, runs)
    publish(rows, _histories(runs, root), chosen, best)
    failed = sum(row["status"] != "completed" for row in rows)
    notify.emit(notify.SWEEP_FINISHED, {"summary": f"{len(rows)} runs, {failed} failed",
                                        "best": best["line"] if best else "none: every run failed"})
    from prefect.runtime import flow_run

    return {"preset": chosen, "store": root, "pool": pool, "flow_run": flow_run.id, "rows": rows, "runs": runs}


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


def _failed(number: int, total: int, run: dict[str, Any], why: str) -> None:
    run.update(status="failed", error=why)
    get_run_logger().warning("sweep run %d of %d failed: %s", number, total, why)


def _here(configurations, configs, preset, corpus, root, processes, progress) -> list[dict[str, Any]]:
    """Each configuration in turn, as a child flow run of this process."""
    total, runs = len(configs), []
    for number, (varying, config) in enumerate(zip(configurations, configs), 1):
        child = pipeline.with_options(flow_run_name=_child_name(number, total))
        state = child(preset=preset, config=config, corpus=corpus, store=root, processes=processes,
                      return_state=True)
        stopping.check(f"during sweep run {number} of {total}")  # a stopped child stops the sweep
        run = {"varying": varying, "status": "completed"}
        if state.is_completed():
            run.update(state.result())
        else:
            _failed(number, total, run, state.message or state.name)
        runs.append(run)
        progress(number)
        get_run_logger().info("sweep: %d of %d done", number, total)
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
            raise ConfigError(f"there is no deployment {DEPLOYMENT} on this server; from the repository folder run "
                              f"`prefect --no-prompt deploy --name sweep --pool {pool}`") from None
        if deployment.work_pool_name != pool:
            raise ConfigError(f"deployment {DEPLOYMENT} runs on work pool {deployment.work_pool_name!r}, not {pool!r}; "
                              f"pass --pool {deployment.work_pool_name} or deploy it on {pool}: "
                              f"`prefect --no-prompt deploy --name sweep --pool {pool}`")
        workers = client.read_workers_for_work_pool(pool)
    if not any(worker.status == "ONLINE" for worker in workers):
        get_run_logger().warning("no worker is polling work pool %s; the sweep's runs wait until one starts "
                                 "(`prefect worker start --pool %s`)", pool, pool)


def _on_pool(pool, configurations, configs, preset, corpus, root, processes, progress) -> list[dict[str, Any]]:
    """Every configuration submitted at once as a run of the ``sweep`` deployment, then
    waited for: the workers that poll ``pool`` take them as they free up."""
    from prefect.client.orchestration import get_client
    from prefect.deployments import run_deployment

    check_pool(pool)
    logger, total = get_run_logger(), len(configs)
    submitted = []
    for number, config in enumerate(configs, 1):
        child = run_deployment(DEPLOYMENT, timeout=0, flow_run_name=_child_name(number, total), parameters={
            "preset": preset, "config": config.model_dump(mode="json"), "corpus": corpus, "store": root,
            "processes": processes})
        submitted.append(child.id)
    logger.info("sweep: %d runs submitted to work pool %s", total, pool)
    runs = [{"varying": varying, "status": "running", "flow_run_id": str(run_id)}
            for varying, run_id in zip(configurations, submitted)]
    done = 0
    with get_client(sync_client=True) as client:
        while done < total:
            time.sleep(POLL_S)
            if stopping.requested() is not None:  # the runs on workers are cancelled with the sweep
                from prefect.states import Cancelling

                for run, run_id in zip(runs, submitted):
                    if run["status"] == "running":
                        client.set_flow_run_state(run_id, Cancelling(message="the sweep was stopped"), force=True)
                stopping.check(f"with {total - done} of {total} sweep runs unfinished (cancelled)")
            for number, (run, run_id) in enumerate(zip(runs, submitted), 1):
                if run["status"] != "running":
                    continue
                state = client.read_flow_run(run_id).state
                if state is None or not state.is_final():
                    continue
                if state.is_completed():
                    run.update(status="completed", **_child_summary(client, run_id, root))
                else:
                    _failed(number, total, run, state.message or state.name)
                done += 1
                progress(done)
                logger.info("sweep: %d of %d done (run %d: %s)", done, total, number, run["status"])
    return runs


def _child_summary(client, run_id, root: str) -> dict[str, Any]:
    """What a child run here returns, rebuilt from its ``bardflow-run`` artifact (stage,
    state, version key, seconds) and the shared store (each version's metrics)."""
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey, FlowRunFilter, FlowRunFilterId

    artifacts = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[ui.artifact_key(RUN_ARTIFACT)])),
                                      flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run_id])))
    rows = json.loads(artifacts[0].data) if artifacts else []
    store = checked_store(root)
    stages = {}
    for row in rows:
        version = store.lookup(row["stage"], row["key"])
        stages[row["stage"]] = {"state": row["state"], "key": row["key"], "seconds": row["seconds"],
                                "path": version.location if version else None,
                                "metrics": version.metrics if version else {}}
    return {"stages": stages, "flow_run": str(run_id)}


def publish(rows: list[dict[str, Any]], curves: list[tuple[str, list[dict[str, Any]]]], preset: str,
            best: dict[str, Any] | None = None) -> None:
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
    ui.markdown(SWEEP, text, description=f"sweep of {len(rows)} runs, preset {preset}"
                + (f", {failed} failed" if failed else ""))
