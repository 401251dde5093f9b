"""A sweep's configurations, built in one place from what the command line gives: the
settings that vary between runs (``--grid``, ``--list``) or, for a search, the space Optuna
searches (``--set KEY=LOW..HIGH[:log]`` ranges and ``--grid`` choices). Every one is
validated with the preset and the sweep's common settings before any run starts."""

from __future__ import annotations

import hashlib
import itertools
import json
from dataclasses import dataclass
from typing import Literal, cast

from pydantic import JsonValue
from typing_extensions import TypedDict  # pydantic, which checks flow parameters, needs it before Python 3.12

from ..config.config_file import parse_assignment, parse_value
from ..config.settings import ConfigError, Overrides, PipelineConfig, build_config


class Range(TypedDict):
    """A searched setting's range, on a log scale or not."""

    type: Literal["int", "float"]
    low: int | float
    high: int | float
    log: bool


class Choice(TypedDict):
    """A searched setting's choices."""

    type: Literal["categorical"]
    choices: list[str | int | float | bool | None]


Dimension = Range | Choice


class SearchSpec(TypedDict):
    """A search as the sweep flow takes it: how many trials, how many at once, the space, the
    sampler's seed and the study's name (what defines the search)."""

    trials: int
    parallel: int
    space: dict[str, Dimension]
    seed: int
    study: str


MAX_SWEEP_RUNS = 32  # a larger sweep is refused unless asked for (--max-runs)


def grid_configurations(
    preset: str, base: Overrides, grid: list[str], listed: list[str], max_runs: int = MAX_SWEEP_RUNS
) -> list[Overrides]:
    """The settings that vary between a sweep's runs, one dict per run: every combination of
    the ``grid`` (``key=v1,v2,…``, each value JSON when it parses as JSON), then each ``listed``
    configuration (a JSON object of ``key: value``). Each is validated together with the
    preset and ``base`` (the sweep's ``--set``), so a bad one is refused before any work."""
    axes: dict[str, list[JsonValue]] = {}
    for text in grid:
        key, values = parse_assignment(text)
        raw = text.partition("=")[2]
        if not raw.strip():
            raise ConfigError(f"--grid {key}= lists no values; give them comma-separated, e.g. --grid {key}=1,2")
        if key in axes:
            raise ConfigError(f"--grid names {key} twice; give all its values in one --grid {key}=a,b,c")
        axes[key] = values if isinstance(values, list) else [parse_value(part) for part in raw.split(",")]
        if not axes[key]:
            raise ConfigError(f"--grid {key} lists no values; give at least one")
    combinations = itertools.product(*axes.values()) if axes else ()
    runs = [dict(zip(axes, combination, strict=True)) for combination in combinations]
    for text in listed:
        try:
            entry = json.loads(text)
        except json.JSONDecodeError as error:
            raise ConfigError(
                f"--list expects a JSON object of settings, e.g. '{{\"train.steps\": 100}}'; got {text!r} ({error.msg})"
            ) from error
        if not isinstance(entry, dict) or not entry:
            raise ConfigError(f"--list expects a non-empty JSON object of settings, got {text!r}")
        runs.append(entry)
    if not runs:
        raise ConfigError("a sweep needs at least one --grid key=v1,v2 or --list '{\"key\": value}'")
    if len(runs) > max_runs:
        raise ConfigError(
            f"the sweep has {len(runs)} runs, more than the maximum of {max_runs}; "
            f"narrow the grid, or raise the limit with --max-runs {len(runs)}"
        )
    seen: dict[str, int] = {}
    for number, varying in enumerate(runs, 1):
        try:
            config = run_configuration(preset, base, varying)
        except ConfigError as error:
            shown = ", ".join(f"{k}={json.dumps(v)}" for k, v in varying.items())
            raise ConfigError(f"sweep run {number} ({shown}): {error}") from error
        digest = config.model_dump_json()
        if digest in seen:
            raise ConfigError(f"sweep runs {seen[digest]} and {number} are the same configuration; drop one")
        seen[digest] = number
    return runs


def parse_range(key: str, raw: str) -> Range | None:
    """``LOW..HIGH`` or ``LOW..HIGH:log`` as a search dimension (int when both ends are
    integers), None when ``raw`` is no range."""
    text, _, scale = raw.partition(":")
    low_text, sep, high_text = text.partition("..")
    if not sep:
        return None
    if scale not in ("", "log"):
        raise ConfigError(f"--set {key}={raw}: a range ends in :log or nothing, e.g. {key}=1e-3..3e-2:log")
    try:
        low, high = json.loads(low_text), json.loads(high_text)
    except json.JSONDecodeError:
        raise ConfigError(
            f"--set {key}={raw}: a range is LOW..HIGH of two numbers, e.g. {key}=1e-3..3e-2:log"
        ) from None
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (low, high)) or not low < high:
        raise ConfigError(f"--set {key}={raw}: a range is LOW..HIGH with LOW < HIGH, e.g. {key}=1e-3..3e-2:log")
    if scale and low <= 0:
        raise ConfigError(f"--set {key}={raw}: a :log range needs LOW > 0")
    kind = "int" if isinstance(low, int) and isinstance(high, int) else "float"
    return Range(type=kind, low=low, high=high, log=bool(scale))


def search_space(preset: str, base: Overrides, ranges: dict[str, str], grid: list[str]) -> dict[str, Dimension]:
    """A search's dimensions: each ``--set KEY=LOW..HIGH[:log]`` a range, each ``--grid
    KEY=V1,V2`` a choice. Both ends of every range and every choice are validated with the
    preset and ``base``, so a bad one is refused before any work."""
    space: dict[str, Dimension] = {}
    for key, raw in ranges.items():
        dimension = parse_range(key, raw)
        if dimension is None:
            raise ConfigError(f"--set {key}={raw} is no range; a range is LOW..HIGH[:log], e.g. {key}=1e-3..3e-2:log")
        space[key] = dimension
    for text in grid:
        key, values = parse_assignment(text)
        raw = text.partition("=")[2]
        choices = values if isinstance(values, list) else [parse_value(part) for part in raw.split(",")]
        if key in space or len(choices) < 2:
            raise ConfigError(f"--grid {text}: a search choice names a setting once, with two values or more")
        space[key] = Choice(type="categorical", choices=cast("list[str | int | float | bool | None]", choices))
    if not space:
        raise ConfigError("--search needs a range to search, e.g. --set train.learning_rate=1e-3..3e-2:log")
    for key, spec in space.items():
        for value in spec["choices"] if spec["type"] == "categorical" else (spec["low"], spec["high"]):
            try:
                run_configuration(preset, base, {key: value})
            except ConfigError as error:
                raise ConfigError(f"search range {key} ({json.dumps(value)}): {error}") from error
    return space


def study_name(preset: str, base: Overrides, space: dict[str, Dimension], listed: list[Overrides], seed: int) -> str:
    """What defines a search, as a name: the same command, the same study."""
    digest = hashlib.sha256(json.dumps([preset, base, space, listed, seed], sort_keys=True).encode()).hexdigest()
    return f"search-{digest[:12]}"


def run_configuration(preset: str, base: Overrides, varying: Overrides) -> PipelineConfig:
    """One run's whole configuration: the settings it varies over the sweep's own, on the preset."""
    return build_config(preset, {**base, **varying})


def split_ranges(settings: list[str]) -> tuple[list[str], dict[str, str]]:
    """``--set`` items apart: plain settings, and a search's ranges (``KEY=LOW..HIGH[:log]``)."""
    plain, ranges = [], {}
    for text in settings:
        key, _, raw = text.partition("=")
        if parse_range(key.strip(), raw) is None:
            plain.append(text)
        else:
            ranges[key.strip()] = raw
    return plain, ranges


@dataclass(frozen=True)
class SweepPlan:
    """What a sweep runs: its configurations (each the settings over the common ones), and for
    a search, the search's spec (trials, parallel, space, seed, study), with the configurations
    tried first."""

    configurations: list[Overrides]
    search: SearchSpec | None = None


def plan(  # noqa: PLR0913 - the sweep command's options, one argument each
    preset: str,
    base: Overrides,
    grid: list[str],
    listed: list[str],
    ranges: dict[str, str],
    trials: int | None,
    parallel: int = 1,
    seed: int = 0,
    max_runs: int = MAX_SWEEP_RUNS,
) -> SweepPlan:
    """A grid or list sweep's configurations, or (``trials``) a search's space, each checked."""
    if trials is None:
        return SweepPlan(grid_configurations(preset, base, grid, listed, max_runs))
    space = search_space(preset, base, ranges, grid)
    configurations = [json.loads(text) for text in listed]
    if configurations:
        grid_configurations(preset, base, [], listed, max_runs)  # each checked
    return SweepPlan(
        configurations,
        SearchSpec(
            trials=trials,
            parallel=parallel,
            space=space,
            seed=seed,
            study=study_name(preset, base, space, configurations, seed),
        ),
    )
