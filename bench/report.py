"""What every benchmark shares: where results go, the machine a figure was measured on,
alternating timed rounds, and a report written as JSON with its summary as a table."""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
REPO = Path(__file__).resolve().parents[1]
SHARED_CORPUS = REPO.parent / "shared" / "data" / "tinyshakespeare.txt"


def machine() -> dict:
    import jax

    from bardflow.artifacts.manifest import library_versions
    from bardflow.model.training.cpu_tuning import cpu_signature

    signature = cpu_signature()  # the CPU model and the vector instructions that decide its speed
    return {
        "cpu": signature["cpu"],
        "cpu_flags": signature["flags"],
        "cores": os.cpu_count(),
        "backend": jax.default_backend(),
        "devices": [str(d) for d in jax.devices()],
        "python": platform.python_version(),
        "libraries": library_versions(),
        "date": time.strftime("%Y-%m-%d"),
    }


def alternating(runs, rounds: int) -> list[list[float]]:
    """Each run once per round, in turn: drift hits all of them alike. Every run is called
    once first and its figure dropped, so that no timed round includes a compilation (a
    program compiled at its first call, a sampler's new shapes)."""
    for run in runs:
        run()
    results = [[] for _ in runs]
    for _ in range(rounds):
        for run, values in zip(runs, results, strict=True):
            values.append(run())
    return results


def write_report(report: dict, flat: dict, folder: Path, name: str, show: bool = True) -> Path:
    """The report as JSON under ``folder`` (its ``flat`` summary in it); with ``show`` the summary as a table."""
    report["summary"] = flat
    folder.mkdir(parents=True, exist_ok=True)
    out = folder / f"{report['machine']['date']}-{report['machine']['backend']}-{name}.json"
    out.write_text(json.dumps(report, indent=1, default=str))
    width = max(map(len, flat), default=0)
    for key, value in flat.items() if show else ():
        # Rates with one decimal; ratios and loss differences with four significant digits.
        shown = (f"{value:,.1f}" if abs(value) >= 100 else f"{value:.4g}") if isinstance(value, float) else str(value)
        print(f"{key:<{width}}  {shown}")
    return out
