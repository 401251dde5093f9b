"""Stage 2: bytes to token ids, fixed-length windows, a 90/10 split, a seeded
shuffle of the training windows, stored as memory-mappable Arrow IPC files."""

from __future__ import annotations

from model.config import DataConfig
from model.data import encode as encode_corpus
from model.data import write_sequences
from artifacts import ui
from artifacts.store import Builder
from tasks.fetch import CORPUS
from tasks.stage import Stage, inputs

STAGE = Stage(
    "encode",
    "1",
    key_params=lambda p: {"seq_len": p.seq_len, "train_fraction": p.train_fraction, "shuffle_seed": p.shuffle_seed},
)
TRAIN, VAL = "train.arrow", "val.arrow"


@STAGE.task
def encode(params: DataConfig, upstream: dict, store: str, force: bool = False) -> dict:
    corpus = inputs(store, upstream)["fetch"]

    def work(out: Builder) -> None:
        raw = corpus.file(CORPUS).read_bytes()
        split = encode_corpus(raw, params.seq_len, params.train_fraction, params.shuffle_seed)
        counts = {"train_sequences": len(split.train), "val_sequences": len(split.val)}
        for name, rows, part in ((TRAIN, split.train, "train"), (VAL, split.val, "val")):
            write_sequences(
                out.path(name),
                rows,
                {
                    "split": part,
                    "seq_len": str(params.seq_len),
                    "shuffle_seed": str(params.shuffle_seed),
                    "source_md5": corpus.metrics["md5"],
                    **{k: str(v) for k, v in counts.items()},
                },
            )
        out.metrics.update({"bytes": len(raw), "seq_len": params.seq_len, "vocab_size": 256, **counts})
        ui.table(
            STAGE.name,
            [
                {"": "Total bytes", "value": f"{len(raw):,}"},
                {"": "Vocabulary", "value": "256 (raw bytes)"},
                {"": "Sequence length", "value": params.seq_len},
                {"": "Training sequences", "value": f"{counts['train_sequences']:,}"},
                {"": "Validation sequences", "value": f"{counts['val_sequences']:,}"},
            ],
            description="TinyShakespeare, byte-level tokenization",
        )
        sample = raw[:200].decode("utf-8", errors="replace")
        ui.markdown(STAGE.name, f"First 200 bytes:\n\n```\n{sample}\n```\n", "Corpus sample", what="sample")

    return STAGE.produce(params, upstream, store, force, work)
