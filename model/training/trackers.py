"""Experiment tracking: the records of a training run written as they happen, to MLflow
and to TensorBoard event files, by whichever process trains (process 0 only).

A tracker is a courtesy to the person watching: one that fails or stops answering costs
one warning line, then stays off for the rest of this process, and the training goes on.
No Prefect here; the pipeline run's MLflow run itself is made in ``flows/tracking.py``.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ...config.settings import TrackingTarget
from .run_records import HistoryEntry

if TYPE_CHECKING:
    from .hooks import Hook, StepInfo

Warn = Callable[[str], None]
SCALARS = ("loss", "val_loss", "val_bpb", "tokens_per_s")


def warn_on_stderr(message: str) -> None:
    print(f"bardflow: warning: {message}", file=sys.stderr, flush=True)


def scalars(history: list[HistoryEntry], previous: HistoryEntry | None = None) -> list[tuple[int, dict]]:
    """(step, {name: value}) of each record: its loss, validation loss, bits per byte, and the
    tokens per second trained since the record before it (``previous`` for the first one)."""
    out = []
    for entry in history:
        values = {"loss": entry["loss"], "val_loss": entry["val_loss"], "val_bpb": entry["val_bpb"]}
        if previous is not None:
            seconds = entry["seconds"] - previous["seconds"]
            if seconds > 0:
                values["tokens_per_s"] = (entry["tokens"] - previous["tokens"]) / seconds
        out.append((entry["step"], {k: float(v) for k, v in values.items() if v is not None and math.isfinite(v)}))
        previous = entry
    return out


class Backend:
    """One destination. ``call`` runs one of its operations, and on the first failure warns
    once and turns the destination off."""

    name = "tracker"

    def __init__(self, where: str, warn: Warn, name: str | None = None):
        self.where, self.warn, self.off = where, warn, False
        self.name = name or self.name

    def scalars(self, stage: str, records: Iterable[tuple[int, dict]]) -> None:
        """Writes ``records`` (step, {name: value}) of training stage ``stage``."""
        raise NotImplementedError

    def call(self, what: str, operation: Callable[[], Any]) -> Any:
        if self.off:
            return None
        try:
            return operation()
        except Exception as error:  # noqa: BLE001 - any failure of a tracker is the same news
            self.off = True
            detail = " ".join(str(error).split())[:200]
            self.warn(
                f"{self.name} at {self.where} failed while {what} ({error.__class__.__name__}: {detail}); "
                f"the run goes on without it"
            )
            return None


def quiet_mlflow() -> None:
    """MLflow's own chatter (database migrations, retries) stays out of the run's output;
    failures reach the user as one warning line. A server that stops answering is given
    up on within seconds, not retried for minutes."""
    for variable, value in (
        ("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1"),
        ("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "1"),
        ("MLFLOW_HTTP_REQUEST_TIMEOUT", "10"),
        ("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true"),
    ):  # stdout is the summary's
        os.environ.setdefault(variable, value)
    import mlflow  # noqa: F401 - first: importing it sets its loggers' levels

    for name in ("mlflow", "alembic", "urllib3"):
        logging.getLogger(name).setLevel(logging.ERROR)
    import warnings

    warnings.filterwarnings("ignore", module=r"mlflow(\.|$)")
    warnings.filterwarnings("ignore", message=r".*noload.*")


class MlflowRun(Backend):
    """The pipeline run's MLflow run, to which every process that trains adds records."""

    name = "MLflow"

    def __init__(self, uri: str, run_id: str, warn: Warn, client=None):
        super().__init__(uri, warn)
        self.run_id = run_id
        if client is None:
            quiet_mlflow()
            from mlflow.tracking import MlflowClient

            client = MlflowClient(uri)
        self.client = client

    @classmethod
    def create(cls, uri: str, experiment: str, name: str, tags: dict[str, str], warn: Warn) -> MlflowRun | None:
        """A new run in ``experiment`` (made if missing), or None and a warning if MLflow fails."""
        quiet_mlflow()
        from mlflow.tracking import MlflowClient

        client = MlflowClient(uri)

        def create() -> str:
            found = client.get_experiment_by_name(experiment)
            if found is None:
                try:
                    experiment_id = client.create_experiment(experiment, artifact_location=_artifacts_beside(uri))
                except Exception:  # another run made it meanwhile (a sweep's children on a pool)
                    found = client.get_experiment_by_name(experiment)
                    if found is None:
                        raise
                    experiment_id = found.experiment_id
            else:
                experiment_id = found.experiment_id
            return client.create_run(experiment_id, tags=tags, run_name=name).info.run_id

        run_id = Backend(uri, warn, cls.name).call(f"creating a run in experiment {experiment!r}", create)
        if run_id is None:
            return None
        run = cls(uri, run_id, warn, client)
        _backends[_mlflow_key(uri, run_id)] = run
        return run

    def params(self, values: dict[str, str]) -> None:
        from mlflow.entities import Param

        items = [Param(key, value[:6000]) for key, value in values.items()]
        for start in range(0, len(items), 100):  # MLflow's limit per batch
            self.call(
                "logging parameters",
                lambda part=items[start : start + 100]: self.client.log_batch(self.run_id, params=part),
            )

    def tags(self, values: dict[str, str]) -> None:
        from mlflow.entities import RunTag

        self.call(
            "setting tags",
            lambda: self.client.log_batch(self.run_id, tags=[RunTag(key, value) for key, value in values.items()]),
        )

    def artifact(self, path: Path, folder: str | None = None) -> None:
        log = self.client.log_artifacts if path.is_dir() else self.client.log_artifact
        self.call(f"uploading {path.name}", lambda: log(self.run_id, str(path), folder))

    def end(self, status: str) -> None:
        self.call("ending the run", lambda: self.client.set_terminated(self.run_id, status))

    def scalars(self, stage: str, records: Iterable[tuple[int, dict]]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [
            Metric(f"{stage}/{name}", value, now, step) for step, values in records for name, value in values.items()
        ]
        for start in range(0, len(metrics), 1000):  # MLflow's limit per batch
            self.call(
                "logging metrics",
                lambda part=metrics[start : start + 1000]: self.client.log_batch(self.run_id, metrics=part),
            )


class EventFiles(Backend):
    """TensorBoard event files of one training stage, written with TensorBoard's own writer."""

    name = "TensorBoard"

    def __init__(self, folder: str, warn: Warn):
        super().__init__(folder, warn)
        self.writer = None

    def scalars(self, stage: str, records: Iterable[tuple[int, dict]]) -> None:
        self.call("writing event files", lambda: self._write(records))

    def _write(self, records: Iterable[tuple[int, dict]]) -> None:
        # Generated protobuf modules, without type stubs: a checker cannot see their classes.
        from tensorboard.compat.proto.event_pb2 import Event  # pyright: ignore[reportAttributeAccessIssue]
        from tensorboard.compat.proto.summary_pb2 import Summary  # pyright: ignore[reportAttributeAccessIssue]

        if self.writer is None:
            from tensorboard.summary.writer.event_file_writer import EventFileWriter

            Path(self.where).mkdir(parents=True, exist_ok=True)
            self.writer = EventFileWriter(self.where)
        for step, values in records:
            summary = Summary(value=[Summary.Value(tag=name, simple_value=value) for name, value in values.items()])
            self.writer.add_event(Event(wall_time=time.time(), step=step, summary=summary))
        self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.call("closing event files", self.writer.close)


def _artifacts_beside(uri: str) -> str | None:
    """A local database keeps its experiments' artifacts in a folder beside it (MLflow's
    default is the working directory's ``mlartifacts``); a server decides for itself."""
    if uri.startswith("sqlite:///"):
        return (Path(uri.removeprefix("sqlite:///")).resolve().parent / "mlartifacts").as_uri()
    return None


# One backend per destination in a process, so that one which failed stays off for every
# stage this process runs, and a stage's event files are one writer's.
_backends: dict[tuple[str, str], Backend] = {}


def _mlflow_key(uri: str, run_id: str) -> tuple[str, str]:
    return "mlflow", f"{uri}#{run_id}"


def backends(target: TrackingTarget | None, warn: Warn = warn_on_stderr) -> list[Backend]:
    if target is None:
        return []
    wanted = []
    uri, run, folder = target.mlflow, target.mlflow_run, target.tensorboard
    if uri is not None and run is not None:
        wanted.append((_mlflow_key(uri, run), lambda: MlflowRun(uri, run, warn)))
    if folder is not None:
        wanted.append((("tensorboard", folder), lambda: EventFiles(folder, warn)))
    found = []
    for key, make in wanted:
        if key not in _backends:
            try:
                _backends[key] = make()
            except Exception as error:  # noqa: BLE001 - say it, and train without it
                warn(f"{key[0]} tracking is off for this run ({error.__class__.__name__}: {error})")
                continue
        found.append(_backends[key])
    return found


def write_history(target: TrackingTarget | None, history: list[HistoryEntry], warn: Warn = warn_on_stderr) -> None:
    """A whole recorded history at once (a stage that came from the store)."""
    if target is None:
        return
    records = scalars(history)
    for backend in backends(target, warn):
        backend.scalars(target.stage, records)


def turn_off(target: TrackingTarget | None, warning: str) -> None:
    """Off in this process too: another process that wrote for ``target`` found the
    destination that ``warning`` names failing."""
    for backend in backends(target):
        if warning.startswith(f"{backend.name} at "):
            backend.off = True


def close(target: TrackingTarget | None) -> None:
    for backend in backends(target):
        if isinstance(backend, EventFiles):
            backend.close()
            _backends.pop(("tensorboard", backend.where), None)


def history_hook(target: TrackingTarget, warn: Warn = warn_on_stderr) -> Hook:
    """After each new history record (every ``train.log_every`` steps, and the last), that
    record, to each destination of ``target``. A resumed run's earlier records come from
    its checkpoint and are written first, so the curves are whole."""
    from .hooks import Hook

    written: list[HistoryEntry] = []

    def write(info: StepInfo) -> None:
        new = info.record.history[len(written) :]
        records = scalars(new, written[-1] if written else None)
        written.extend(new)
        for backend in backends(target, warn):
            backend.scalars(target.stage, records)

    return Hook(write, lambda info: len(info.record.history) > len(written))
