"""What a served model's tokens are: bytes (a byte model's 256, each its own value) or a
tokenizer's ids, each standing for a string of bytes (its piece). The engine draws ids and
hands on their bytes; the API counts ``max_tokens``, the usage and ``logprobs`` in ids and
decodes the bytes to text, a character once all its bytes are in."""

from __future__ import annotations

import codecs
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from ..model.data.tokenizer import BpeTokenizer


@dataclass(frozen=True)
class Vocabulary:
    pieces: tuple[bytes, ...]  # each id's bytes
    tokenizer: BpeTokenizer | None = None  # None: a byte model's

    @classmethod
    def of(cls, tokenizer: BpeTokenizer | None) -> Vocabulary:
        return BYTES if tokenizer is None else cls(tuple(tokenizer.pieces), tokenizer)

    @property
    def size(self) -> int:
        return len(self.pieces)

    @property
    def kind(self) -> str:
        return "bytes" if self.tokenizer is None else "bpe"

    @property
    def unit(self) -> str:
        """What a length counts, in messages: bytes, or tokens."""
        return "bytes" if self.tokenizer is None else "tokens"

    def encode(self, data: bytes) -> list[int]:
        return list(data) if self.tokenizer is None else self.tokenizer.encode(data).tolist()

    def decode(self, ids: Iterable[int]) -> bytes:
        return b"".join(self.pieces[int(i)] for i in ids)

    def name(self, index: int) -> str:
        """An id as OpenAI's API names a token: its text, or ``bytes:\\xNN...`` where its bytes
        are no whole characters."""
        piece = self.pieces[index]
        try:
            return piece.decode()
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{byte:02x}" for byte in piece)

    def offsets(self, ids: Iterable[int]) -> list[int]:
        """Where each id's text starts in the text of ``ids``, in characters (a character split
        between ids counts where its last byte is)."""
        decoder, chars, found = codecs.getincrementaldecoder("utf-8")(errors="replace"), 0, []
        for index in ids:
            found.append(chars)
            chars += len(decoder.decode(self.pieces[int(index)]))
        return found


def as_ids(text: bytes | list[int] | np.ndarray) -> np.ndarray:
    """A text's ids: a byte model's bytes, or the ids given."""
    if isinstance(text, bytes | bytearray):
        return np.frombuffer(text, np.uint8).astype(np.int32)
    return np.asarray(text, np.int32)


BYTES = Vocabulary(tuple(bytes([value]) for value in range(256)))
