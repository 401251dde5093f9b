"""A sweep that searches: ``bardflow sweep --search N`` asks Optuna (ask/tell, a seeded TPE
sampler) for N configurations within ranges, one trial per pipeline run, the objective the
checkpointed model's validation loss (train_parallel's, on the whole split).

The study is a journal file kept with the store (``<store>/.searches/<study>.journal``; in
a bucket too, for a bucket store), named after what defines the search (preset, settings,
ranges, seed), so the same command run again resumes it: finished trials are kept, a trial
that was running when the search stopped is asked again (its stages come back cached if it
had got that far), and the sampler's seed moves on with the number of trials, so a resumed
study continues rather than repeats its first proposals. A diverging trial is a failed trial.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

from ..artifacts.objects import ObjectStore, checked_store
from ..config.machine import install_hint
from ..config.settings import Overrides
from ..errors import BardflowError
from .records import StageRow, Trial
from .sweep_configs import Dimension, SearchSpec

FOLDER = ".searches"


class SearchError(BardflowError, RuntimeError):
    """Optuna is missing, or the study cannot be read."""


def _distribution(spec: Dimension):
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    if spec["type"] == "categorical":
        return CategoricalDistribution(spec["choices"])
    if spec["type"] == "int":
        return IntDistribution(int(spec["low"]), int(spec["high"]), log=spec["log"])
    return FloatDistribution(spec["low"], spec["high"], log=spec["log"])


class Search:
    """One study: its journal on disk (and in the bucket), asked and told one trial at a time."""

    def __init__(self, spec: SearchSpec, root: str, listed: list[Overrides]):
        try:
            import optuna
        except ImportError:
            raise SearchError(f"--search needs Optuna: {install_hint('search')}") from None
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        from optuna.storages import JournalStorage
        from optuna.storages.journal import JournalFileBackend
        from optuna.trial import TrialState

        self.spec, self.name = spec, spec["study"]
        self._object = f"{FOLDER}/{self.name}.journal"  # its name in the store (and the bucket)
        self.store = checked_store(root)
        self.distributions: dict[str, Any] = {key: _distribution(value) for key, value in spec["space"].items()}
        remote = self.store if isinstance(self.store, ObjectStore) else None
        self.path = Path(remote.mirror.location if remote else root) / self._object
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if remote:  # the bucket's copy is the study; the mirror's, a working copy
            kept = remote.bucket.read(self._object)
            if kept is not None:
                self.path.write_bytes(kept)
            else:
                self.path.unlink(missing_ok=True)
        storage = JournalStorage(JournalFileBackend(str(self.path)))
        self.study = optuna.create_study(
            study_name=self.name, storage=storage, direction="minimize", load_if_exists=True
        )
        self.resumed = len(self.study.trials)
        self.asked: dict[int, Any] = {}
        for trial in self.study.trials:  # running when the search stopped: asked again, first
            if trial.state == TrialState.RUNNING:
                self.study.tell(trial.number, state=TrialState.FAIL)
                self.study.enqueue_trial(trial.params)
        if not self.resumed:
            for params in listed:  # --list: tried first, as given
                self.study.enqueue_trial(params)
        self.study.sampler = optuna.samplers.TPESampler(seed=spec["seed"] + len(self.study.trials))
        self.save()

    def finished(self) -> int:
        from optuna.trial import TrialState

        return sum(
            t.state in (TrialState.COMPLETE, TrialState.FAIL) and "run" in t.user_attrs for t in self.study.trials
        )

    def ask(self) -> tuple[int, Overrides]:
        with warnings.catch_warnings():  # a --list value outside a range is tried as given, on purpose
            warnings.filterwarnings("ignore", message="Fixed parameter .* is out of range")
            trial = self.study.ask(self.distributions)
        self.asked[trial.number] = trial
        self.save()
        return trial.number, dict(trial.params)

    def tell(self, number: int, run: Trial) -> None:
        """A finished trial: its validation loss, or a failure; its row kept with it."""
        from optuna.trial import TrialState

        kept = Trial(
            {},
            run.status,
            flow_run=run.flow_run,
            error=run.error,
            stages={
                name: StageRow(row.state, row.key, metrics=row.metrics)
                for name, row in run.stages.items()
                if name in ("train_parallel", "generate")
            },
        )
        self.asked.pop(number).set_user_attr("run", kept.to_json())
        value = run.metric("train_parallel", "val_loss")
        if run.status == "completed" and value is not None:
            self.study.tell(number, value)
        else:
            self.study.tell(number, state=TrialState.FAIL)
        self.save()

    def runs(self) -> list[Trial]:
        """Every finished trial as a sweep run, in trial order, numbered 1, 2, 3… (Optuna's own
        number, which counts the trials a stop interrupted and asked again, is kept beside it)."""
        finished = [t for t in self.study.trials if "run" in t.user_attrs]
        return [
            Trial.from_json(
                {**t.user_attrs["run"], "varying": dict(t.params), "trial": position, "optuna_trial": t.number}
            )
            for position, t in enumerate(finished, 1)
        ]

    def save(self) -> None:
        if isinstance(self.store, ObjectStore):
            self.store.bucket.write(self._object, self.path.read_bytes())
