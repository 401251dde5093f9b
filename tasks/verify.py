"""Stage 7: restore the checkpoint into a freshly initialised model and check that
its logits match the trained model's on a fixed probe batch."""

from __future__ import annotations

import json

from ..artifacts.store import Builder, Version
from ..config.settings import VerifyConfig
from ..errors import BardflowError
from ..model.training.checkpoint import load_model, max_logit_diff
from .checkpoint import MODEL
from .encode import VAL, split_rows
from .registry import VERIFY
from .train import trained_model

(VERDICT,) = VERIFY.builds


class VerificationError(BardflowError, AssertionError):
    """The restored model does not reproduce the trained one."""


def build(settings: VerifyConfig, out: Builder, checkpoint: Version, train_parallel: Version, encode: Version) -> None:
    reference, request = trained_model(train_parallel)
    restored = load_model(checkpoint.file(MODEL), init_seed=settings.init_seed)
    # A row may be one byte longer than the context (data.every_position): the probe fits it.
    probe = split_rows(encode, VAL)[: settings.probe_sequences][:, : request.model.max_seq_len]
    diff = max_logit_diff(reference, restored, probe)
    passed = diff < settings.tolerance
    verdict = {
        "max_abs_diff": diff,
        "tolerance": settings.tolerance,
        "passed": passed,
        "probe_shape": list(probe.shape),
    }
    if not passed:
        raise VerificationError(
            f"restored logits differ from the trained model's by {diff:.3e} (tolerance "
            f"{settings.tolerance:.0e}); the checkpoint is not faithful: rerun with --refresh checkpoint"
        )
    out.path(VERDICT).write_text(json.dumps(verdict, indent=1))
    out.metrics.update({"max_abs_diff": diff, "passed": passed})
