"""``python -m tests.four_devices OUT.json``: the FSDP checks that need four emulated devices
(the test session has two), in one process whose findings ``tests/test_fsdp.py`` asserts on.

On the cpu shape (Muon) and the codelab shape (AdamW): losses of ``fsdp`` against
``replicated`` and of remat, at every step; XLA's memory figures of the compiled codelab
step, and of gpt2's widths under fsdp in one pass and in four; a checkpoint written with fsdp
on four devices resumed on two and on one; the final state restored on one device."""

from __future__ import annotations

import os
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"

import json
import shutil
import tempfile
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from bardflow.config.settings import build_config
from bardflow.model.data.splits import Batches, encode
from bardflow.model.training.checkpoint import TrainingCheckpoints, load_train_state, save_train_state
from bardflow.model.training.loop import TrainingSetup, train
from bardflow.model.training.memory import estimate, step_memory
from bardflow.model.training.placement import Placement
from bardflow.model.training.step import init_state, make_train_step
from tests.helpers import play_text

STEPS = 8
# The cpu and codelab shapes' widths (every array FSDP splits has a block's shape), with fewer
# blocks and a small batch: each run compiles and trains in seconds.
CPU = {
    "train.steps": STEPS,
    "train.single_device_steps": 0,
    "train.warmup_steps": 2,
    "train.log_every": 1,
    "train.checkpoint_every": 4,
    "train.per_device_batch": 4,
    "model.num_layers": 1,
}
GPT2_SHORT = {"model.num_layers": 2, "model.max_seq_len": 128, "data.seq_len": 128, "train.per_device_batch": 8}
CODELAB = {"train.steps": 4, "train.log_every": 1, "train.per_device_batch": 2, "model.num_layers": 2}


def placed(devices: int, fsdp: bool) -> Placement:
    return (
        Placement.data_parallel(jax.devices()[:devices], fsdp=fsdp)
        if devices > 1
        else Placement.single(jax.devices()[0])
    )


def losses(
    preset: str,
    settings: dict,
    rows,
    sharding: str,
    remat: bool = False,
    devices: int = 4,
    resume: Path | None = None,
    stop_after: int | None = None,
):
    cfg = build_config(preset, {**settings, "train.sharding": sharding, "train.remat": remat})
    global_batch = cfg.train.per_device_batch * 4  # the same batches on any device count
    train_cfg = cfg.train.model_copy(update={"per_device_batch": global_batch // devices})
    graphdef, state = init_state(cfg.model, train_cfg)
    checkpoints = TrainingCheckpoints(resume, 2) if resume is not None else None
    try:
        result = train(
            TrainingSetup(
                graphdef,
                state,
                Batches(rows, global_batch),
                [],
                placed(devices, sharding == "fsdp"),
                train_cfg,
                checkpoints=checkpoints,
                stop_after=stop_after,
            )
        )
    finally:
        if checkpoints is not None:
            checkpoints.close()
    return result


def memory(preset: str, sharding: str, remat: bool, passes: int = 1, settings: dict | None = None) -> dict:
    """The compiled step's figures at the preset's own batch in ``passes`` passes a step, and
    the estimate's (``model/training/memory.py``)."""
    cfg = build_config(preset, {**(settings or {}), "train.sharding": sharding, "train.remat": remat})
    placement = placed(4, sharding == "fsdp")
    graphdef, state = init_state(cfg.model, cfg.train)
    state = placement.put_state(state)
    tokens = placement.put_batch(np.zeros((cfg.train.per_device_batch * 4, cfg.data.seq_len), np.int32))
    compiled = (
        make_train_step(graphdef, placement.shardings(state), placement.batch_sharding, passes=passes, remat=remat)
        .lower(state, tokens)
        .compile()
    )
    found = estimate(cfg.model, cfg.train, 4, cfg.data.seq_len, cfg.train.per_device_batch // passes, "float32")
    return {
        **step_memory(compiled, state),
        "estimate_bytes": found.total_bytes,
        "estimate_state_bytes": found.state_bytes,
        "estimate_gathered_bytes": found.gathered_bytes,
    }


def main(out: Path) -> None:
    text = play_text(400_000)
    found: dict = {"losses": {}, "memory": {}, "resumed": {}}
    cpu_rows = encode(text, 128, 0.9, 0, every_position=True).train
    codelab_rows = encode(text, 256, 0.9, 0).train
    work = Path(tempfile.mkdtemp(prefix="bardflow-four-devices-"))
    try:
        settings = {**CPU, "train.optimizer": "muon"}
        for sharding, remat in (("replicated", False), ("fsdp", False), ("fsdp", True)):
            keep = work / "fsdp" if (sharding, remat) == ("fsdp", False) else None
            result = losses("cpu", settings, cpu_rows, sharding, remat, resume=keep)
            found["losses"][f"cpu muon {sharding}{' remat' if remat else ''}"] = [h["loss"] for h in result.history]
            if keep is not None:
                found["fsdp_metrics"] = result.metrics()
                save_train_state(work / "state", result.state)
        for sharding in ("replicated", "fsdp"):
            result = losses("codelab", CODELAB, codelab_rows, sharding)
            found["losses"][f"codelab adamw {sharding}"] = [h["loss"] for h in result.history]
            found["memory"][sharding] = result.metrics()["step_memory"]  # the state's bytes: any batch
        # The checkpoint of step 4 (of 8) that fsdp wrote on four devices, resumed on four, two and one.
        for devices in (4, 2, 1):
            folder = work / f"on-{devices}"
            shutil.copytree(work / "fsdp", folder)
            for step in [s for s in TrainingCheckpoints.steps(folder) if s != 4]:
                shutil.rmtree(folder / str(step))
            result = losses("cpu", settings, cpu_rows, "fsdp", devices=devices, resume=folder)
            found["resumed"][str(devices)] = {
                "losses": [h["loss"] for h in result.history],
                "metrics": result.metrics(),
            }
        cfg = build_config("cpu", settings)
        graphdef, template = nnx.eval_shape(lambda: init_state(cfg.model, cfg.train))
        restored = load_train_state(work / "state", template)
        found["restored_devices"] = sorted({str(d) for leaf in jax.tree.leaves(restored) for d in leaf.devices()})
        for remat in (False, True):  # activations: the codelab's batch, in one pass
            found["memory"][f"batch 32{' remat' if remat else ''}"] = memory("codelab", "replicated", remat)
        # Under fsdp the parameters are gathered whole for the step, in one pass or several:
        # gpt2's widths, where they outweigh the activations of a short batch.
        for passes in (1, 4):
            found["memory"][f"gpt2 fsdp passes {passes}"] = memory("gpt2", "fsdp", False, passes, GPT2_SHORT)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    out.write_text(json.dumps(found, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
