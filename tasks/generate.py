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
from .tokenize import for_model

(SAMPLES,) = GENERATE.builds


def build(settings: GenerateConfig, out: Builder, checkpoint: Version, tokenize: Version | None = None) -> None:
    model = load_model(checkpoint.file(MODEL))
    config = load_config(checkpoint.file(MODEL))
    max_seq_len = config.max_seq_len
    tokenizer = for_model(tokenize, config.vocab_size)  # a tokenizer's run: tokens to text through it
    samples, seconds, new_bytes = [], 0.0, 0
    for index, prompt in enumerate(settings.prompts):
        started = time.perf_counter()
        data = generate(
            model,
            prompt.text,
            settings.max_new_bytes,
            prompt.temperature,
            settings.seed + index,
            max_seq_len,
            tokenizer,
        )
        seconds += time.perf_counter() - started
        new_bytes += len(data) - len(prompt.text.encode())  # with a tokenizer, its max_new_bytes tokens' bytes
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
            "bytes_per_s": round(new_bytes / seconds, 1),
            "samples": len(samples),
            "new_bytes": new_bytes,
        }
    )
