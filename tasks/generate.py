"""Stage 8: Shakespeare-like samples from the restored checkpoint."""

from __future__ import annotations

import json
import time

from ..artifacts.store import Builder, Version
from ..config.settings import GenerateConfig
from ..model.inference.sampling import as_text, generate
from ..model.training.checkpoint import load_config, load_model
from .checkpoint import MODEL
from .registry import GENERATE

(SAMPLES,) = GENERATE.builds


def build(settings: GenerateConfig, out: Builder, checkpoint: Version) -> None:
    model = load_model(checkpoint.file(MODEL))
    max_seq_len = load_config(checkpoint.file(MODEL)).max_seq_len
    samples, seconds = [], 0.0
    for index, prompt in enumerate(settings.prompts):
        started = time.perf_counter()
        data = generate(
            model, prompt.text, settings.max_new_bytes, prompt.temperature, settings.seed + index, max_seq_len
        )
        seconds += time.perf_counter() - started
        samples.append(
            {
                "prompt": prompt.text,
                "temperature": prompt.temperature,
                "seed": settings.seed + index,
                "text": as_text(data),
            }
        )
    out.path(SAMPLES).write_text(json.dumps(samples, indent=1, ensure_ascii=False))
    # Timings go to the metrics only: samples.json (and so the fingerprint) must be
    # the same whenever the samples are, so a refresh with the same seed changes nothing.
    out.metrics.update(
        {
            "bytes_per_s": round(settings.max_new_bytes * len(samples) / seconds, 1),
            "samples": len(samples),
            "new_bytes": settings.max_new_bytes * len(samples),
        }
    )
