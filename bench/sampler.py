"""``python -m bench.sampler [--presets gpt2,codelab] [--batches 1,64]``: the KV-cache sampler
(``generate_batch``) on this machine's first device, in bytes/s, against what the memory
bandwidth allows.

A sampled byte is one position through the model: every weight and the cache's filled part
are read once per step, so a step cannot be faster than those bytes over the device's
bandwidth (``BANDWIDTH``; a CPU has no figure). Measured for float32 weights and for
bfloat16 ones (the cache in the weights' dtype), with the largest difference of their logits
on a probe, beside the verify stage's tolerance.
"""

from __future__ import annotations

import argparse
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench.report import RESULTS, machine, write_report

BANDWIDTH = {"TPU v5 lite": 819e9, "H200": 4.8e12, "H100": 3.35e12}  # bytes/s, the makers' data sheets
WEIGHTS = ("float32", "bfloat16")
SMOKE = {"model.num_layers": 1, "model.d_model": 64, "model.num_heads": 2, "model.ffn_dim": 128}


def bandwidth(device_kind: str) -> float | None:
    return next((rate for name, rate in BANDWIDTH.items() if name.lower() in device_kind.lower()), None)


def step_bytes(
    model, rows: int, prompt: int, new_bytes: int, window: int, width: int, cache_width: int | None = None
) -> float:
    """Bytes one sampling step reads on average: the weights (``width`` bytes a value), and each
    layer's keys and values (``cache_width``, by default the same) up to the position (the
    whole window once it wraps)."""
    from bardflow.model.network.transformer import count_params

    attn = model.blocks[0].attn
    positions = [min(p + 1, window) for p in range(prompt, prompt + new_bytes)]
    cache = 2 * len(model.blocks) * rows * attn.num_heads * attn.head_dim * (cache_width or width)
    cache *= sum(positions) / len(positions)
    return count_params(model) * width + cache


def measure(preset: str, batches: list[int], new_bytes: int, smoke: bool, weights: tuple[str, ...] = WEIGHTS) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from bardflow.config.settings import VerifyConfig, build_config
    from bardflow.model.inference.sampling import generate_batch
    from bardflow.model.network.transformer import build_model
    from bardflow.model.training.checkpoint import max_logit_diff
    from bardflow.model.training.compiling import compile_workers
    from bardflow.model.training.step import in_dtype

    cfg = build_config(preset, SMOKE if smoke else {})
    window = cfg.model.max_seq_len
    device = jax.devices()[0]
    rate = bandwidth(device.device_kind)
    base = build_model(cfg.model, 0)
    probe = np.random.default_rng(0).integers(0, 256, (4, window), dtype=np.int32)
    found = {"preset": preset, "window": window, "new_bytes": new_bytes, "by_weights": {}}
    for name in weights:
        dtype = jnp.dtype(name)
        model = in_dtype(base, dtype)
        # The probe's logits and each batch's sampler compiled side by side (each on its
        # first call), then each batch timed alone.
        with ThreadPoolExecutor(compile_workers(len(batches) + 1)) as pool:
            diff = pool.submit(max_logit_diff, base, model, probe)
            warmed = [
                pool.submit(generate_batch, model, "ROMEO:", new_bytes, 0.8, list(range(rows)), window)
                for rows in batches
            ]
        for done in warmed:
            done.result()  # a failure there is the bench's
        figures = {"logit_diff_to_float32": diff.result(), "tolerance": VerifyConfig().tolerance}
        for rows in batches:
            seeds = list(range(rows))
            started = time.perf_counter()
            generate_batch(model, "ROMEO:", new_bytes, 0.8, seeds, window)
            seconds = time.perf_counter() - started
            per_s = rows * new_bytes / seconds
            bound = None
            if rate is not None:
                bound = (
                    rate / step_bytes(model, rows, len("ROMEO:"), new_bytes, window, jnp.dtype(dtype).itemsize) * rows
                )
            figures[f"batch_{rows}"] = {
                "bytes_per_s": round(per_s, 1),
                "bound_bytes_per_s": None if bound is None else round(bound, 1),
                "bound_fraction": None if bound is None else round(per_s / bound, 3),
            }
            print(
                f"{preset} {name} weights, batch {rows}: {per_s:,.0f} bytes/s"
                + (f" ({per_s / bound:.2f} of the bound)" if bound else ""),
                flush=True,
            )
        found["by_weights"][name] = figures
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.sampler", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--presets", default="gpt2,codelab")
    parser.add_argument("--batches", default="1,64")
    parser.add_argument("--new-bytes", type=int, default=500)
    parser.add_argument("--weights", default=",".join(WEIGHTS), help="the weights' dtypes measured")
    parser.add_argument("--smoke", action="store_true", help="one small layer: every part runs, on a CPU too")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    report, flat = {"machine": machine(), "presets": {}}, {}
    weights = tuple(args.weights.split(","))
    for preset in args.presets.split(","):
        found = report["presets"][preset] = measure(preset, batches, args.new_bytes, args.smoke, weights)
        for dtype, figures in found["by_weights"].items():
            for key, value in figures.items():
                if key.startswith("batch_"):
                    flat[f"{preset}.{dtype}.{key}.bytes_per_s"] = value["bytes_per_s"]
    print(f"written to {write_report(report, flat, args.out, 'sampler')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
