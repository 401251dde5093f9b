"""A pipeline run as one MLflow run (and TensorBoard event files), made and finished by the
flow: its parameters are the whole configuration, its tags the stage versions, the store
and the Prefect flow run (with a link to it in the UI); the plots, samples and export are
its artifacts. A training stage adds its records as it trains (``model/training/trackers.py``);
one that came from the store adds its recorded history once, so even a fully cached run
shows whole curves.

``--track mlflow[=URI]`` and ``--track tensorboard[=DIR]`` say where (``track`` in a
config file or a deployment's parameters)."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

from ..artifacts.store import Version
from ..config.machine import install_hint
from ..config.settings import ConfigError, PipelineConfig, TrackConfig, TrackingTarget
from ..model.training import trackers as tracking

DEFAULT_EXPERIMENT = "bardflow"
TRAINING = ("train_single", "train_parallel")
# What each stage adds to the MLflow run's artifacts: (file of its version, artifact folder).
ARTIFACTS = {
    "compare": (("curves.png", None), ("throughput.png", None)),
    "export": (("export", "export"),),
    "generate": (("samples.json", None),),
}
EXTRAS = {"mlflow": ("mlflow", "mlflow"), "tensorboard": ("tensorboard", "tensorboard")}


def track_settings(texts: list[str]) -> dict[str, str]:
    """``mlflow``, ``mlflow=URI``, ``tensorboard`` or ``tensorboard=DIR`` as ``track.*``
    settings; without a location, MLflow's own default (``MLFLOW_TRACKING_URI``, else
    ``mlflow.db`` here) and ``./runs``."""
    settings = {}
    for text in texts:
        kind, _, where = text.partition("=")
        kind = kind.strip()
        if kind == "mlflow":
            where = where or os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{Path('mlflow.db').resolve()}"
        elif kind == "tensorboard":
            where = where if "://" in where else str(Path(where or "runs").resolve())  # a URL is refused later
        else:
            raise ConfigError(
                f"unknown tracker {kind!r} in --track {text}; use --track mlflow[=URI] or --track tensorboard[=DIR]"
            )
        settings[f"track.{kind}"] = where
    return settings


def check_installed(track: TrackConfig) -> None:
    for kind, (module, extra) in EXTRAS.items():
        if getattr(track, kind) is not None and importlib.util.find_spec(module) is None:
            raise ConfigError(
                f"tracking with {kind} needs the {module} package, which is not installed: {install_hint(extra)}"
            )


def _flat(config: PipelineConfig) -> dict[str, str]:
    """Every setting as ``section.field``: text as it is, anything else as JSON."""
    values = config.model_dump(mode="json", exclude={"track"})
    return {
        f"{section}.{field}": value if isinstance(value, str) else json.dumps(value)
        for section, fields in values.items()
        for field, value in fields.items()
    }


class RunTracking:
    """The trackers of one pipeline run, seen from the flow."""

    def __init__(self, track: TrackConfig, run_name: str, warn: tracking.Warn):
        self.track, self.run_name, self.warn = track, run_name, warn
        self.mlflow: tracking.MlflowRun | None = None

    @classmethod
    def start(cls, config: PipelineConfig, preset: str, store: str, warn: tracking.Warn) -> RunTracking | None:
        track = config.track
        if track.mlflow is None and track.tensorboard is None:
            return None
        check_installed(track)
        from prefect.runtime import flow_run
        from prefect.utilities.urls import url_for

        run = cls(track, flow_run.name or "bardflow-run", warn)
        if track.mlflow is not None:
            tags = {"bardflow.preset": preset, "bardflow.store": store, "prefect.flow_run_id": str(flow_run.id)}
            link = url_for("flow-run", obj_id=flow_run.id) if flow_run.id else None
            if link:
                tags["prefect.flow_run_url"] = link
                tags["mlflow.note.content"] = f"Prefect flow run: [{run.run_name}]({link})"
            run.mlflow = tracking.MlflowRun.create(
                track.mlflow, track.experiment or DEFAULT_EXPERIMENT, run.run_name, tags, warn
            )
            if run.mlflow is not None:
                run.mlflow.params(_flat(config))
        if track.tensorboard is not None:
            # Tried once for the run: a folder that cannot be written is one warning, not one
            # from each training stage (and each of its processes) that would write there.
            folder = Path(track.tensorboard) / run.run_name
            try:
                folder.mkdir(parents=True, exist_ok=True)
                probe = folder / f".bardflow-probe-{os.getpid()}"
                probe.write_bytes(b"")
                probe.unlink()
            except OSError as error:
                warn(
                    f"TensorBoard at {track.tensorboard} failed while making the run's folder "
                    f"({error.__class__.__name__}: {error.strerror or error}); the run goes on without it"
                )
                run.track = track.model_copy(update={"tensorboard": None})
        return run

    def target(self, stage: str) -> TrackingTarget | None:
        """Where ``stage`` writes as it trains; None once every tracker is off."""
        mlflow = self.mlflow if self.mlflow is not None and not self.mlflow.off else None
        folder = str(Path(self.track.tensorboard) / self.run_name / stage) if self.track.tensorboard else None
        if mlflow is None and folder is None:
            return None
        return TrackingTarget(
            stage=stage, mlflow=mlflow and mlflow.where, mlflow_run=mlflow and mlflow.run_id, tensorboard=folder
        )

    def stage_done(self, stage: str, state: str, version: Version) -> None:
        if self.mlflow is not None:
            self.mlflow.tags({f"bardflow.version.{stage}": version.key, f"bardflow.state.{stage}": state})
        if stage in TRAINING and (state == "cached" or "reused_from" in version.metrics):
            # Nothing trained here, so nothing was written as it trained: the record, once.
            target = self.target(stage)
            tracking.write_history(target, json.loads(version.file("history.json").read_text()), self.warn)
            tracking.close(target)
        for name, folder in ARTIFACTS.get(stage, ()):
            if self.mlflow is not None:
                self.mlflow.artifact(version.file(name), folder)

    def where(self) -> list[str]:
        """One line per tracker: what the run wrote where, and the command that shows it."""
        lines = []
        if self.mlflow is not None:
            uri = self.mlflow.where
            experiment = self.track.experiment or DEFAULT_EXPERIMENT
            shown = (
                f"mlflow ui --backend-store-uri {uri}" if not uri.startswith(("http://", "https://")) else f"open {uri}"
            )
            beside = ""
            if uri.startswith("sqlite:///"):
                beside = f", its files in {Path(uri.removeprefix('sqlite:///')).resolve().parent / 'mlartifacts'}"
            lines.append(
                f"MLflow: run {self.run_name} ({self.mlflow.run_id}) in experiment {experiment} at {uri}"
                f"{beside}; see it with `{shown}`"
            )
        if self.track.tensorboard is not None:
            lines.append(
                f"TensorBoard: event files in {Path(self.track.tensorboard) / self.run_name}; see them with "
                f"`tensorboard --logdir {self.track.tensorboard}`"
            )
        return lines

    def end(self, status: str) -> None:
        """FINISHED, FAILED or KILLED."""
        if self.mlflow is not None:
            self.mlflow.end(status)
