"""The export stage's check of the Hugging Face folder, run as a script in a fresh interpreter
(``python -I``) with torch and transformers and without bardflow: it loads ``export/hf/`` as
anyone would (``AutoModelForCausalLM``, ``AutoTokenizer``), and prints, as JSON, the largest
difference of its logits from the stage's on the probes, whether its greedy continuation of
the prompt (past the context too, where the model's window slides) is byte for byte the
stage's, whether the tokenizer's ids are the bytes, and which modules it needed.

    python -I hf_check.py HF_FOLDER PROBES.npz [HF_FOLDER PROBES.npz …]   # a JSON line each
"""

import json
import logging
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer


def main(folder: Path, probes: Path) -> dict:
    expected = np.load(probes)
    model: Any = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()  # a causal LM
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    diffs = {}
    with torch.no_grad():
        for name in sorted(k for k in expected.files if k.startswith("tokens")):
            logits = model(torch.from_numpy(expected[name].astype(np.int64))).logits.numpy()
            reference = expected[name.replace("tokens", "logits")]
            diffs[name] = float(np.max(np.abs(logits - reference))) if logits.shape == reference.shape else float("inf")
        heard = Heard()  # what transformers warns of on a plain generate() with the folder's settings
        logging.getLogger("transformers").addHandler(heard)
        try:
            continuation = greedy(
                model, expected["prompt"].astype(np.int64), int(expected["greedy"].shape[0]), int(expected["window"])
            )
        finally:
            logging.getLogger("transformers").removeHandler(heard)
    text = expected["tokenizer_text"].tobytes().decode()
    ids = tokenizer(text)["input_ids"]
    return {
        "max_abs_diff": max(diffs.values()),
        "by_probe": diffs,
        "greedy_equal": bool(np.array_equal(continuation, expected["greedy"])),
        "greedy_bytes": int(continuation.shape[0]),
        "tokenizer_exact": ids == expected["tokenizer_ids"].tolist()
        and tokenizer.decode(ids) == text
        and len(tokenizer) == int(expected["vocab"]),
        "architecture": type(model).__name__,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "generate_warnings": heard.lines,
        "bardflow_imported": any(m == "bardflow" or m.startswith("bardflow.") for m in sys.modules),
    }


class Heard(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage()[:200])


def greedy(model: Any, prompt: np.ndarray, new: int, window: int) -> np.ndarray:
    """``new`` bytes at temperature 0: ``generate`` while the context has room; past it (a
    ``window`` > 0), each byte from a forward pass over the last ``window`` bytes, as
    bardflow's sampler slides a learned-position model's window."""
    cached = new if window == 0 else max(0, min(new, window - prompt.shape[0]))
    ids = torch.from_numpy(prompt)[None]
    if cached:
        ids = model.generate(ids, max_new_tokens=cached, min_new_tokens=cached, do_sample=False, pad_token_id=0)
    for _ in range(new - cached):
        next_id = model(ids[:, -window:]).logits[:, -1].argmax(-1, keepdim=True)
        ids = torch.cat([ids, next_id], dim=1)
    return ids[0, prompt.shape[0] :].numpy()


if __name__ == "__main__":
    pairs = sys.argv[1:]
    for at in range(0, len(pairs) - 1, 2):  # torch and transformers load once for every folder
        print(json.dumps(main(Path(pairs[at]), Path(pairs[at + 1]))), flush=True)
