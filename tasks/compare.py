"""Stage 5: compare single-device and data-parallel throughput; table and plots."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import cast

from typing_extensions import TypedDict

from ..artifacts.store import Builder, Version
from ..model.training.run_records import HistoryEntry, TrainingMetrics
from . import report
from .registry import COMPARE, HISTORY

TABLE, THROUGHPUT_PNG, CURVES_PNG = COMPARE.builds


OVERFIT_RISE = 0.05  # validation loss this far (relative) above its best, with training loss still falling


def overfitting(history: list[HistoryEntry]) -> str | None:
    """One line when the validation loss rose from its best while the training loss fell: the
    model learns its corpus by heart rather than the language in it."""
    evaluated = [(val_loss, h) for h in history if (val_loss := h["val_loss"]) is not None]
    if len(evaluated) < 2:
        return None
    (best_val, best), (last_val, last) = min(evaluated, key=lambda pair: pair[0]), evaluated[-1]
    if last_val <= best_val * (1 + OVERFIT_RISE) or last["loss"] >= best["loss"]:
        return None
    return (
        f"overfitting: validation loss rose from {best_val:.3f} (step {best['step']}) to "
        f"{last_val:.3f} while training loss fell to {last['loss']:.3f}; the model is learning this "
        "corpus by heart: give it more text, a smaller model (model.num_layers, model.d_model) or fewer steps "
        "(train.steps)"
    )


def timed_window(*histories: list[HistoryEntry]) -> tuple[int, int] | None:
    """The steps every run is timed on, as (a, b): steps a+1 to b, between the first record
    they share (after step 0, which warms up: caches, threads, first transfers) and the last.
    A record's ``seconds`` is the training clock once its step is done (evaluation left out)."""
    clocks = [{h["step"]: h for h in history if h.get("seconds") is not None} for history in histories]
    shared = sorted(set.intersection(*(set(clock) for clock in clocks)))
    if len(shared) < 2 or any(clock[shared[-1]]["seconds"] <= clock[shared[0]]["seconds"] for clock in clocks):
        return None
    return shared[0], shared[-1]


class Speed(TypedDict):
    tokens_per_s: float
    ms_per_step: float


class Comparison(TypedDict):
    """The compare stage's table (``comparison.json``) and the figures it shows."""

    header: list[str]
    rows: list[list[str | int]]
    window: tuple[int, int] | None  # the steps both runs were timed on, or None: each whole run
    tokens_per_s: list[float]  # single device, data-parallel
    speedup: float
    devices: int
    note: str


def _speed(history: list[HistoryEntry], window: tuple[int, int]) -> Speed:
    at = {h["step"]: h for h in history}
    (first, last), seconds = window, at[window[1]]["seconds"] - at[window[0]]["seconds"]
    return Speed(
        tokens_per_s=(at[last]["tokens"] - at[first]["tokens"]) / seconds, ms_per_step=1e3 * seconds / (last - first)
    )


def _mfu(metrics: TrainingMetrics, speed: Speed | TrainingMetrics) -> float | None:
    """The run's MFU over the timed steps (its manifest's count and peak), or None where the
    peak is unknown or the run was trained before the manifest had them."""
    peak, per_token = metrics.get("peak_tflops"), metrics.get("flops_per_token")
    if not peak or not per_token:
        return None
    return speed["tokens_per_s"] * per_token / (peak * 1e12 * metrics["devices"])


def bytes_per_token(metrics: TrainingMetrics) -> float:
    """The validation text's bytes per token, from the loss per token and bits per byte (1 for
    a byte model; 1 where either is missing)."""
    loss, bpb = metrics.get("val_loss"), metrics.get("val_bpb")
    if not loss or not bpb or not math.isfinite(loss) or not math.isfinite(bpb):
        return 1.0
    return loss / (bpb * math.log(2))


def _per_byte_rows(
    single: TrainingMetrics, parallel: TrainingMetrics, one: Speed | TrainingMetrics, many: Speed | TrainingMetrics
) -> list[list[str | int]]:
    """For a tokenizer's runs (a token of several bytes), what compares them with a byte run:
    the validation loss per token, bits per byte and bytes a second; nothing for a byte run."""
    per_token = [bytes_per_token(single), bytes_per_token(parallel)]
    if all(abs(value - 1) < 1e-3 for value in per_token):
        return []
    rates = [one["tokens_per_s"] * per_token[0], many["tokens_per_s"] * per_token[1]]
    return [
        ["Validation loss per token", f"{single['val_loss']:.4f}", f"{parallel['val_loss']:.4f}", ""],
        ["Validation bits per byte", f"{single['val_bpb']:.4f}", f"{parallel['val_bpb']:.4f}", ""],
        ["Bytes/s", f"{rates[0]:,.0f}", f"{rates[1]:,.0f}", f"{rates[1] / rates[0]:.2f}x"],
    ]


def comparison(
    single: TrainingMetrics,
    parallel: TrainingMetrics,
    single_history: list[HistoryEntry] | None = None,
    parallel_history: list[HistoryEntry] | None = None,
) -> Comparison:
    """The two training stages' throughput on the same steps (``timed_window``), or, where
    their records share no window, over each whole run (said in the note)."""
    devices = parallel["devices"]
    window = timed_window(single_history, parallel_history) if single_history and parallel_history else None
    one: Speed | TrainingMetrics
    many: Speed | TrainingMetrics
    if window is not None and single_history and parallel_history:
        one, many = _speed(single_history, window), _speed(parallel_history, window)
        timed = [f"{window[0] + 1} to {window[1]}"] * 2 + ["same"]
        how = (
            f"Both runs are timed on the same steps, {window[0] + 1} to {window[1]} (the first step, which warms "
            "up, left out; evaluation excluded)."
        )
    else:
        one, many = single, parallel
        timed = [
            f"all {single['steps']}",
            f"all {parallel['steps']}",
            "same" if single["steps"] == parallel["steps"] else "differs",
        ]
        how = "Each run is timed over all its steps: their records share no window of steps."
    speedup = many["tokens_per_s"] / one["tokens_per_s"]
    rows = [
        [
            "Global batch",
            single["global_batch"],
            parallel["global_batch"],
            f"{parallel['global_batch'] / single['global_batch']:.2f}x",
        ],
        ["Per-device batch", single["per_device_batch"], parallel["per_device_batch"], "same"],
        ["Timed steps", *timed],
        [
            "ms/step",
            f"{one['ms_per_step']:.2f}",
            f"{many['ms_per_step']:.2f}",
            f"{one['ms_per_step'] / many['ms_per_step']:.2f}x",
        ],
        ["Tokens/s", f"{one['tokens_per_s']:,.0f}", f"{many['tokens_per_s']:,.0f}", f"{speedup:.2f}x"],
    ]
    rows += _per_byte_rows(single, parallel, one, many)
    mfu = [_mfu(single, one), _mfu(parallel, many)]
    if mfu[0] is not None and mfu[1] is not None:  # where the devices' peak is known (a GPU, a TPU)
        rows.append(["MFU", f"{100 * mfu[0]:.1f} %", f"{100 * mfu[1]:.1f} %", f"{mfu[1] / mfu[0]:.2f}x"])
    note = (
        f"{how} The speedup is the data-parallel run's tokens/s over the single device's; with the same batch "
        f"on each device, {devices} devices ideally give {devices}x (emulated CPU devices share the same cores: "
        "about 1x)."
    )
    if speedup > 1.25 * devices:
        note += (
            f" The measured {speedup:.2f}x exceeds 1.25 x {devices} devices: on a benchmark this small, a "
            "measurement artifact (layout, kernel choice), not a scaling claim."
        )
    elif devices == 1:
        note = f"{how} Only one device was visible, so the data-parallel run used the same single device."
    return Comparison(
        header=["", "single device", f"data-parallel ({devices} device{'s' if devices > 1 else ''})", "Ratio"],
        rows=rows,
        window=window,
        tokens_per_s=[round(one["tokens_per_s"], 1), round(many["tokens_per_s"], 1)],
        speedup=round(speedup, 3),
        devices=devices,
        note=note,
    )


def throughput_figure(runs: list[tuple[str, list[HistoryEntry], float]]):
    """A bar a run; tick labels as 1.2M, at most five of them: millions written out overlapped."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import EngFormatter, MaxNLocator

    fig, ax = plt.subplots(figsize=(6, 3))
    labels = [label for label, _, _ in runs]
    values = [tps for _, _, tps in runs]
    bars = ax.barh(labels, values, color=["#0969da", "#1a7f37"])
    ax.bar_label(bars, labels=[f"{v:,.0f}" for v in values], padding=4)
    ax.xaxis.set_major_locator(MaxNLocator(5))
    ax.xaxis.set_major_formatter(EngFormatter(sep=""))
    ax.set_xlabel("tokens/s (higher is better)")
    ax.set_title("Training throughput")
    ax.set_xlim(0, max(values) * 1.25)
    fig.tight_layout()
    return fig


def plot(runs: list[tuple[str, list[HistoryEntry], float]], throughput_png: Path, curves_png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed, works on a headless worker
    import matplotlib.pyplot as plt

    fig = throughput_figure(runs)
    fig.savefig(throughput_png, dpi=100, metadata={"Software": None})
    plt.close(fig)

    fig, axes = plt.subplots(2, 2, figsize=(11, 7.2))
    panels = [  # (axes, x of a record, y of a record, x label, title)
        (axes[0, 0], lambda h: h["tokens"] / 1e6, lambda h: h["loss"], "Tokens processed (millions)", "Training loss"),
        (
            axes[0, 1],
            lambda h: h["tokens"] / 1e6,
            lambda h: h["perplexity"],
            "Tokens processed (millions)",
            "Training perplexity",
        ),
    ]
    _draw(panels, [(label, history) for label, history, _ in runs])
    _validation_panels(axes[1, 0], axes[1, 1], [(label, history) for label, history, _ in runs])
    axes[0, 1].set_yscale("log")  # from ~256 at initialisation down to single digits
    fig.suptitle("Training curves: one per training stage")
    fig.tight_layout()
    fig.savefig(curves_png, dpi=100, metadata={"Software": None})
    plt.close(fig)


def _draw(panels, runs: list[tuple[str, list[HistoryEntry]]]) -> None:
    for ax, x_of, y_of, xlabel, title in panels:
        for label, history in runs:
            points = [(x_of(h), y_of(h)) for h in history if x_of(h) is not None and y_of(h) is not None]
            if points:
                ax.plot(*zip(*points, strict=True), "o-", markersize=3, label=label)
        ax.set_xlabel(xlabel)
        ax.set_title(title)
        ax.grid(True, alpha=0.25)
        ax.legend(fontsize="small")


def _validation_panels(by_tokens, by_seconds, runs: list[tuple[str, list[HistoryEntry]]]) -> None:
    _draw(
        [
            (
                by_tokens,
                lambda h: h["tokens"] / 1e6,
                lambda h: h.get("val_loss"),
                "Tokens processed (millions)",
                "Validation loss (whole split) vs tokens",
            ),
            (
                by_seconds,
                lambda h: h.get("seconds"),
                lambda h: h.get("val_loss"),
                "Training seconds (evaluation excluded)",
                "Validation loss vs seconds",
            ),
        ],
        runs,
    )


def plot_validation_curves(runs: list[tuple[str, list[HistoryEntry]]], png: Path, title: str) -> None:
    """Validation loss of each (label, history) against tokens and against seconds, side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_tokens, by_seconds) = plt.subplots(1, 2, figsize=(11, 4))
    _validation_panels(by_tokens, by_seconds, runs)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(png, dpi=100, metadata={"Software": None})
    plt.close(fig)


def _history(version: Version) -> list[HistoryEntry]:
    return json.loads(version.file(HISTORY).read_text())


def build(settings: dict, out: Builder, train_single: Version, train_parallel: Version) -> None:
    single, parallel = train_single, train_parallel
    histories = _history(single), _history(parallel)
    # A training version's figures are the training run's (TrainingMetrics), as it wrote them.
    result = comparison(cast(TrainingMetrics, single.metrics), cast(TrainingMetrics, parallel.metrics), *histories)
    out.path(TABLE).write_text(json.dumps(result, indent=1))
    devices = result["devices"]
    plot(
        [
            ("single device", histories[0], result["tokens_per_s"][0]),
            (result["header"][2], histories[1], result["tokens_per_s"][1]),
        ],
        out.path(THROUGHPUT_PNG),
        out.path(CURVES_PNG),
    )
    out.metrics.update({"speedup": result["speedup"], "devices": devices})
    window = result["window"]
    emulated = parallel.metrics.get("platform") == "cpu" and devices > 1
    report.say(
        "compare: data-parallel on %d device(s) ran %.2fx the single device's tokens/s (%s); timed on %s",
        devices,
        result["speedup"],
        "emulated CPU devices share this machine's cores: about 1x is expected"
        if emulated
        else f"{devices} devices ideally give {devices}x",
        f"steps {window[0] + 1} to {window[1]} of both"
        if window
        else "each run's whole length (their logs share no steps to time both on)",
    )
