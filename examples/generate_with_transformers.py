"""Sample text from a bardflow export's transformers folder with Hugging Face transformers
alone (no bardflow): the way any model on the Hub is used.

    pip install 'bardflow[hf]'   # or: pip install torch transformers
    python examples/generate_with_transformers.py STORE/export/KEY --prompt "ROMEO:" --bytes 100

The folder (the version folder, its ``export`` folder, or the ``hf`` folder inside that) holds
config.json (GPT-2 for learned positions, GPT-NeoX for rotary ones), model.safetensors,
tokenizer.json (byte-level: each id is a byte) and generation_config.json. The model saw
contexts of up to ``max_length`` bytes (generation_config.json): the prompt and the new bytes
together stay within it.
"""

import argparse
import sys
from pathlib import Path


def hf_folder(path: Path) -> Path:
    for candidate in (path, path / "hf", path / "export" / "hf"):
        if (candidate / "config.json").is_file() and (candidate / "tokenizer.json").is_file():
            return candidate
    raise SystemExit(f"generate_with_transformers: {path} holds no transformers folder (config.json and "
                     "tokenizer.json); pass STORE/export/KEY of a bardflow export")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--prompt", default="ROMEO:")
    parser.add_argument("--bytes", type=int, default=100, help="new bytes to sample")
    parser.add_argument("--temperature", type=float, default=0.8, help="0: greedy")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    from transformers import GenerationConfig, pipeline, set_seed

    folder = hf_folder(args.folder)
    room = GenerationConfig.from_pretrained(folder).max_length - len(args.prompt.encode())
    if not 0 < args.bytes <= room:
        raise SystemExit(f"generate_with_transformers: --bytes must be 1 to {room}: the model's context holds "
                         f"{room + len(args.prompt.encode())} bytes, the prompt included")
    set_seed(args.seed)
    generator = pipeline("text-generation", model=str(folder), device="cpu")
    sampled = {"do_sample": True, "temperature": args.temperature} if args.temperature > 0 else {"do_sample": False}
    (out,) = generator(args.prompt, max_new_tokens=args.bytes, min_new_tokens=args.bytes, **sampled)
    sys.stdout.write(out["generated_text"] + "\n")


if __name__ == "__main__":
    main()
