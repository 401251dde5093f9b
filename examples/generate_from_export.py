"""Sample text from a bardflow export folder with jax, numpy and safetensors alone.

    python examples/generate_from_export.py STORE/export/KEY --prompt "ROMEO:" --bytes 200

The folder (the version folder, or the ``export`` folder inside it) holds model.safetensors
(the weights by name), config.json, forward.jax (the forward pass, serialized with
jax.export, for any batch and any length up to max_seq_len) and checksums.json. Before it
samples, the script checks every file against its sha256 and the weights against the shapes
the forward pass was exported for: a damaged file or files of two exports are refused in one
line. Each new byte is sampled from the logits at the last position of the window; the window
is padded on the right to max_seq_len, which a causal model never looks at, so one compiled
shape serves every step.
"""

import argparse
import hashlib
import json
import sys
from pathlib import Path

import numpy as np

FILES = ("model.safetensors", "config.json", "forward.jax")


class ExportError(Exception):
    """The folder is not an intact export; the message says what is wrong and what to do."""


def export_folder(path: Path) -> Path:
    """The folder that holds the export's files: ``path`` itself or its ``export`` folder."""
    for folder in (path, path / "export"):
        if all((folder / name).is_file() for name in FILES):
            return folder
    raise ExportError(
        f"{path} holds no bardflow export (expected {', '.join(FILES)} in it or in {path}/export); "
        "give the path that `bardflow artifacts export` shows"
    )


def checksums(folder: Path) -> dict:
    """The sha256 of each file: the folder's checksums.json, or (an export written before it
    had one) the version's manifest one level up."""
    own, manifest = folder / "checksums.json", folder.parent / "manifest.json"
    if not own.is_file() and not manifest.is_file():
        raise ExportError(
            f"{folder} has no checksums.json: it cannot be checked; export it again (bardflow run --refresh export)"
        )
    try:
        if own.is_file():
            sums = json.loads(own.read_text())["sha256"]
        else:
            files = json.loads(manifest.read_text())["files"]
            sums = {
                name: files[f"{folder.name}/{name}"]["sha256"] for name in FILES if f"{folder.name}/{name}" in files
            }
        if not all(isinstance(name, str) and isinstance(digest, str) for name, digest in sums.items()):
            raise TypeError("a checksum that is not text")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        raise ExportError(
            f"{own if own.is_file() else manifest} is damaged ({type(error).__name__}: not the export's "
            "checksums); export it again (bardflow run --refresh export) or copy the whole folder"
        ) from None
    return sums


def verified(folder: Path):
    """The weights and the forward pass, once every file matches its checksum and the weights
    fit the forward pass."""
    import jax
    from jax import export
    from safetensors.numpy import load_file

    sums = checksums(folder)
    for name in FILES:
        digest = hashlib.sha256((folder / name).read_bytes()).hexdigest()
        if sums.get(name) != digest:
            raise ExportError(
                f"{folder / name} does not match its checksum (damaged, edited or from another "
                "export); export it again (bardflow run --refresh export) or copy the whole folder"
            )
    params = load_file(str(folder / "model.safetensors"))
    try:
        forward = export.deserialize(bytearray((folder / "forward.jax").read_bytes()))
    except Exception as error:  # noqa: BLE001 - any failure to load is one line
        raise ExportError(
            f"{folder / 'forward.jax'} cannot be loaded ({type(error).__name__}); export it again "
            "with this jax, or use the jax it was exported with"
        ) from None
    tokens = jax.ShapeDtypeStruct((1, 1), np.int32)
    _, tree = jax.tree.flatten(((params, tokens), {}))
    if tree != forward.in_tree:
        raise ExportError(
            f"{folder / 'forward.jax'} was exported for other weights than model.safetensors holds "
            f"({len(params)} tensors); the two files come from different exports"
        )
    for (name, array), aval in zip(sorted(params.items()), forward.in_avals[: len(params)], strict=True):
        if tuple(array.shape) != tuple(aval.shape) or np.dtype(array.dtype) != np.dtype(aval.dtype):
            raise ExportError(
                f"model.safetensors holds {name} as {array.dtype}{list(array.shape)}, where "
                f"forward.jax expects {aval.dtype}{list(aval.shape)}; the two files come from "
                "different exports"
            )
    return params, forward


def generate(folder: Path, prompt: str, n_bytes: int, temperature: float, seed: int) -> bytes:
    params, forward = verified(folder)
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
    parser.add_argument("folder", type=Path, help="the export's version folder, or the export folder in it")
    parser.add_argument("--prompt", default="ROMEO:")
    parser.add_argument("--bytes", type=int, default=200)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    try:
        text = generate(export_folder(args.folder), args.prompt, args.bytes, args.temperature, args.seed)
    except ExportError as error:
        sys.exit(f"error: {error}")
    print(text.decode("utf-8", "replace"))
