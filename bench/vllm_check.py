"""The export's transformers folder served by vLLM, as on a GPU host: vLLM loads
``export/hf/`` as it is, and its greedy continuation of the manifest's prompt must be the one
the export stage recorded (bardflow's own, which transformers reproduced), as far as the
context goes (vLLM does not slide a window). Prints one JSON line.

    python bench/vllm_check.py STORE/export/KEY   # the export version's folder
"""

import json
import sys
import time
from pathlib import Path


def main(version: Path) -> dict:
    from vllm import LLM, SamplingParams

    hf = json.loads((version / "manifest.json").read_text())["hf"]
    if "greedy_ids" not in hf:
        sys.exit(f"the export's hf/ folder was not checked ({hf['status']}): nothing to hold vLLM to")
    folder = version / "export" / "hf"
    context = json.loads((folder / "config.json").read_text())
    window = context.get("n_positions") or context["max_position_embeddings"]
    prompt = list(hf["prompt"].encode())
    expected = hf["greedy_ids"][: window - len(prompt)]
    started = time.perf_counter()
    llm = LLM(model=str(folder), dtype="float32", max_model_len=window, enforce_eager=True, seed=0)
    loaded_s = time.perf_counter() - started
    out = llm.generate(
        [{"prompt_token_ids": prompt}], SamplingParams(temperature=0.0, max_tokens=len(expected), ignore_eos=True)
    )
    got = list(out[0].outputs[0].token_ids)
    same = next((i for i, (a, b) in enumerate(zip(got, expected, strict=False)) if a != b), len(expected))
    return {
        "greedy_equal": got == expected,
        "bytes": len(expected),
        "first_difference": same,
        "load_s": round(loaded_s, 1),
        "architecture": context["architectures"][0],
    }


if __name__ == "__main__":
    print(json.dumps(main(Path(sys.argv[1]))), flush=True)
