"""Sample text from a bardflow export folder with jax, numpy and safetensors alone.

    python examples/generate_from_export.py STORE/export/KEY/export --prompt "ROMEO:" --bytes 200

The folder holds model.safetensors (the weights by name), config.json and forward.jax (the
forward pass, serialized with jax.export, for any batch and any length up to max_seq_len).
Each new byte is sampled from the logits at the last position of the window; the window is
padded on the right to max_seq_len, which a causal model never looks at, so one compiled
shape serves every step.
"""

import argparse
import json
from pathlib import Path

import numpy as np
from jax import export
from safetensors.numpy import load_file


def generate(folder: Path, prompt: str, n_bytes: int, temperature: float, seed: int) -> bytes:
    params = load_file(str(folder / "model.safetensors"))
    forward = export.deserialize(bytearray((folder / "forward.jax").read_bytes()))
    context = json.loads((folder / "config.json").read_text())["max_seq_len"]
    rng = np.random.default_rng(seed)
    ids = list(prompt.encode())
    for _ in range(n_bytes):
        window = ids[-context:]
        padded = np.zeros((1, context), dtype=np.int32)
        padded[0, : len(window)] = window
        logits = np.asarray(forward.call(params, padded), dtype=np.float64)[0, len(window) - 1]
        if temperature == 0:
            ids.append(int(np.argmax(logits)))
            continue
        weights = np.exp((logits - logits.max()) / temperature)
        ids.append(int(rng.choice(len(weights), p=weights / weights.sum())))
    return bytes(ids)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--prompt", default="ROMEO:")
    parser.add_argument("--bytes", type=int, default=200)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(generate(args.folder, args.prompt, args.bytes, args.temperature, args.seed).decode("utf-8", "replace"))
