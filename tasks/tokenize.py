"""Stage 1b (where ``data.tokenizer`` is not ``bytes``): the tokenizer every later stage reads.

``bpe``: a byte-level BPE trained on the corpus's training bytes (the bytes before the
validation split's first, as a bytes run cuts them: the tokenizer never reads the validation
text), on all of them up to 64 MiB, beyond that on 64 evenly spaced blocks of 1 MiB
(``model/data/tokenizer.py``). A path: that ``tokenizer.json``, held to a round trip of every
byte value. Either way the version holds ``tokenizer.json`` and its figures: the vocabulary,
bytes per token on the validation text, the longest tokens and a line split into tokens."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..artifacts.store import Builder, Version
from ..config.settings import DataConfig
from ..config.vocabulary import BPE
from ..model.data.splits import training_bytes
from ..model.data.tokenizer import TOKENIZER_FILE, BpeTokenizer, TokenizerError, training_sample
from . import report
from .fetch import CORPUS
from .registry import TOKENIZE

FIGURED_BYTES = 8 << 20  # bytes per token measured on at most this much of the validation text


def build(settings: DataConfig, out: Builder, fetch: Version) -> None:
    corpus = fetch.file(CORPUS)
    data = np.memmap(corpus, np.uint8, mode="r")
    cut = training_bytes(len(data), settings.seq_len, settings.train_fraction, settings.every_position)
    with report.progress(TOKENIZE.name, 1, "tokenizer") as progress:
        if settings.tokenizer == BPE:
            tokenizer = BpeTokenizer.train(training_sample(data[:cut]), settings.vocab_size)
        else:
            tokenizer = BpeTokenizer.load(Path(settings.tokenizer).expanduser())
        progress(1)
    tokenizer.save(out.path(TOKENIZER_FILE))
    val = bytes(data[cut : cut + FIGURED_BYTES])
    ids = tokenizer.encode(val)
    line = next((text for text in val.split(b"\n") if len(text) > 20), val[:80])[:120]
    out.metrics.update(
        {
            "vocab_size": tokenizer.vocab_size,
            "trained": settings.tokenizer == BPE,
            "training_bytes": cut,
            "val_bytes_per_token": round(len(val) / max(1, len(ids)), 4),
            "longest": [piece.decode("utf-8", errors="replace") for piece in tokenizer.longest(10)],
            "line_in_tokens": [tokenizer.decode([i]).decode("utf-8", errors="replace") for i in tokenizer.encode(line)],
        }
    )


def load(tokenize: Version) -> BpeTokenizer:
    """The tokenizer of a tokenize version."""
    return BpeTokenizer.load(tokenize.file(TOKENIZER_FILE))


def for_model(tokenize: Version | None, vocab_size: int) -> BpeTokenizer | None:
    """The tokenizer of a model of ``vocab_size`` ids trained on ``tokenize``'s ids (None: a
    bytes run's, which has none); TokenizerError (one line) where the two cannot belong together."""
    if tokenize is None:
        return None
    tokenizer = load(tokenize)
    if tokenizer.vocab_size != vocab_size:
        raise TokenizerError(
            f"this model predicts {vocab_size} ids and its tokenizer has {tokenizer.vocab_size}: they were not "
            "trained together; use the tokenizer of the run that trained the model"
        )
    return tokenizer
