"""A sweep: one pipeline per configuration, as child flow runs of one parent flow.

Every child asks the same store, so what configurations share (the corpus, its encoding,
a model trained with the same settings) is built once and comes back cached for the rest.
The parent ends with one comparison: a table whose first columns are the settings that
differ, and the validation-loss curves of every run overlaid (artifact ``bardflow-sweep``).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

from prefect import flow
from prefect.logging import get_run_logger

from artifacts import ui
from artifacts.objects import open_store
from flows.pipeline import Preset, pipeline, quiet_explained_errors
from flows.settings import pick_preset, store_location
from model.config import build_config
from tasks.compare import plot_validation_curves

SWEEP = "sweep"


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


def _histories(runs: list[dict[str, Any]], root: str) -> list[tuple[str, list[dict[str, Any]]]]:
    """(label, train_parallel's history) of every run that finished."""
    store = open_store(root)
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
) -> dict[str, Any]:
    """One pipeline per configuration (its ``section.field`` settings over ``settings`` and the
    preset), run in turn as child flow runs; a failed run fails its row, not the sweep."""
    quiet_explained_errors()
    logger = get_run_logger()
    chosen, root = pick_preset(preset), store_location(store)
    total = len(configurations)
    runs: list[dict[str, Any]] = []
    with ui.Progress(SWEEP, total, f"sweep of {total} runs, preset {chosen}") as progress:
        for number, varying in enumerate(configurations, 1):
            config = build_config(chosen, {**settings, **varying})
            child = pipeline.with_options(flow_run_name=f"sweep-run-{number}-of-{total}")
            state = child(preset=chosen, config=config, corpus=corpus, store=root, processes=processes,
                          return_state=True)
            run = {"varying": varying, "status": "completed"}
            if state.is_completed():
                run.update(state.result())
            else:
                run.update(status="failed", error=state.message or state.name)
                logger.warning("sweep run %d of %d failed: %s", number, total, run["error"])
            runs.append(run)
            progress(number)
            logger.info("sweep: %d of %d done", number, total)
    rows = comparison_rows(runs)
    publish(rows, _histories(runs, root), chosen)
    from prefect.runtime import flow_run

    return {"preset": chosen, "store": root, "flow_run": flow_run.id, "rows": rows, "runs": runs}


def publish(rows: list[dict[str, Any]], curves: list[tuple[str, list[dict[str, Any]]]], preset: str) -> None:
    """The sweep's artifact: the table and the overlaid curves (embedded: they render offline)."""
    header = list(rows[0])
    text = ui.markdown_table(header, [[row[key] if row[key] is not None else "—" for key in header] for row in rows])
    if curves:
        with tempfile.TemporaryDirectory() as tmp:
            png = Path(tmp) / "curves.png"
            plot_validation_curves(curves, png, "Validation loss of each sweep run")
            text += "\n" + ui.png_markdown("Validation loss against tokens and against seconds", png)
    failed = sum(row["status"] != "completed" for row in rows)
    ui.markdown(SWEEP, text, description=f"sweep of {len(rows)} runs, preset {preset}"
                + (f", {failed} failed" if failed else ""))
