"""``bardflow runs``: the trained versions in a store and how they differ, read from their
manifests alone (no server, no JAX)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, TypedDict

from ..artifacts.manifest import Manifest
from ..artifacts.objects import is_remote, open_store
from ..artifacts.store import Version
from ..errors import BardflowError
from ..model.data.sources import corpus_name

TRAINED = ("train_single", "train_parallel")
FIGURES = ("val_loss", "val_bpb", "tokens_per_s", "ms_per_step", "elapsed_s")


class RunRow(TypedDict):
    """A trained version in ``bardflow runs``' list: the settings it differs in from the
    others listed (their names without ``settings.``/``data.``), and its figures."""

    stage: str
    key: str
    created: str | None
    differs: dict[str, object]
    val_loss: float | None
    val_bpb: float | None
    tokens_per_s: float | None
    ms_per_step: float | None
    elapsed_s: float | None


class Pair(TypedDict):
    a: object
    b: object


class FigurePair(TypedDict):
    a: object
    b: object
    b_minus_a: float | None


class RunDiff(TypedDict):
    """Two trained versions side by side (``bardflow runs A B``): what differs, and their figures."""

    a: str
    b: str
    differences: dict[str, Pair]
    figures: dict[str, FigurePair]


class RunsError(BardflowError, ValueError):
    """The store is not there, or a version asked for is not in it (or the prefix names several)."""


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """{"train": {"steps": 5}} -> {"train.steps": 5}; lists stay values."""
    if not isinstance(tree, dict):
        return {prefix: tree}
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        flat.update(flatten(value, f"{prefix}.{key}" if prefix else key))
    return flat


def corpus_of(version: Version, manifests: dict[tuple[str, str], Manifest]) -> str | None:
    """The corpus a version was made from, as a person tells corpora apart: its source's name,
    size and md5 (followed through the versions it read to the fetch version)."""
    seen, todo = set(), [(version.stage, version.key, version.manifest)]
    while todo:
        stage, _, manifest = todo.pop()
        if stage == "fetch":
            name = corpus_name(str(manifest.get("source", "?")))
            metrics = manifest.get("metrics", {})
            return f"{name} ({metrics.get('bytes', 0):,} bytes, md5 {str(metrics.get('md5', '?'))[:12]}…)"
        for entry in manifest.get("inputs", {}).values():
            found = manifests.get((entry["stage"], entry["key"]))
            if found is not None and (entry["stage"], entry["key"]) not in seen:
                seen.add((entry["stage"], entry["key"]))
                todo.append((entry["stage"], entry["key"], found))
    return None


def manifests_of(store) -> dict[tuple[str, str], Manifest]:
    """Every version's manifest in the store by (stage, key), read once."""
    return {(v.stage, v.key): v.manifest for v in store.versions()}


def describe(version: Version, manifests: dict[tuple[str, str], Manifest] | None = None) -> dict[str, Any]:
    """Everything a comparison looks at, flat: settings, code, data, libraries, hardware."""
    manifest = version.manifest
    encode = manifest.get("inputs", {}).get("encode", {})
    corpus = corpus_of(version, manifests or {})
    return {
        **{f"settings.{k}": v for k, v in flatten(manifest.get("params", {})).items()},
        "code_version": manifest.get("code_version", "(not recorded)"),
        **{f"bardflow.{k}": v for k, v in manifest.get("bardflow", {}).items()},
        # The corpus as a person knows it; its encoding's fingerprint only where it is not known.
        **({"data.corpus": corpus} if corpus else {"data.encode_fingerprint": encode.get("fingerprint")}),
        **{f"libraries.{k}": v for k, v in manifest.get("libraries", {}).items()},
        "hardware.devices": ", ".join(manifest.get("devices") or []),
        "hardware.host": manifest.get("host"),
    }


def differing(described: list[dict[str, Any]]) -> list[str]:
    """The keys whose values are not the same in every description."""
    keys = list(dict.fromkeys(key for d in described for key in d))
    return [key for key in keys if len({json.dumps(d.get(key), sort_keys=True) for d in described}) > 1]


def readable_store(root: str):
    """The store at ``root`` for reading: one that does not exist is an error, not an empty list."""
    if not is_remote(root) and not Path(root).is_dir():
        raise RunsError(
            f"there is no store at {root}; pass --store with the folder a run wrote (or set BARDFLOW_STORE)"
        )
    store = open_store(root)
    store.check()
    return store


def trained_versions(root: str) -> tuple[list[Version], dict[tuple[str, str], Manifest]]:
    """The trained versions, and every manifest of the store (to follow their inputs)."""
    store = readable_store(root)
    manifests = manifests_of(store)
    found = [v for stage in TRAINED for v in store.versions(stage)]
    return sorted(found, key=lambda v: v.manifest.get("created", ""), reverse=True), manifests  # newest first


def find(versions: list[Version], prefix: str) -> Version:
    matches = [v for v in versions if v.key.startswith(prefix)]
    if len(matches) != 1:
        known = ", ".join(f"{v.stage}/{v.key}" for v in versions[:6]) or "none"
        problem = "no trained version" if not matches else f"{len(matches)} trained versions"
        raise RunsError(f"{problem} with a key starting {prefix!r}; give more of the key (trained versions: {known})")
    return matches[0]


def listing(versions: list[Version], manifests: dict[tuple[str, str], Manifest]) -> list[RunRow]:
    described = [describe(v, manifests) for v in versions]
    varying = [key for key in differing(described) if key.startswith(("settings.", "data.corpus"))]
    return [
        RunRow(
            stage=v.stage,
            key=v.key,
            created=v.manifest.get("created"),
            differs={key.removeprefix("settings.").removeprefix("data."): d.get(key) for key in varying},
            val_loss=v.metrics.get("val_loss"),
            val_bpb=v.metrics.get("val_bpb"),
            tokens_per_s=v.metrics.get("tokens_per_s"),
            ms_per_step=v.metrics.get("ms_per_step"),
            elapsed_s=v.metrics.get("elapsed_s"),
        )
        for v, d in zip(versions, described, strict=True)
    ]


def diff(a: Version, b: Version, manifests: dict[tuple[str, str], Manifest]) -> RunDiff:
    da, db = describe(a, manifests), describe(b, manifests)
    figures: dict[str, FigurePair] = {}
    for name in FIGURES:
        x, y = a.metrics.get(name), b.metrics.get(name)
        change = y - x if isinstance(x, (int, float)) and isinstance(y, (int, float)) else None
        figures[name] = FigurePair(a=x, b=y, b_minus_a=change)
    return RunDiff(
        a=f"{a.stage}/{a.key}",
        b=f"{b.stage}/{b.key}",
        differences={key: Pair(a=da.get(key), b=db.get(key)) for key in differing([da, db])},
        figures=figures,
    )


KEY_SHOWN = 8  # enough to tell versions apart, and what `bardflow runs A B` takes
SHOWN_SETTINGS = 4  # a table's cell lists this many settings that differ, then how many more


def short_settings(differs: dict[str, object]) -> str:
    """A cell's settings, one to a line: each by its last name where that is unambiguous
    (``steps=500`` for train.steps), a corpus by its name alone, at most ``SHOWN_SETTINGS``."""
    last = [key.rsplit(".", 1)[-1] for key in differs]
    lines = []
    for key, value in differs.items():
        name = key.rsplit(".", 1)[-1] if last.count(key.rsplit(".", 1)[-1]) == 1 else key
        if key == "corpus" and isinstance(value, str):
            value = value.split(" (", 1)[0]  # its size and md5: bardflow runs A B, or --json
        lines.append(f"{name}={value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)}")
    more = len(lines) - SHOWN_SETTINGS
    return "\n".join(lines[:SHOWN_SETTINGS] + ([f"+{more} more"] if more > 0 else []))


def listing_table(rows: list[RunRow], title: str, width: int | None = None):
    """``listing``'s rows as a table that fits the terminal (or ``width``)."""
    from .tables import Column, fitted, short_time

    # The loss and speed first; what the versions differ in before the training time (which
    # the speed tells too), abbreviated; the date goes first (--json: all of it).
    columns = [
        Column("training", 6),
        Column("key", 5),
        Column("val loss", 5),
        Column("tokens/s", 4),
        Column("training s", 2),
        Column("differs in", 3, text=True),
        Column("created", 1),
    ]
    cells = [
        [
            row["stage"].removeprefix("train_"),
            row["key"][:KEY_SHOWN],
            "—" if row["val_loss"] is None else f"{row['val_loss']:.4f}",
            "—" if row["tokens_per_s"] is None else f"{row['tokens_per_s']:,.0f}",
            "—" if row["elapsed_s"] is None else f"{row['elapsed_s']:.1f}",
            short_settings(row["differs"]),
            short_time(row["created"]),
        ]
        for row in rows
    ]
    return fitted(f"{title} (keys: their first {KEY_SHOWN} characters)", columns, cells, width=width)


def show_runs(root: str, keys: list[str] | None, as_json: bool) -> None:
    versions, manifests = trained_versions(root)
    if keys:
        compared = diff(find(versions, keys[0]), find(versions, keys[1]), manifests)
        if as_json:
            print(json.dumps(compared, indent=1))
        else:
            _print_diff(compared)
        return
    rows = listing(versions, manifests)
    if as_json:
        print(json.dumps(rows, indent=1))
        return
    from rich.console import Console

    Console().print(listing_table(rows, f"trained versions in {root}, newest first"))


def _print_diff(compared: RunDiff) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{compared['a']} (A) against {compared['b']} (B)")
    for column in ("", "A", "B", "B − A"):
        table.add_column(column, overflow="fold")
    for key, pair in compared["differences"].items():
        table.add_row(key, json.dumps(pair["a"], ensure_ascii=False), json.dumps(pair["b"], ensure_ascii=False), "")
    for name, figure in compared["figures"].items():
        delta = figure["b_minus_a"]
        table.add_row(name, str(figure["a"]), str(figure["b"]), "" if delta is None else f"{delta:+.4g}")
    Console().print(table)
