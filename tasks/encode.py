"""Stage 2: bytes to token ids, fixed-length windows, a 90/10 split, a seeded
shuffle of the training windows, stored as memory-mappable Arrow IPC files."""

from __future__ import annotations

from ..artifacts import ui
from ..artifacts.store import Builder, Version
from ..model.config import BYTE_VALUES, DataConfig
from ..model.data import encode, write_sequences
from .fetch import CORPUS
from .registry import ENCODE
from .sources import corpus_name

TRAIN, VAL = ENCODE.builds


def build(settings: DataConfig, out: Builder, fetch: Version) -> None:
    raw = fetch.file(CORPUS).read_bytes()
    split = encode(raw, settings.seq_len, settings.train_fraction, settings.shuffle_seed, settings.every_position)
    counts = {"train_sequences": len(split.train), "val_sequences": len(split.val)}
    for name, rows, part in ((TRAIN, split.train, "train"), (VAL, split.val, "val")):
        write_sequences(
            out.path(name),
            rows,
            {
                "split": part,
                "seq_len": str(settings.seq_len),
                "shuffle_seed": str(settings.shuffle_seed),
                "source_md5": fetch.metrics["md5"],
                **{k: str(v) for k, v in counts.items()},
            },
        )
        # The windows are the corpus's bytes: readable by no one its stored copy keeps out.
        out.path(name).chmod(fetch.file(CORPUS).stat().st_mode & 0o666 | 0o600)
    out.metrics.update({"bytes": len(raw), "seq_len": settings.seq_len, "vocab_size": BYTE_VALUES, **counts})
    ui.table(
        ENCODE.name,
        [
            {"": "Total bytes", "value": f"{len(raw):,}"},
            {"": "Vocabulary", "value": f"{BYTE_VALUES} (raw bytes)"},
            {"": "Sequence length", "value": settings.seq_len},
            {"": "Training sequences", "value": f"{counts['train_sequences']:,}"},
            {"": "Validation sequences", "value": f"{counts['val_sequences']:,}"},
        ],
        description=f"{corpus_name(fetch.manifest.get('source', ''))}, byte-level tokenization",
    )
    sample = raw[:200].decode("utf-8", errors="replace")
    ui.markdown(ENCODE.name, f"First 200 bytes:\n\n```\n{sample}\n```\n", "Corpus sample", what="sample")
