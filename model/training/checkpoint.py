"""Orbax checkpoints that carry their own model config, so restoring needs nothing else."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import threading
import time
from collections.abc import Callable, Mapping
from functools import partial
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from ...config.settings import ModelConfig
from ...errors import BardflowError, require_space, require_writable
from ..network.transformer import Transformer, build_model


class CheckpointError(BardflowError, RuntimeError):
    """A checkpoint cannot be read; the message names it and how to rebuild it."""


def save_model(path: Path, model: Transformer, cfg: ModelConfig) -> None:
    """Saves the parameters (not the optimizer) and the config at ``path``, which must not exist."""
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    require_space(Path(path).parent, _nbytes(params), "the checkpoint")
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as checkpointer:
        checkpointer.save(
            Path(path).absolute(),
            args=ocp.args.Composite(
                params=ocp.args.StandardSave(params),
                config=ocp.args.JsonSave(cfg.model_dump()),
            ),
        )


def load_config(path: Path) -> ModelConfig:
    try:
        with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as checkpointer:
            restored = checkpointer.restore(
                Path(path).absolute(), args=ocp.args.Composite(config=ocp.args.JsonRestore())
            )
    except (OSError, ValueError, KeyError) as error:
        raise CheckpointError(f"cannot read the model config of checkpoint {path}: {error}") from error
    return ModelConfig.model_validate(restored["config"])


def load_model(path: Path, init_seed: int | None = None) -> Transformer:
    """A model built from the checkpoint's own config holding the saved parameters. With
    ``init_seed`` it is first initialised from that seed, then overwritten (what the verify
    stage checks); without, only its shapes are made (initialising op by op only to
    overwrite every value takes a good part of a second)."""
    cfg = load_config(path)
    model = build_model(cfg, init_seed) if init_seed is not None else nnx.eval_shape(lambda: build_model(cfg, 0))
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
        nnx.to_pure_dict(nnx.state(model, nnx.Param)),
    )
    try:
        with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as checkpointer:
            restored = checkpointer.restore(
                Path(path).absolute(),
                args=ocp.args.Composite(params=ocp.args.StandardRestore(abstract)),
            )
    except Exception as error:  # Orbax raises many types for damaged files
        raise CheckpointError(f"cannot restore checkpoint {path}: {error}") from error
    params = nnx.state(model, nnx.Param)
    nnx.replace_by_pure_dict(params, restored["params"])
    nnx.update(model, params)
    return model


def _abstract(x) -> jax.ShapeDtypeStruct:
    """What to restore ``x`` as: its shape, dtype and sharding (a placed array's, else the
    first device), whatever devices and layout the checkpoint was written from: Orbax reads
    each device's part of the saved arrays straight onto it."""
    sharding = getattr(x, "sharding", None) or jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)


def _leader_only():
    """Orbax options under which process 0 alone reads and writes the whole state (gathered
    to it first when split over the processes' devices, ``_host_copy``): checkpoints need no
    filesystem shared by the processes (each may have its own working folder), and the
    others get a restored state by broadcast, each keeping its own part."""
    return ocp.options.MultiprocessingOptions(
        primary_host=0, active_processes={0}, barrier_sync_key_prefix="bardflow-leader"
    )


def _split_over_processes(tree) -> bool:
    return not all(leaf.is_fully_replicated or leaf.is_fully_addressable for leaf in jax.tree.leaves(tree))


def _host_copy(tree):
    """A multi-process state in host memory, for process 0 to write: a replicated state is
    whole in every process; one split over the processes' devices (FSDP) is gathered, and
    every process must take part."""
    if not _split_over_processes(tree):
        return jax.device_get(tree)
    from jax.experimental import multihost_utils

    return multihost_utils.process_allgather(tree, tiled=True)


def _nbytes(tree) -> int:
    return sum(int(np.prod(leaf.shape)) * leaf.dtype.itemsize for leaf in jax.tree.leaves(tree))


def save_train_state(path: Path, state: nnx.State) -> None:
    """The whole training state (model and optimizer) as one Orbax pytree, each array written
    from where it lies (split over devices or not); in a multi-process run, written by
    process 0 (the others only wait for it)."""
    pure = nnx.to_pure_dict(state)
    if jax.process_index() == 0:
        require_space(Path(path).parent, _nbytes(pure), "the trained state")
    if jax.process_count() == 1:
        with ocp.StandardCheckpointer() as checkpointer:
            checkpointer.save(Path(path).absolute(), pure)
        return
    from jax.experimental import multihost_utils

    host = _host_copy(pure)

    if jax.process_index() == 0:
        with ocp.StandardCheckpointer(multiprocessing_options=_leader_only()) as checkpointer:
            checkpointer.save(Path(path).absolute(), host)
    multihost_utils.sync_global_devices("bardflow-state-saved")


def load_train_state(path: Path, template: nnx.State) -> nnx.State:
    """Restores onto ``template`` (a state of the right structure, e.g. from ``init_state``)."""
    abstract = jax.tree.map(_abstract, nnx.to_pure_dict(template))
    try:
        with ocp.StandardCheckpointer() as checkpointer:
            restored = checkpointer.restore(Path(path).absolute(), abstract)
    except Exception as error:  # Orbax raises many types for damaged files
        raise CheckpointError(f"cannot restore training state {path}: {error}") from error
    nnx.replace_by_pure_dict(template, jax.tree.map(jax.numpy.asarray, restored))
    return template


def params_digest(model: Transformer) -> str:
    """A hash of every parameter's bytes: equal iff the parameters are bitwise equal (in a
    multi-process run every process calls it: a split state is gathered first)."""
    digest = hashlib.sha256()
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    if jax.process_count() > 1:
        params = _host_copy(params)
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        digest.update(jax.tree_util.keystr(path).encode())
        digest.update(np.asarray(leaf).tobytes())
    return digest.hexdigest()


def max_logit_diff(a: Transformer, b: Transformer, probe: np.ndarray) -> float:
    """Largest absolute difference between two models' logits on ``probe`` tokens."""
    tokens = jax.numpy.asarray(probe, dtype=jax.numpy.int32)
    (graph_a, state_a), (graph_b, state_b) = nnx.split(a), nnx.split(b)
    return float(jax.numpy.max(jax.numpy.abs(_logits(graph_a, state_a, tokens) - _logits(graph_b, state_b, tokens))))


@partial(jax.jit, static_argnums=0)
def _logits(graphdef, state, tokens):
    """One compiled forward pass (run op by op, a small model's took seconds to dispatch)."""
    return nnx.merge(graphdef, state)(tokens)[0]


SEAL = "bardflow-files.json"  # in a step's folder: the size and sha256 of each of its other files


def _files_of(step_dir: Path) -> dict[str, list]:
    """Each file of a checkpoint's folder but its seal, by relative name: [bytes, sha256]."""
    found = {}
    for file in sorted(p for p in step_dir.rglob("*") if p.is_file() and p.name != SEAL):
        with open(file, "rb") as handle:
            found[file.relative_to(step_dir).as_posix()] = [
                file.stat().st_size,
                hashlib.file_digest(handle, "sha256").hexdigest(),
            ]
    return found


def seal_checkpoint(step_dir: Path) -> None:
    """Writes the seal of a complete checkpoint (written whole, then renamed into place)."""
    partial = step_dir / f".{SEAL}.partial"
    partial.write_text(json.dumps(_files_of(step_dir)))
    os.replace(partial, step_dir / SEAL)


def checkpoint_damage(step_dir: Path) -> list[str] | None:
    """The files of a sealed checkpoint that are missing, added or changed since it was
    written; None for one without a seal (written before seals were, or by a process that
    died within the moment between the checkpoint and its seal)."""
    try:
        sealed = json.loads((step_dir / SEAL).read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return [SEAL]
    found = _files_of(step_dir)
    return sorted(name for name in set(sealed) | set(found) if sealed.get(name) != found.get(name))


class TrainingCheckpoints:
    """Periodic, resumable training checkpoints: the whole state plus the loop's own
    record (step, data position, loss history, time spent), the last ``keep`` of them.

    Each is sealed once complete (``SEAL``: its files' sizes and sha256). A checkpoint that
    no longer matches its seal, or that Orbax cannot read, is damaged: it is set aside
    (renamed ``damaged-<step>``), said through ``note``, and the run resumes from the newest
    intact one, or from the start.

    Saves are asynchronous: ``save`` returns once the arrays are copied off the
    devices, and Orbax writes into a temporary folder that it renames only when
    complete, so ``latest`` never sees half a checkpoint, whenever the process dies.
    ``saved``, if given, is called once each checkpoint is complete on disk (the save
    then waits for it): an object store copies it to its bucket there.

    In a multi-process run only process 0 reads and writes checkpoints (see
    ``_leader_only``); ``latest`` broadcasts what it restored to the other processes.
    """

    def __init__(
        self,
        directory: Path,
        keep: int,
        saved: Callable[[], None] | None = None,
        note: Callable[[str], None] = lambda message: None,
    ):
        self.directory, self.saved, self.manager = Path(directory).absolute(), saved, None
        self.keep, self.note = keep, note
        self._committing: list[int] = []  # steps saved whose seal is not written yet
        self._sealers: list[threading.Thread] = []
        if jax.process_index() == 0:
            self.directory.mkdir(parents=True, exist_ok=True)
            for unfinished in self.directory.glob("*.orbax-checkpoint-tmp*"):  # a writer killed mid-save
                shutil.rmtree(unfinished, ignore_errors=True)
            for step in reversed(self.steps(self.directory)):  # the newest that is intact stops the search
                damage = checkpoint_damage(self.directory / str(step))
                if not damage:
                    break
                self.set_aside(step, f"{', '.join(damage[:3])} changed since it was written")
            self.manager = self._manager()

    def _manager(self) -> ocp.CheckpointManager:
        multi = jax.process_count() > 1
        return ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(
                preservation_policy=ocp.checkpoint_managers.LatestN(self.keep),
                enable_async_checkpointing=True,
                create=not multi,
                async_options=ocp.options.AsyncOptions(post_finalization_callback=self._finalized),
                multiprocessing_options=_leader_only() if multi else ocp.options.MultiprocessingOptions(),
            ),
        )

    def set_aside(self, step: int, why: str) -> None:
        """Moves a damaged checkpoint out of the way (kept, for a look), and says so."""
        source = self.directory / str(step)
        target = self.directory / f"damaged-{step}"
        suffix = 1
        while target.exists():
            suffix += 1
            target = self.directory / f"damaged-{step}.{suffix}"
        os.rename(source, target)
        older = [s for s in self.steps(self.directory) if s < step]
        self.note(
            f"the training checkpoint of step {step} in {self.directory} is damaged ({why}); set aside as "
            f"{target.name}, resuming from " + (f"step {older[-1]}" if older else "the start")
        )

    def _finalized(self) -> None:
        """Orbax's word (on its writing thread) that the oldest pending save is complete and is
        about to be renamed into place: its seal is written once it is there."""
        step = self._committing.pop(0)
        sealer = threading.Thread(target=self._seal_when_there, args=(step,), name=f"bardflow-seal-{step}", daemon=True)
        self._sealers.append(sealer)
        sealer.start()

    def _seal_when_there(self, step: int, wait_s: float = 60.0) -> None:
        step_dir, deadline = self.directory / str(step), time.monotonic() + wait_s
        while not step_dir.is_dir() and time.monotonic() < deadline:
            time.sleep(0.005)
        try:
            seal_checkpoint(step_dir)
        except OSError:  # removed meanwhile (only the newest are kept): nothing to seal
            pass

    def _sealed(self) -> None:
        """Waits for every seal of the saves that are complete."""
        for sealer in self._sealers:
            sealer.join()
        self._sealers = [t for t in self._sealers if t.is_alive()]

    @staticmethod
    def steps(directory: Path) -> list[int]:
        """The steps of the complete checkpoints in ``directory``, oldest first."""
        found = Path(directory).iterdir() if Path(directory).is_dir() else []
        return sorted(int(p.name) for p in found if p.name.isdigit() and p.is_dir())

    def save(self, step: int, state: nnx.State, record: dict) -> None:
        pure = nnx.to_pure_dict(state)
        if jax.process_count() > 1 and (self.manager is not None or _split_over_processes(pure)):
            pure = _host_copy(pure)  # a split state is gathered by every process together
        if self.manager is None:
            return
        if jax.process_index() == 0:
            require_writable(self.directory, f"the checkpoint of step {step}")
            require_space(self.directory, _nbytes(pure), f"the checkpoint of step {step}")
        self._committing.append(step)
        self.manager.save(
            step, args=ocp.args.Composite(state=ocp.args.StandardSave(pure), record=ocp.args.JsonSave(record))
        )
        if self.saved is not None:
            self.manager.wait_until_finished()
            self._sealed()
            self.saved()

    def latest(self, template: nnx.State) -> tuple[nnx.State, dict] | None:
        """The newest complete checkpoint restored onto ``template``, or None."""
        multi = jax.process_count() > 1
        step = self.manager.latest_step() if self.manager is not None else None
        pure = nnx.to_pure_dict(template)
        restored = None
        if step is not None and self.manager is not None:  # process 0
            restored, step = self._restore_newest(step, pure, multi)
        if multi:
            from .multihost import broadcast_json

            step = broadcast_json(step)
        if step is None:
            return None
        if multi:
            state, record = _from_leader(pure, restored)
        else:
            assert restored is not None  # one process: process 0, which holds the manager
            state, record = jax.tree.map(jax.numpy.asarray, restored["state"]), restored["record"]
        nnx.replace_by_pure_dict(template, state)
        return template, record

    def _restore_newest(self, step: int | None, pure: dict, multi: bool) -> tuple[Any, int | None]:
        """The newest checkpoint Orbax can read, from ``step`` down; one it cannot is set aside."""
        abstract = jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), pure) if multi else jax.tree.map(_abstract, pure)
        while step is not None and self.manager is not None:
            try:
                return self.manager.restore(
                    step,
                    args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract), record=ocp.args.JsonRestore()),
                ), step
            except Exception as error:  # noqa: BLE001 - Orbax raises many types for damaged files
                self.manager.close()
                self.set_aside(step, f"Orbax cannot read it: {' '.join(str(error).split())[:160]}")
                self.manager = self._manager()
                step = self.manager.latest_step()
        return None, None

    def close(self) -> None:
        if self.manager is None:
            return
        self.manager.wait_until_finished()
        self._sealed()
        self.manager.close()
        if self.saved is not None:
            self.saved()


def _from_leader(template: dict, restored: Mapping[str, Any] | None) -> tuple[dict, dict]:
    """Process 0's restored state and record on every process, placed like ``template``."""
    from jax.experimental import multihost_utils

    from .multihost import broadcast_json

    host = restored["state"] if restored is not None else jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), template)
    shared = multihost_utils.broadcast_one_to_all(host)
    state = jax.tree.map(
        lambda x, value: jax.make_array_from_callback(x.shape, x.sharding, _reader(value)), template, shared
    )
    return state, broadcast_json(restored["record"] if restored is not None else None)


def _reader(value) -> Callable:
    """A device's part of ``value``, by index (one host array per leaf)."""
    value = np.asarray(value)
    return lambda index: value[index]
