"""What the command line prints: the run's summary and samples, a sweep's table, the store's
versions. Every table fits the terminal (``tables.fitted``); ``--json`` prints the same data."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, TypedDict, TypeVar

from ..artifacts.manifest import Metrics
from ..config.line_width import fit
from ..tasks.registry import BY_NAME
from .tables import Column, fitted, short_time

if TYPE_CHECKING:
    from ..config.settings import PipelineConfig
    from ..flows.records import Sample, SweepResult


class VersionRow(TypedDict):
    """A version in ``bardflow artifacts``' list: its size, figures, the corpus it was made
    from (``runs.corpus_of``) and its folder."""

    stage: str
    key: str
    created: str | None
    bytes: int
    metrics: Metrics
    corpus: str | None
    path: str


SHORT_KEY = 12  # enough to tell versions apart; `bardflow runs --diff` takes prefixes


def headline(stage: str, metrics: Metrics) -> str:
    """The figures worth a glance in a summary row, one to a line; the manifest has them all
    (a checksum is shown by its first 12 digits, like a key)."""
    known = BY_NAME.get(stage)
    names = known.headline if known else list(metrics)[:4]
    return "\n".join(f"{name}={_glance(metrics[name])}" for name in names if name in metrics)


def _glance(value: Any) -> str:
    text = str(value)
    hexadecimal = len(text) >= 32 and all(c in "0123456789abcdef" for c in text)
    return text[:SHORT_KEY] + "…" if hexadecimal else text


def print_samples(samples: list[Sample], console=None) -> None:
    """Each sample: its settings, then its text with the prompt highlighted."""
    from rich.console import Console
    from rich.markup import escape

    console = console or Console()
    for sample in samples:
        prompt, text = sample["prompt"], sample["text"]
        rest = text[len(prompt) :] if text.startswith(prompt) else text
        console.print(f"\n[dim]sample, temperature {sample['temperature']}, seed {sample['seed']}:[/dim]")
        console.print(f"[bold yellow]{escape(prompt)}[/bold yellow]{escape(rest)}", highlight=False)


def print_summary(summary: dict[str, Any]) -> None:
    """The stages (readable at 80 columns: short keys, one figure a line) and the samples."""
    from rich.console import Console
    from rich.markup import escape

    columns = [Column("stage", 3), Column("state", 1), Column("version", 2), Column("key figures", 0, text=True)]
    rows = [
        [
            name,
            f"[{'green' if stage['state'].startswith('ran') else 'cyan'}]{stage['state']}",
            stage["key"][:SHORT_KEY],
            headline(name, stage["metrics"]),
        ]
        for name, stage in summary["stages"].items()
    ]
    console = Console()
    console.print(fitted(f"bardflow run: preset {summary['preset']}, store {summary['store']}", columns, rows))
    console.print(f"Versions live under {summary['store']}/<stage>/<key>/")
    console.print("Full keys: --json or `bardflow artifacts`")  # its own line: a wrap never splits the command
    if any(stage["state"] == "ran (unchanged)" for stage in summary["stages"].values()):
        console.print(
            "ran (unchanged): built again with the same output as the stored version, which is kept: "
            "its figures (timings too) are that version's, not this run's"
        )
    print_samples(summary.get("samples", []), console)
    for line in summary.get("warnings", []):
        console.print(f"\n[bold yellow]warning:[/bold yellow] {escape(line)}")
    if summary.get("tracking"):
        console.print()
    for line in summary.get("tracking", []):  # whole lines: paths and commands to copy
        console.print(line, soft_wrap=True, highlight=False, markup=False)
    if summary.get("ui"):
        console.print()
        later = "" if summary.get("ui_served") else " (its server was this run's own: `bardflow ui` serves it there)"
        link = f"This run in the Prefect UI: {summary['ui']}{later}"
        console.print(fit(link, sys.stdout), soft_wrap=True, highlight=False, markup=False)  # the link whole


def print_sweep(result: SweepResult) -> None:
    from rich.console import Console

    rows = result["rows"]
    where = f", work pool {result['pool']}" if result.get("pool") else ""
    # What tells the runs apart stays longest; versions and timings go first at a narrow width.
    ranks = {
        "run": 5,
        "status": 4,
        "val_loss": 4,
        "tokens_per_s": 2,
        "val_bpb": 1,
        "training_s": 1,
        "train_parallel": 0,
        "generate": 0,
    }
    # A setting in which the runs differ is what the table is about: it stays as long as the
    # run numbers; one that every run shares goes before the figures.
    differ = {name for name in rows[0] if name not in ranks and len({str(row[name]) for row in rows}) > 1}
    columns = [Column(name, ranks.get(name, 5 if name in differ else 1)) for name in rows[0]]
    cells = []
    for row in rows:
        shown = [
            _setting(v)
            if k in differ or (k not in ranks and isinstance(v, str))
            else f"{v:.4f}"
            if isinstance(v, float) and k.startswith("val")
            else f"{v:,.0f}"
            if isinstance(v, float) and k == "tokens_per_s"
            else f"{v:.1f}"
            if isinstance(v, float)
            else "—"
            if v is None
            else str(v)[:SHORT_KEY]
            if k in ("train_parallel", "generate")
            else str(v)
            for k, v in row.items()
        ]
        if row["status"] != "completed":
            shown[list(row).index("status")] = f"[red]{row['status']}"
        cells.append(shown)
    title = f"bardflow sweep: {len(rows)} runs, preset {result['preset']}{where}, store {result['store']}"
    console = Console()
    console.print(fitted(title, columns, cells))
    for number, run in enumerate(result["runs"], 1):
        if run.get("error"):
            print(f"run {run.get('trial') or number} failed: {run['error']}", file=sys.stderr)
    if "best" in result:  # last, whole and unwrapped: the line to paste into the next `bardflow run`
        best = result["best"]
        console.print(
            f"best: {best['line']}" if best else "best: none (every run failed)",
            soft_wrap=True,
            highlight=False,
            markup=False,
        )


def _setting(value: Any) -> str:
    """A setting's value at a glance: a float at 4 significant digits (the exact value is in the
    best run's --set line and --json)."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        return str(value)
    text = str(value)
    return f"{number:.4g}" if len(text) > 8 and any(c in text for c in ".eE") else text


def print_versions(title: str, rows: list[VersionRow], paths: bool = False) -> None:
    """``bardflow artifacts``: one row per version, newest first, each with the corpus it was
    made from; for one stage, then each version's folder, whole, to copy."""
    from rich.console import Console

    columns = [
        Column("stage", 4),
        Column("key", 3),
        Column("created", 1),
        Column("size", 0),
        Column("key figures", 2, text=True),
    ]
    cells = [
        [
            row["stage"],
            row["key"],
            short_time(row["created"]),
            f"{row['bytes'] / 1e6:.2f} MB",
            "\n".join(
                filter(
                    None,
                    [
                        headline(row["stage"], row["metrics"]),
                        row["corpus"] and f"corpus={row['corpus'].split(' (')[0]}",
                    ],
                )
            ),
        ]
        for row in rows
    ]  # the corpus by name here; its size and md5 in --json
    console = Console()
    console.print(fitted(title, columns, cells))
    for row in rows if paths else []:
        console.print(
            f"{row['key'][:SHORT_KEY]} {short_time(row['created'])}  {row['path']}",
            soft_wrap=True,
            highlight=False,
            markup=False,
        )


Shown = TypeVar("Shown", bound=Mapping[str, object])  # a command's result: a JSON object


def show(result: Shown, as_json: bool, table: Callable[[Shown], None]) -> None:
    """A command's result as JSON (``--json``), or as ``table`` prints it."""
    if as_json:
        print(json.dumps(result, indent=1))
    else:
        table(result)


def preset_row(cfg: PipelineConfig) -> dict[str, Any]:
    """A preset at a glance: the README's table's columns."""
    from ..model.network.parameters import parameters

    data, model, train = cfg.data, cfg.model, cfg.train
    return {
        "seq_len": data.seq_len,
        "layers": model.num_layers,
        "d_model": model.d_model,
        "heads": model.num_heads,
        "positions": model.positions,
        "steps": train.steps,
        "single-device steps": train.single_device_steps or train.steps,
        "batch per device": train.per_device_batch,
        "optimizer": train.optimizer,
        "sharding": train.sharding,
        "parameters": f"{sum(p.size for p in parameters(model).values()) / 1e6:.2f} M",
    }


def print_presets(configs: dict[str, PipelineConfig], memory: dict[str, dict] | None) -> None:
    """``bardflow presets``: a row per preset; with one named, its memory per device first."""
    from rich.console import Console

    console = Console()
    if memory is not None:
        columns = [
            Column("where, layout", 6),
            Column("total GiB", 5),
            Column("activations", 3),
            Column("state", 2),
            Column("gradients", 1),
            Column("gathered", 0),
            Column("rows a pass", 1),
            Column("precision", 2),
        ]
        cells = [
            [
                where,
                f"{m['total_gib']:.2f}",
                f"{m['activation_gib']:.2f}",
                f"{m['state_gib']:.2f}",
                f"{m['gradient_gib']:.2f}",
                f"{m['gathered_gib']:.2f}",
                str(m["rows_per_pass"]),
                str(m["precision"]),
            ]
            for where, m in memory.items()
        ]
        (name,) = configs
        console.print(fitted(f"{name}: memory per device (GiB), estimated", columns, cells))
    rows = {name: preset_row(cfg) for name, cfg in configs.items()}
    names = list(next(iter(rows.values())))
    ranks = {"steps": 3, "seq_len": 4, "layers": 4, "d_model": 4, "parameters": 5, "batch per device": 3}
    columns = [Column("preset", 9)] + [Column(n, ranks.get(n, 1)) for n in names]
    cells = [[name, *(str(v) for v in row.values())] for name, row in rows.items()]
    console.print(fitted("presets (config/presets/NAME.yaml)", columns, cells))
    shown = next(iter(configs)) if len(configs) == 1 else "NAME"
    console.print(f"--json: every field; --yaml {shown}: a config file to copy (bardflow presets --help)")
