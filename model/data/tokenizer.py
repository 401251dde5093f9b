"""A byte-level BPE tokenizer (Hugging Face's ``tokenizers``, in Rust) fitted to a corpus:
trained on a bounded sample of the training bytes, it turns any byte sequence into token ids
and back, exactly.

Every byte is first mapped to GPT-2's printable stand-in for it (``byte_alphabet``): the
vocabulary starts from those 256 symbols, so no byte is ever unknown, and a corpus that is
not UTF-8 round-trips too. The mapped text is split into pieces (a word with the space
before it, a run of digits, a run of other symbols, a run of blanks) that no merge crosses,
then BPE merges the pairs it learned. Encoding cuts a large corpus into chunks where a piece
ends (after a newline followed by neither a blank nor a newline), so that the chunks' tokens
are the whole text's, and encodes them side by side on the host's cores."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np

from ...errors import BardflowError

SMALLEST_VOCAB = 257  # the 256 bytes and at least one merge
LARGEST_VOCAB = 1 << 20
SAMPLE_BYTES = 64 << 20  # what BPE is trained on at most: evenly spaced blocks of the training bytes
SAMPLE_BLOCK = 1 << 20
CHUNK_BYTES = 1 << 20  # what one encoding task takes
TOKENIZER_FILE = "tokenizer.json"


class TokenizerError(BardflowError, ValueError):
    """A tokenizer that cannot serve: the message names why and what to do."""


def byte_alphabet() -> list[str]:
    """GPT-2's printable stand-in for each byte 0..255 (its ``bytes_to_unicode``): a byte-level
    tokenizer's vocabulary, with each byte's id its value."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted, extra = {}, 0
    for byte in range(256):
        if byte in kept:
            shifted[byte] = byte
        else:
            shifted[byte] = 256 + extra
            extra += 1
    return [chr(shifted[byte]) for byte in range(256)]


_ALPHABET = byte_alphabet()
_TO_BYTE = {char: byte for byte, char in enumerate(_ALPHABET)}
_BLANKS = "".join(_ALPHABET[b] for b in b" \n\t\r")
# The pieces no merge crosses, over the mapped text: a word with the space before it, up to
# three digits with it, a run of other symbols with it, a run of blanks.
_SPACE = _ALPHABET[ord(" ")]
PIECES = rf"{_SPACE}?[A-Za-z]+|{_SPACE}?[0-9]{{1,3}}|{_SPACE}?[^A-Za-z0-9{_BLANKS}]+|[{_BLANKS}]+"


_CODE_POINTS = np.array([ord(char) for char in _ALPHABET], np.uint32)


def mapped(data: bytes) -> str:
    """``data`` as the tokenizer reads it: each byte its stand-in (looked up as code points and
    read as UTF-32: about twice ``str.translate``'s speed)."""
    return _CODE_POINTS[np.frombuffer(data, np.uint8)].tobytes().decode("utf-32-le")


def unmapped(text: str) -> bytes:
    """The bytes a piece of mapped text stands for."""
    return bytes(_TO_BYTE[char] for char in text)


def _new(vocab: dict[str, int] | None = None, merges: list[tuple[str, str]] | None = None):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges) if vocab is not None else models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(PIECES), behavior="isolated")
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


class BpeTokenizer:
    """Token ids for bytes and back, through a trained byte-level BPE."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = tokenizer.get_vocab_size()
        vocab = tokenizer.get_vocab()
        # Each id's bytes, for decoding without a detour through UTF-8.
        self.pieces = [b""] * self.vocab_size
        for text, index in vocab.items():
            self.pieces[index] = unmapped(text)

    @classmethod
    def train(cls, sample: Iterable[bytes], vocab_size: int) -> BpeTokenizer:
        """BPE trained on ``sample``'s blocks to ``vocab_size`` ids (the 256 bytes first, each
        its own value); TokenizerError where the sample cannot fill that many."""
        from tokenizers import trainers

        check_vocab_size(vocab_size)
        tokenizer = _new()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size, initial_alphabet=_ALPHABET, show_progress=False, min_frequency=2
        )
        tokenizer.train_from_iterator((mapped(block) for block in sample), trainer=trainer)
        found = tokenizer.get_vocab_size()
        if found < vocab_size:
            raise TokenizerError(
                f"data.vocab_size={vocab_size} is more than this corpus can fill: its training bytes give "
                f"{found} tokens that occur twice or more; set data.vocab_size to at most {found}"
            )
        made = cls(tokenizer)
        made.check_bytes()
        return made

    @classmethod
    def load(cls, path: Path) -> BpeTokenizer:
        """A ``tokenizer.json`` (this module's, or a byte-level one of Hugging Face's with the
        same byte alphabet), held to a round trip of every byte value; TokenizerError else."""
        from tokenizers import Tokenizer

        try:
            found = Tokenizer.from_file(str(path))
        except Exception as error:  # noqa: BLE001 - the library's own errors name the problem
            raise TokenizerError(f"{path} is not a tokenizer.json tokenizers can read: {error}") from None
        model = json.loads(found.model.__getstate__())  # type: ignore[attr-defined]
        if model.get("type") != "BPE" or any(char not in model.get("vocab", {}) for char in _ALPHABET):
            raise TokenizerError(
                f"{path} is not a byte-level BPE whose vocabulary holds every byte's symbol, so some bytes "
                "could not be encoded; give a byte-level BPE (GPT-2's kind) or use data.tokenizer=bpe"
            )
        vocab = model["vocab"]
        merges = [_pair(m) for m in model.get("merges", [])]
        made = cls(_new(vocab, merges))
        made.check_bytes()
        return made

    def check_bytes(self) -> None:
        """Every byte value, and a mixed line, come back as they went in."""
        probe = bytes(range(256)) + b"ROMEO:\n  O, she doth teach the torches to burn bright! 1234\r\n\xff\xfe"
        if self.decode(self.encode(probe)) != probe:
            raise TokenizerError("this tokenizer does not give every byte back as it was; use data.tokenizer=bpe")

    def encode(self, data: bytes) -> np.ndarray:
        """``data``'s ids. Over ``CHUNK_BYTES``, in chunks encoded side by side (the library's
        threads), cut where the tokens are the whole text's (``chunk_ends``)."""
        if len(data) <= CHUNK_BYTES:
            return np.asarray(self.tokenizer.encode(mapped(data)).ids, self.dtype)
        ends = chunk_ends(np.frombuffer(data, np.uint8))
        texts = [mapped(data[start:stop]) for start, stop in zip([0, *ends[:-1]], ends, strict=True)]
        encoded = self.tokenizer.encode_batch_fast(texts)  # no offsets: faster
        return np.concatenate([np.asarray(e.ids, self.dtype) for e in encoded])

    def decode(self, ids: Iterable[int]) -> bytes:
        return b"".join(self.pieces[int(i)] for i in ids)

    @property
    def dtype(self) -> type[np.unsignedinteger]:
        """The narrowest id type: uint16 up to 65,536 ids, uint32 beyond."""
        return np.uint16 if self.vocab_size <= 1 << 16 else np.uint32

    def save(self, path: Path) -> None:
        self.tokenizer.save(str(path))

    def for_text(self):
        """The same tokenizer as Hugging Face's libraries use it on text: each UTF-8 byte mapped
        to its symbol first (``ByteLevel`` without its own splitting), then the same pieces and
        merges, so that ``AutoTokenizer`` gives a text the ids this one gives its bytes."""
        from tokenizers import Regex, Tokenizer, decoders, pre_tokenizers

        text = Tokenizer.from_str(self.tokenizer.to_str())
        text.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
                pre_tokenizers.Split(Regex(PIECES), behavior="isolated"),
            ]
        )
        text.decoder = decoders.ByteLevel()
        return text

    def longest(self, count: int = 10) -> list[bytes]:
        return sorted(self.pieces, key=len, reverse=True)[:count]


def _pair(merge: str | list[str]) -> tuple[str, str]:
    """A merge as tokenizer.json writes it: "a b" (older files), or ["a", "b"]."""
    first, second = merge.split(" ", 1) if isinstance(merge, str) else merge
    return first, second


def check_vocab_size(vocab_size: int) -> None:
    if not SMALLEST_VOCAB <= vocab_size <= LARGEST_VOCAB:
        raise TokenizerError(
            f"data.vocab_size={vocab_size} is outside {SMALLEST_VOCAB}..{LARGEST_VOCAB:,}: the 256 bytes and at least "
            "one merge; 4096 is the default"
        )


def training_sample(data: np.ndarray, limit: int = SAMPLE_BYTES, block: int = SAMPLE_BLOCK) -> Iterator[bytes]:
    """What BPE is trained on: ``data`` whole (the training split's bytes) where it holds at
    most ``limit`` bytes, else ``limit // block`` blocks of ``block`` bytes evenly spaced over
    it, the first at its start: the same sample for the same bytes, in constant memory."""
    if len(data) <= limit:
        for start in range(0, len(data), block):
            yield bytes(data[start : start + block])
        return
    count = limit // block
    stride = (len(data) - block) / max(1, count - 1)
    for index in range(count):
        start = round(index * stride)
        yield bytes(data[start : start + block])


def chunk_ends(data: np.ndarray, size: int = CHUNK_BYTES) -> list[int]:
    """Where ``data`` may be cut into chunks of about ``size`` bytes whose tokens are the whole
    text's: after a newline that neither a blank nor a newline follows, where a piece ends
    and the next one does not start with a space. A chunk with no such place grows until one."""
    ends, start = [], 0
    blanks = np.frombuffer(b" \n\t\r", np.uint8)
    while len(data) - start > size:
        at = start + size
        found = None
        while found is None and at < len(data) - 1:
            window = data[at : min(len(data) - 1, at + size)]
            newlines = np.flatnonzero(window == ord("\n"))
            for offset in newlines:
                after = data[at + offset + 1]
                if after not in blanks:
                    found = at + int(offset) + 1
                    break
            at += len(window)
        if found is None:
            break
        ends.append(found)
        start = found
    ends.append(len(data))
    return ends


def encode_to_file(
    tokenizer: BpeTokenizer, data: np.ndarray, path: Path, progress: Callable[[int], None] = lambda done: None
) -> int:
    """``data``'s ids, written to ``path`` in the tokenizer's id type, a few chunks per core at
    a time (memory stays a few MiB whatever ``data``'s size); the ids written. ``progress``
    hears the bytes encoded so far."""
    ends = chunk_ends(data)
    spans = list(zip([0, *ends[:-1]], ends, strict=True))
    at_once = 4 * (os.cpu_count() or 1)
    groups = [spans[first : first + at_once] for first in range(0, len(spans), at_once)]
    written = 0

    def write(encoded: Future, end: int) -> None:
        nonlocal written
        for encoding in encoded.result():
            ids = np.asarray(encoding.ids, tokenizer.dtype)
            handle.write(ids.tobytes())
            written += len(ids)
        progress(end)

    # The library encodes a group on every core without Python's lock; meanwhile this thread
    # maps the next group's bytes and writes the last group's ids (the serial part, which
    # otherwise left the cores idle).
    with open(path, "wb") as handle, ThreadPoolExecutor(1, "bardflow-encode") as encoder:
        pending: tuple[Future, int] | None = None
        for group in groups:
            texts = [mapped(bytes(data[start:stop])) for start, stop in group]
            encoded = encoder.submit(tokenizer.tokenizer.encode_batch_fast, texts)
            if pending is not None:
                write(*pending)
            pending = (encoded, group[-1][1])
        if pending is not None:
            write(*pending)
    return written
