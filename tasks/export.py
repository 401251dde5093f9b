"""Stage: the checkpointed model in formats that leave bardflow (``model/inference/export.py``): the
weights as safetensors by path name, the config, and the forward pass serialized with
``jax.export``; and in ``hf/``, the model as Hugging Face ``transformers`` loads it
(``model/inference/hf.py``: GPT-2 or GPT-NeoX, a byte-level tokenizer). The stage checks itself: a
fresh interpreter that imports only jax, numpy and safetensors loads the folder and its
logits must match the restored model's, for two batch sizes and lengths; another, with torch
and transformers and no bardflow, loads ``hf/`` and its logits must match too and its greedy
continuation of a prompt be the same bytes; or the stage fails. Without torch and
transformers (``pip install 'bardflow[hf]'``), ``hf/`` is written and said to be unchecked."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np

from ..artifacts.store import Builder, Version, file_digest
from ..config.machine import install_hint
from ..config.settings import ModelConfig
from ..errors import BardflowError
from ..model.data.tokenizer import BpeTokenizer, byte_alphabet
from ..model.inference.export import (
    PLATFORMS,
    export_forward,
    flat_params,
    forward_of,
    portable_config,
)
from ..model.inference.hf import hf_config, hf_tensors, unmappable
from ..model.inference.sampling import sample_ids
from ..model.network.transformer import Transformer
from ..model.training.checkpoint import load_config, load_model
from . import report
from .checkpoint import MODEL
from .registry import EXPORT, HF_CHECKING, hf_check_tools
from .tokenize import for_model

(FOLDER,) = EXPORT.builds
TOLERANCE = 1e-5
CHECK = Path(__file__).with_name("export_check.py")


WEIGHTS, CONFIG, FORWARD, CHECKSUMS = "model.safetensors", "config.json", "forward.jax", "checksums.json"
HF = "hf"  # the transformers folder, inside the export
# Beside it: whether transformers loaded it, and what it computed. A file of the version, so
# that a refresh whose check ran where the stored version's could not is a new output, not
# "the same" (its record would otherwise keep saying "not checked").
HF_RECORD = "hf_check.json"
HF_CHECK = Path(__file__).with_name("hf_check.py")
HF_TOLERANCE = 1e-4
PROMPT, GREEDY_BYTES = b"ROMEO:", 200  # the greedy continuation both must agree on


def write_export(folder: Path, model: Transformer, cfg: ModelConfig) -> dict[str, int]:
    """The export folder: weights, config and the serialized forward; returns what it holds."""
    folder.mkdir(parents=True, exist_ok=True)
    params = flat_params(model)
    (folder / WEIGHTS).write_bytes(safetensors_bytes(params, {"format": "bardflow", "vocab": "bytes"}))
    portable = portable_config(cfg)
    (folder / CONFIG).write_text(
        json.dumps(
            {
                **portable.model_dump(mode="json"),
                "platforms": list(PLATFORMS),
                "inputs": "params (model.safetensors), tokens int32 (batch, length)",
            },
            indent=1,
        )
    )
    (folder / FORWARD).write_bytes(export_forward(model, portable))
    write_checksums(folder)
    return {"parameters": int(sum(v.size for v in params.values())), "tensors": len(params)}


def safetensors_bytes(tensors: dict[str, np.ndarray], metadata: dict[str, str]) -> bytes:
    """A safetensors file whose bytes follow from its tensors and metadata alone: the library
    writes its metadata map in an order that changes from process to process, so its header
    is written again with sorted keys (padded with spaces to 8 bytes, as the format allows)."""
    from safetensors.numpy import save

    raw = save(tensors, metadata=metadata)
    size = int.from_bytes(raw[:8], "little")
    header = json.dumps(json.loads(raw[8 : 8 + size]), sort_keys=True, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)
    return len(header).to_bytes(8, "little") + header + raw[8 + size :]


def write_checksums(folder: Path) -> None:
    """The folder carries its own checksums, so that whoever loads it (examples/) can tell a
    damaged, edited or mixed-up file from a model, wherever the folder was copied to: every
    file of it, the transformers folder's too, by its path within the folder."""
    sums = {
        p.relative_to(folder).as_posix(): file_digest(p)
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p != folder / CHECKSUMS
    }
    (folder / CHECKSUMS).write_text(json.dumps({"sha256": sums}, indent=1))


def write_hf(folder: Path, params: dict[str, np.ndarray], cfg: ModelConfig, bpe: BpeTokenizer | None = None) -> None:
    """``hf/``: config, weights under the architecture's names, the tokenizer (the bytes, or
    the run's trained BPE) and the generation settings, as ``from_pretrained`` reads them."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    folder.mkdir(parents=True, exist_ok=True)
    (folder / WEIGHTS).write_bytes(safetensors_bytes(hf_tensors(params, cfg), {"format": "pt"}))
    (folder / CONFIG).write_text(json.dumps(hf_config(cfg), indent=1))
    if bpe is not None:
        bpe.for_text().save(str(folder / "tokenizer.json"))
    else:
        tokenizer = Tokenizer(models.BPE(vocab={char: byte for byte, char in enumerate(byte_alphabet())}, merges=[]))
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tokenizer.decoder = decoders.ByteLevel()
        tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "model_max_length": cfg.max_seq_len,
                "clean_up_tokenization_spaces": False,
            },
            indent=1,
        )
    )
    # No max_length: beside a call's max_new_tokens transformers warns that both are set on every
    # generate(); the context is config.json's and the tokenizer's model_max_length.
    (folder / "generation_config.json").write_text(
        json.dumps({"pad_token_id": 0, "bos_token_id": None, "eos_token_id": None}, indent=1)
    )


def hf_checking(tools: str) -> str | None:
    """Why ``hf/`` is not checked with ``tools`` (``hf_check_tools``'s answer), or None."""
    if tools == "off":
        return f"not checked ({HF_CHECKING}=off)"
    if tools == "not installed":
        return f"not checked: torch and transformers are not installed ({install_hint('hf')}, then rerun)"
    return None


class ExportError(BardflowError, RuntimeError):
    """The exported model does not compute what the checkpoint does."""


TOKENIZER_TEXT = "ROMEO: What, art thou hurt? ¿Qué? Ω\n"  # ASCII, Latin and Greek: 1, 2 and 3-byte characters


def probes(max_seq_len: int) -> dict[str, np.ndarray]:
    """Two shapes, so that the symbolic batch and length are both exercised."""
    ids = np.arange(3 * max_seq_len, dtype=np.int32) * 7 % 256
    return {
        "tokens_full": ids[: 2 * max_seq_len].reshape(2, max_seq_len),
        "tokens_short": ids[: 3 * max(1, max_seq_len // 2)].reshape(3, -1),
    }


def build(settings: dict, out: Builder, checkpoint: Version, tokenize: Version | None = None) -> None:
    model, cfg = load_model(checkpoint.file(MODEL)), load_config(checkpoint.file(MODEL))
    bpe = for_model(tokenize, cfg.vocab_size)  # a tokenizer's run: hf/ carries it, checked against bardflow's ids
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
    (result,) = _in_fresh_interpreter(CHECK, [(folder, expected)], "the export could not be loaded without bardflow")
    check_s = time.perf_counter() - started
    if result["bardflow_imported"] or not result["max_abs_diff"] <= TOLERANCE:
        raise ExportError(
            f"the exported model's logits differ from the checkpoint's by {result['max_abs_diff']:.3e} "
            f"(tolerance {TOLERANCE:.0e}); rerun with --refresh export"
        )
    hf = _hf(folder / HF, model, cfg, params, settings.get("hf_check") or hf_check_tools(), bpe)
    if (folder / HF).is_dir():
        kept = {name: value for name, value in hf.items() if name not in ("check_s", "greedy_ids")}  # no timings
        (folder / HF_RECORD).write_text(json.dumps(kept, indent=1, sort_keys=True))
    write_checksums(folder)  # now with hf/
    report.say("export: transformers folder %s/: %s", HF, hf["status"])  # unchecked or unwritten: the fix, in one line
    files = {p.name: p.stat().st_size for p in sorted(folder.iterdir()) if p.is_file()}
    out.metrics.update(
        {
            "parameters": held["parameters"],
            "bytes": sum(files.values()),
            "max_abs_diff": result["max_abs_diff"],
            "platforms": ",".join(PLATFORMS),
            "export_s": round(export_s, 3),
            "check_s": round(check_s, 3),
            "checked_on": result["platform"],
            **{f"hf_{name}": value for name, value in hf.items() if name in HF_METRICS},
        }
    )
    out.record["hf"] = hf


HF_METRICS = ("checked", "max_abs_diff", "greedy_bytes")


def _hf(
    folder: Path, model: Transformer, cfg: ModelConfig, params, tools: str, bpe: BpeTokenizer | None = None
) -> dict:
    """Writes and checks ``hf/`` with ``tools``; what became of it, for the manifest and the UI."""
    why = unmappable(cfg)
    if why is not None:
        return {"status": f"not written: {why}", "checked": False}
    write_hf(folder, params, cfg, bpe)
    # The weights are the float32 values training kept, whatever precision it computed in.
    found = {"architecture": hf_config(cfg)["architectures"][0], "weights": "float32", "checked": False}
    unchecked = hf_checking(tools)
    if unchecked is not None:
        return {**found, "status": unchecked}
    started = time.perf_counter()
    reference = hf_reference(model, cfg, bpe)
    (result,) = check_hf([(folder, reference)])
    return {
        **found,
        "checked": True,
        "max_abs_diff": result["max_abs_diff"],
        "greedy_bytes": result["greedy_bytes"],
        "prompt": PROMPT.decode(),
        "greedy_ids": reference["greedy"].tolist(),  # what a server must say too
        "check_s": round(time.perf_counter() - started, 3),
        "transformers": result["transformers"],
        "torch": result["torch"],
        "status": f"checked with transformers {result['transformers']}: max |diff| {result['max_abs_diff']:.1e}, "
        f"{result['greedy_bytes']} greedy bytes the same",
    }


def hf_reference(model: Transformer, cfg: ModelConfig, bpe: BpeTokenizer | None = None) -> dict[str, np.ndarray]:
    """What ``hf/`` must reproduce: the probes' logits and bardflow's own greedy continuation
    of the prompt (the sampler at temperature 0), ``GREEDY_BYTES`` long. With learned positions
    the sampler's window slides past the context, each byte from the last ``max_seq_len``
    (``window``), which the check does too; a rotary model's sampler keeps a ring of keys
    computed in earlier windows, which no stateless recomputation reproduces, so its
    continuation stops where the context does (``window`` 0).

    Computed with float32 matrix products throughout: the check runs transformers on the CPU
    in float32, while a GPU's default float32 product rounds its operands to TF32, which
    moves logits by far more than the tolerance (docs/gpu-check.md)."""
    rotary = cfg.positions == "rope"
    prompt = (np.frombuffer(PROMPT, np.uint8) if bpe is None else bpe.encode(PROMPT)).astype(np.int32)
    new = GREEDY_BYTES if not rotary else min(GREEDY_BYTES, cfg.max_seq_len - len(prompt))
    reference: dict[str, np.ndarray] = {}
    with jax.default_matmul_precision("highest"):
        forward, params = jax.jit(forward_of(model)), flat_params(model)
        for name, tokens in probes(cfg.max_seq_len).items():
            reference[name] = tokens
            reference[name.replace("tokens", "logits")] = np.asarray(forward(params, tokens))
        sampled = sample_ids(model, prompt, new, 0.0, [0], cfg.max_seq_len)[0]
    text = TOKENIZER_TEXT.encode()
    return {
        **reference,
        "prompt": prompt,
        "greedy": sampled.astype(np.int32),
        "window": np.asarray(0 if rotary else cfg.max_seq_len, np.int32),
        # The tokenizer's check: a line's ids as bardflow's tokenizer gives them, and the vocabulary.
        "tokenizer_text": np.frombuffer(text, np.uint8),
        "tokenizer_ids": (np.frombuffer(text, np.uint8) if bpe is None else bpe.encode(text)).astype(np.int64),
        "vocab": np.asarray(cfg.vocab_size, np.int64),
    }


def check_hf(folders: list[tuple[Path, dict[str, Any]]]) -> list[dict]:
    """Each ``hf/`` folder loaded by transformers (``run_hf_check``) and held to its reference;
    ExportError names the first that fails."""
    results = run_hf_check(folders)
    for result in results:
        hf_verdict(result)
    return results


def run_hf_check(folders: list[tuple[Path, dict[str, Any]]]) -> list[dict]:
    """What transformers computes for each (folder, reference), in one fresh interpreter with
    torch and transformers and without bardflow (``hf_check.py``)."""
    return _in_fresh_interpreter(HF_CHECK, folders, f"transformers could not load the export's {HF}/ folder")


def _in_fresh_interpreter(script: Path, folders: list[tuple[Path, dict[str, Any]]], failed: str) -> list[dict]:
    """``python -I script FOLDER PROBES.npz …``: a check that must not see bardflow, one JSON
    line per folder; ExportError (``failed`` and the script's last error line) if it fails."""
    with tempfile.TemporaryDirectory(prefix="bardflow-export-check-") as scratch:
        arguments = []
        for number, (folder, reference) in enumerate(folders):
            np.savez(Path(scratch) / f"probes-{number}.npz", **reference)
            arguments += [str(folder), str(Path(scratch) / f"probes-{number}.npz")]
        done = subprocess.run(
            [sys.executable, "-I", str(script), *arguments], capture_output=True, text=True, timeout=900, check=False
        )
    if done.returncode != 0:
        raise ExportError(f"{failed}: {done.stderr.strip().splitlines()[-1:]}; rerun with --refresh export")
    return [json.loads(line) for line in done.stdout.strip().splitlines() if line.startswith("{")]


def hf_verdict(result: dict) -> None:
    """ExportError unless transformers computed what the checkpoint does."""
    if result["bardflow_imported"] or not result["max_abs_diff"] <= HF_TOLERANCE:
        raise ExportError(
            f"transformers' {result['architecture']} computes logits that differ from the "
            f"checkpoint's by {result['max_abs_diff']:.3e} (tolerance {HF_TOLERANCE:.0e}); rerun "
            "with --refresh export"
        )
    if not result["greedy_equal"] or not result["tokenizer_exact"]:
        what = "greedy continuation" if not result["greedy_equal"] else "tokenizer's ids"
        raise ExportError(
            f"transformers' {what} differs from bardflow's for the export's {HF}/ folder; rerun with --refresh export"
        )
