"""What the flows hand each other and return, as typed records: a stage's row in a run's
summary, the run's summary, and one run of a sweep (a search's trial). ``to_json`` is the
form the command line prints with ``--json`` and a sweep keeps in its search's study."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, NotRequired, TypedDict

from ..artifacts.manifest import Metrics
from ..config.settings import Overrides


class Sample(TypedDict):
    """One of the generate stage's samples (``samples.json``)."""

    prompt: str
    temperature: float
    seed: int
    text: str


class BestRun(TypedDict):
    """A sweep's finished run of lowest validation loss, and its settings as a ``--set`` line."""

    run: int
    val_loss: float
    set: str
    line: str  # the three in a sentence


class SweepResult(TypedDict):
    """What a sweep (or a search) returns: a row per run (the settings that vary, the figures,
    the versions), each run's record, and the best."""

    preset: str
    store: str
    pool: str | None
    flow_run: str | None
    rows: list[dict[str, Any]]  # its columns: the settings the runs vary, then comparison_rows' own
    runs: list[dict[str, Any]]  # Trial.to_json()
    best: BestRun | None
    study: NotRequired[str]  # a search's Optuna study


@dataclass
class StageRow:
    """How a stage went in a run: ``ran``, ``cached`` or ``ran (unchanged)``, its version."""

    state: str
    key: str
    path: str = ""
    metrics: Metrics = field(default_factory=dict)
    seconds: float | None = None

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> StageRow:
        return cls(**{name: data[name] for name in cls.__dataclass_fields__ if name in data})


@dataclass
class RunSummary:
    """A pipeline run: its preset and store, its flow run, each stage's row in order, the
    samples it generated, what its figures warn of, and where it was tracked."""

    preset: str
    store: str
    flow_run: str
    stages: dict[str, StageRow]
    samples: list[Sample] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    tracking: list[str] | None = None

    def to_json(self) -> dict[str, Any]:
        found = asdict(self)
        if self.tracking is None:
            del found["tracking"]
        return found


@dataclass
class Trial:
    """One run of a sweep, or one trial of a search: the settings it varies, how it ended and
    the rows of its stages. ``number`` is its place in the sweep; a search's finished trials
    are numbered 1, 2, 3… (``trial``) beside Optuna's own number (``optuna_trial``)."""

    varying: Overrides
    status: str = "running"  # then completed or failed
    number: int | None = None
    flow_run: str | None = None
    error: str | None = None
    stages: dict[str, StageRow] = field(default_factory=dict)
    trial: int | None = None
    optuna_trial: int | None = None

    def failed(self, why: str) -> None:
        self.status, self.error = "failed", why

    def completed(self, stages: dict[str, StageRow], flow_run: str | None) -> None:
        self.status, self.stages, self.flow_run = "completed", stages, flow_run or self.flow_run

    def metric(self, stage: str, name: str) -> Any:
        row = self.stages.get(stage)
        return row.metrics.get(name) if row is not None else None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Trial:
        stages = {name: StageRow.from_json(row) for name, row in (data.get("stages") or {}).items()}
        return cls(**{**{name: data[name] for name in cls.__dataclass_fields__ if name in data}, "stages": stages})
