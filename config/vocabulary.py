"""What a token is, and so how many ids a model predicts: ``data.tokenizer``'s names, and the
vocabulary of each (bytes, a BPE to train, or a tokenizer file's), which the configuration
gives ``model.vocab_size``. Light to import: no tokenizer library, only the file's JSON."""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path
from typing import Any

BYTE_VALUES = 256  # the data is raw bytes: token ids 0..255
BYTES, BPE = "bytes", "bpe"  # data.tokenizer's names; anything else is a tokenizer.json's path


def tokenizer_vocab(tokenizer: str, vocab_size: int) -> int:
    """The token ids a model of ``data.tokenizer`` predicts: 256 bytes, ``data.vocab_size``,
    or a tokenizer file's vocabulary (read now: a missing file is refused in one line)."""
    if tokenizer == BYTES:
        return BYTE_VALUES
    if tokenizer == BPE:
        return vocab_size
    try:
        found = json.loads(Path(tokenizer).expanduser().read_text())
    except OSError as error:
        raise ValueError(
            f"data.tokenizer={tokenizer}: {error.strerror or error}; give bytes, bpe, or the path to a tokenizer.json"
        ) from None
    except ValueError:
        found = None
    ids = _ids(found)
    if not ids:
        raise ValueError(
            f"data.tokenizer={tokenizer} is not a tokenizer.json (no model vocabulary in it); give bytes, bpe, "
            "or the path to a byte-level BPE's tokenizer.json"
        )
    return max(ids) + 1  # every id the tokenizer can give


def _ids(found: Any) -> list[int]:
    """The ids of a tokenizer.json's model vocabulary and added tokens; none if it has no such."""
    model = found.get("model") if isinstance(found, dict) else None
    vocab = model.get("vocab") if isinstance(model, dict) else None
    if not isinstance(vocab, dict) or not vocab:
        return []
    ids = [*vocab.values(), *(token.get("id", 0) for token in found.get("added_tokens") or [])]
    return ids if all(isinstance(i, int) for i in ids) else []


def model_vocabulary(tree: Any, default_vocab_size: int) -> Any:
    """A configuration's tree (before validation) with ``model.vocab_size`` the tokenizer's;
    refused where it gives another. A bytes run's tree is returned as it is."""
    if not isinstance(tree, dict):
        return tree
    data, model = tree.get("data") or {}, tree.get("model") or {}
    read = (lambda name, default: data.get(name, default)) if isinstance(data, dict) else partial(getattr, data)
    tokenizer = read("tokenizer", BYTES)
    if tokenizer == BYTES or not isinstance(tokenizer, str):
        return tree
    vocab = tokenizer_vocab(tokenizer, read("vocab_size", default_vocab_size))
    given = model.get("vocab_size") if isinstance(model, dict) else model.vocab_size
    if given not in (None, BYTE_VALUES, vocab):
        raise ValueError(
            f"model.vocab_size={given} disagrees with data.tokenizer={tokenizer}'s {vocab} ids: the model's "
            "vocabulary follows the tokenizer; leave model.vocab_size out"
        )
    if isinstance(model, dict):
        return {**tree, "model": {**model, "vocab_size": vocab}}
    return {**tree, "model": model.model_copy(update={"vocab_size": vocab})}
