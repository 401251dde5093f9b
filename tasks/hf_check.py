"""The export stage's check of the Hugging Face folder, run as a script in a fresh interpreter
(``python -I``) with torch and transformers and without bardflow: it loads ``export/hf/`` as
anyone would (``AutoModelForCausalLM``, ``AutoTokenizer``), and prints, as JSON, the largest
difference of its logits from the stage's on the probes, whether its greedy continuation of
the prompt is byte for byte the stage's, whether the tokenizer's ids are the bytes, and which
modules it needed.

    python -I hf_check.py HF_FOLDER PROBES.npz [HF_FOLDER PROBES.npz …]   # a JSON line each
"""

import json
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
        prompt = expected["prompt"].astype(np.int64)
        new = int(expected["greedy"].shape[0])
        out = model.generate(torch.from_numpy(prompt)[None], max_new_tokens=new, min_new_tokens=new, do_sample=False,
                             pad_token_id=0)
    continuation = out[0, prompt.shape[0]:].numpy()
    text = "ROMEO: What, art thou hurt? ¿Qué? Ω\n"
    ids = tokenizer(text)["input_ids"]
    return {"max_abs_diff": max(diffs.values()), "by_probe": diffs,
            "greedy_equal": bool(np.array_equal(continuation, expected["greedy"])),
            "greedy_bytes": int(continuation.shape[0]),
            "tokenizer_exact": ids == list(text.encode()) and tokenizer.decode(ids) == text and len(tokenizer) == 256,
            "architecture": type(model).__name__, "transformers": transformers.__version__,
            "torch": torch.__version__,
            "bardflow_imported": any(m == "bardflow" or m.startswith("bardflow.") for m in sys.modules)}


if __name__ == "__main__":
    pairs = sys.argv[1:]
    for at in range(0, len(pairs) - 1, 2):  # torch and transformers load once for every folder
        print(json.dumps(main(Path(pairs[at]), Path(pairs[at + 1]))), flush=True)
