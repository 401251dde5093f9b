"""Sample text from a bardflow export's transformers folder with Hugging Face transformers
alone (no bardflow): the way any model on the Hub is used.

    pip install 'bardflow[hf]'   # or: pip install torch transformers
    python examples/generate_with_transformers.py STORE/export/KEY --prompt "ROMEO:" --bytes 100

The folder (the version folder, its ``export`` folder, or the ``hf`` folder inside that) holds
config.json (GPT-2 for learned positions, GPT-NeoX for rotary ones), model.safetensors,
tokenizer.json (byte-level: each id is a byte) and generation_config.json. The model saw
contexts of up to ``model_max_length`` bytes (tokenizer_config.json): the prompt and the new
bytes together stay within it (by default, as many as fit, up to 100).

Before transformers reads anything, every file of the transformers folder is checked against
the export's checksums.json (a damaged, edited or added file is refused), and a config that
asks for code from elsewhere (``auto_map``, ``trust_remote_code``) is refused whatever its
checksum says: this folder's model is plain GPT-2 or GPT-NeoX, whose code transformers has.
"""

import argparse
import hashlib
import json
import sys
from pathlib import Path

REMOTE_CODE = ("auto_map", "trust_remote_code", "custom_pipelines")


def hf_folder(path: Path) -> Path:
    for candidate in (path, path / "hf", path / "export" / "hf"):
        if (candidate / "config.json").is_file() and (candidate / "tokenizer.json").is_file():
            return candidate
    raise SystemExit(
        f"generate_with_transformers: {path} holds no transformers folder (config.json and "
        "tokenizer.json); pass STORE/export/KEY of a bardflow export"
    )


def check(folder: Path) -> None:
    """Every file of ``folder`` as the export's checksums.json (one level up) says, no file
    more, and a config that names no code of its own."""
    sums_file = folder.parent / "checksums.json"
    if not sums_file.is_file():
        raise SystemExit(
            f"generate_with_transformers: {folder} has no checksums.json beside it, so its files cannot "
            "be checked; pass the whole export folder (STORE/export/KEY), as bardflow wrote it"
        )
    prefix = f"{folder.name}/"
    try:
        sums = json.loads(sums_file.read_text())["sha256"]
        expected = {name[len(prefix) :]: str(digest) for name, digest in sums.items() if name.startswith(prefix)}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        raise SystemExit(
            f"generate_with_transformers: {sums_file} is damaged ({type(error).__name__}: not the export's "
            "checksums); export it again (bardflow run --refresh export) or copy the whole folder"
        ) from None
    found = {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}
    if not expected:
        raise SystemExit(
            f"generate_with_transformers: {sums_file} lists no file of {folder.name}/ (an export "
            "written before it did); export it again (bardflow run --refresh export)"
        )
    for name in sorted(found | set(expected)):
        file = folder / name
        digest = hashlib.sha256(file.read_bytes()).hexdigest() if name in found else None
        if digest != expected.get(name):
            what = (
                "is not part of the export"
                if name not in expected
                else "is missing"
                if digest is None
                else "does not match its checksum (damaged, edited or from another export)"
            )
            raise SystemExit(
                f"generate_with_transformers: {file} {what}; export it again (bardflow run "
                "--refresh export) or copy the whole folder"
            )
    config = json.loads((folder / "config.json").read_text())
    asked = [key for key in REMOTE_CODE if key in config]
    if asked:
        raise SystemExit(
            f"generate_with_transformers: {folder / 'config.json'} asks for code from elsewhere "
            f"({', '.join(asked)}); a bardflow export never does, so this folder is not one"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--prompt", default="ROMEO:")
    parser.add_argument(
        "--bytes",
        type=int,
        default=None,
        help="new bytes to sample (default: up to 100, as the model's context allows)",
    )
    parser.add_argument("--temperature", type=float, default=0.8, help="0: greedy")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    folder = hf_folder(args.folder)
    check(folder)
    from transformers import pipeline, set_seed
    from transformers.utils import logging as transformers_logging

    # The sample alone on stdout and stderr: no weight-loading bar.
    transformers_logging.set_verbosity_error()
    transformers_logging.disable_progress_bar()

    context = json.loads((folder / "tokenizer_config.json").read_text())["model_max_length"]
    room = context - len(args.prompt.encode())
    n_bytes = min(100, room) if args.bytes is None else args.bytes
    if not 0 < n_bytes <= room:
        raise SystemExit(
            f"generate_with_transformers: --bytes must be 1 to {room}: the model's context holds "
            f"{room + len(args.prompt.encode())} bytes, the prompt included"
        )
    set_seed(args.seed)
    generator = pipeline("text-generation", model=str(folder), device="cpu", trust_remote_code=False)
    sampled = {"do_sample": True, "temperature": args.temperature} if args.temperature > 0 else {"do_sample": False}
    (out,) = generator(args.prompt, max_new_tokens=n_bytes, min_new_tokens=n_bytes, **sampled)
    sys.stdout.write(out["generated_text"] + "\n")


if __name__ == "__main__":
    main()
