"""Stage 6: an Orbax checkpoint of the data-parallel model's parameters together
with its model config, so that restoring needs nothing but the checkpoint."""

from __future__ import annotations

from ..artifacts.store import Builder, Version
from ..model.network.transformer import count_params
from ..model.training.checkpoint import params_digest, save_model
from .registry import CHECKPOINT
from .train import trained_model

(MODEL,) = CHECKPOINT.builds


def build(settings: dict, out: Builder, train_parallel: Version) -> None:
    model, request = trained_model(train_parallel)
    save_model(out.path(MODEL), model, request.model)
    size = sum(f.stat().st_size for f in out.path(MODEL).rglob("*") if f.is_file())
    # The parameters' bytes, not the files: Orbax metadata carries timestamps, and a
    # re-save of the same parameters must not make verify and generate run again.
    out.fingerprint = params_digest(model)
    out.metrics.update({"parameters": count_params(model), "bytes": size})
