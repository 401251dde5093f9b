"""Stage 7: restore the checkpoint into a freshly initialised model and check that
its logits match the trained model's on a fixed probe batch."""

from __future__ import annotations

import json

from pydantic import BaseModel, ConfigDict, Field

from artifacts import ui
from artifacts.store import Builder
from model.checkpoint import load_model, max_logit_diff
from model.data import read_sequences
from tasks.checkpoint import MODEL
from tasks.encode import VAL
from tasks.stage import Stage, inputs
from tasks.train import trained_model

STAGE = Stage("verify", "1")
VERDICT = "verdict.json"


class VerifyParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    tolerance: float = Field(1e-5, gt=0)
    init_seed: int = Field(99, description="seed of the fresh model; differs from training's")
    probe_sequences: int = Field(4, gt=0, description="validation sequences in the probe batch")


class VerificationError(AssertionError):
    """The restored model does not reproduce the trained one."""


@STAGE.task
def verify(params: VerifyParams, upstream: dict, store: str, force: bool = False) -> dict:
    found = inputs(store, upstream)

    def work(out: Builder) -> None:
        reference, _ = trained_model(found["train_parallel"])
        restored = load_model(found["checkpoint"].file(MODEL), init_seed=params.init_seed)
        probe = read_sequences(found["encode"].file(VAL))[0][: params.probe_sequences]
        diff = max_logit_diff(reference, restored, probe)
        passed = diff < params.tolerance
        verdict = {"max_abs_diff": diff, "tolerance": params.tolerance, "passed": passed,
                   "probe_shape": list(probe.shape)}
        ui.markdown(
            STAGE.name,
            f"## {'PASS' if passed else 'FAIL'}: restored logits {'match' if passed else 'differ'}\n\n"
            f"max |trained - restored| = **{diff:.3e}** (tolerance {params.tolerance:.0e}) on a "
            f"probe batch of {probe.shape[0]} x {probe.shape[1]} validation bytes; the fresh "
            f"model was initialised with seed {params.init_seed} before restoring.\n",
            description=f"Verify: {'pass' if passed else 'FAIL'}, max diff {diff:.2e}",
        )
        if not passed:
            raise VerificationError(
                f"restored logits differ from the trained model's by {diff:.3e} (tolerance "
                f"{params.tolerance:.0e}); the checkpoint is not faithful: rerun with --refresh checkpoint"
            )
        out.path(VERDICT).write_text(json.dumps(verdict, indent=1))
        out.metrics.update({"max_abs_diff": diff, "passed": passed})

    return STAGE.produce(params, upstream, store, force, work)
