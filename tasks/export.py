"""Stage: the checkpointed model in formats that leave bardflow (``model/export.py``): the
weights as safetensors by path name, the config, and the forward pass serialized with
``jax.export``. The stage checks itself: a fresh interpreter that imports only jax, numpy
and safetensors loads the folder and its logits must match the restored model's, for two
batch sizes and lengths, or the stage fails."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

from ..artifacts import ui
from ..artifacts.store import Builder, Version, file_digest
from ..model.checkpoint import load_config, load_model
from ..model.config import ModelConfig
from ..model.errors import BardflowError
from ..model.export import PLATFORMS, export_forward, flat_params, forward_of, portable_config
from ..model.transformer import Transformer
from .checkpoint import MODEL
from .registry import EXPORT

(FOLDER,) = EXPORT.builds
TOLERANCE = 1e-5
CHECK = Path(__file__).with_name("export_check.py")


WEIGHTS, CONFIG, FORWARD, CHECKSUMS = "model.safetensors", "config.json", "forward.jax", "checksums.json"


def write_export(folder: Path, model: Transformer, cfg: ModelConfig) -> dict[str, int]:
    """The export folder: weights, config and the serialized forward; returns what it holds."""
    from safetensors.numpy import save_file

    folder.mkdir(parents=True, exist_ok=True)
    params = flat_params(model)
    save_file(params, str(folder / WEIGHTS), metadata={"format": "bardflow", "vocab": "bytes"})
    portable = portable_config(cfg)
    (folder / CONFIG).write_text(json.dumps({**portable.model_dump(mode="json"), "platforms": list(PLATFORMS),
                                             "inputs": "params (model.safetensors), tokens int32 (batch, length)"},
                                            indent=1))
    (folder / FORWARD).write_bytes(export_forward(model, portable))
    # The folder carries its own checksums, so that whoever loads it (examples/) can tell a
    # damaged or mixed-up file from a model, wherever the folder was copied to.
    sums = {name: file_digest(folder / name) for name in (WEIGHTS, CONFIG, FORWARD)}
    (folder / CHECKSUMS).write_text(json.dumps({"sha256": sums}, indent=1))
    return {"parameters": int(sum(v.size for v in params.values())), "tensors": len(params)}


class ExportError(BardflowError, RuntimeError):
    """The exported model does not compute what the checkpoint does."""


def probes(max_seq_len: int) -> dict[str, np.ndarray]:
    """Two shapes, so that the symbolic batch and length are both exercised."""
    ids = np.arange(3 * max_seq_len, dtype=np.int32) * 7 % 256
    return {"tokens_full": ids[: 2 * max_seq_len].reshape(2, max_seq_len),
            "tokens_short": ids[: 3 * max(1, max_seq_len // 2)].reshape(3, -1)}


def build(settings: dict, out: Builder, checkpoint: Version) -> None:
    model, cfg = load_model(checkpoint.file(MODEL)), load_config(checkpoint.file(MODEL))
    started = time.perf_counter()
    folder = out.path(FOLDER)
    held = write_export(folder, model, cfg)
    export_s = time.perf_counter() - started
    forward, params = jax.jit(forward_of(model)), flat_params(model)
    expected = {}
    for name, tokens in probes(cfg.max_seq_len).items():
        expected[name] = tokens
        expected[name.replace("tokens", "logits")] = np.asarray(forward(params, tokens))
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bardflow-export-check-") as scratch:
        np.savez(Path(scratch) / "probes.npz", **expected)
        done = subprocess.run([sys.executable, "-I", str(CHECK), str(folder), str(Path(scratch) / "probes.npz")],
                              capture_output=True, text=True, timeout=600, check=False)
    check_s = time.perf_counter() - started
    if done.returncode != 0:
        raise ExportError(f"the export could not be loaded without bardflow: {done.stderr.strip().splitlines()[-1:]}; "
                          "rerun with --refresh export")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if result["bardflow_imported"] or not result["max_abs_diff"] <= TOLERANCE:
        raise ExportError(f"the exported model's logits differ from the checkpoint's by {result['max_abs_diff']:.3e} "
                          f"(tolerance {TOLERANCE:.0e}); rerun with --refresh export")
    files = {p.name: p.stat().st_size for p in sorted(folder.iterdir())}
    out.metrics.update({"parameters": held["parameters"], "bytes": sum(files.values()),
                        "max_abs_diff": result["max_abs_diff"], "platforms": ",".join(PLATFORMS),
                        "export_s": round(export_s, 3), "check_s": round(check_s, 3)})
    ui.table(EXPORT.name, [{"file": name, "bytes": size} for name, size in files.items()],
             description=f"Export: safetensors + jax.export forward ({', '.join(PLATFORMS)}), checked without "
                         f"bardflow on {result['platform']}: max |diff| {result['max_abs_diff']:.1e}")
