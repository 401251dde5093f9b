"""What the Prefect UI shows of each stage it built: tables and markdown made from the
version's figures and files, published by the flow's stage task once the stage has built
(``flows/pipeline.py``). The stages compute and record; this module presents."""

from __future__ import annotations

import json
from collections.abc import Callable

from ..artifacts.store import Version
from ..config.vocabulary import BYTE_VALUES
from ..model.data.sources import corpus_name
from ..model.data.splits import SHARD_BYTES
from ..tasks.registry import (
    CHECKPOINT,
    COMPARE,
    ENCODE,
    EXPORT,
    FETCH,
    GENERATE,
    HISTORY,
    TOKENIZE,
    TRAIN_PARALLEL,
    TRAIN_SINGLE,
    VERIFY,
)
from . import ui

SAMPLE_BYTES = 200


def publish(stage: str, version: Version, upstream: dict[str, Version]) -> None:
    """The UI artifacts of a version ``stage`` has just built."""
    page = PAGES.get(stage)
    if page is not None:
        page(version, upstream)


def _fetch(version: Version, upstream: dict[str, Version]) -> None:
    metrics, manifest = version.metrics, version.manifest
    files = manifest.get("source_files")
    ui.table(
        FETCH.name,
        [
            {
                "source": manifest.get("source"),
                "bytes": metrics["bytes"],
                "md5": metrics["md5"],
                "distinct byte values": metrics["distinct_bytes"],
                **({"files": files} if files is not None else {}),
            }
        ],
        description=f"Corpus fetched: {metrics['bytes']:,} bytes"
        + (f" from {files:,} files" if files is not None and files > 1 else "")
        + f", {metrics['distinct_bytes']} distinct byte values, md5 "
        + ("verified against the known checksum" if files is None else "computed from its files"),
    )


def _tokenize(version: Version, upstream: dict[str, Version]) -> None:
    metrics = version.metrics
    ui.table(
        TOKENIZE.name,
        [
            {"": "Vocabulary", "value": f"{metrics['vocab_size']:,} ids (the 256 bytes first)"},
            {"": "Made", "value": "trained on the training bytes" if metrics["trained"] else "read from a file"},
            {"": "Bytes per token, validation text", "value": metrics["val_bytes_per_token"]},
            {"": "Longest tokens", "value": " · ".join(repr(t) for t in metrics["longest"])},
        ],
        description=f"Byte-level BPE, {metrics['vocab_size']:,} ids, {metrics['val_bytes_per_token']} bytes a token",
    )
    pieces = " | ".join(metrics["line_in_tokens"])
    ui.markdown(TOKENIZE.name, f"A validation line in tokens:\n\n```\n{pieces}\n```\n", "A line", what="line")


def _encode(version: Version, upstream: dict[str, Version]) -> None:
    metrics, fetch = version.metrics, upstream["fetch"]
    shards = version.manifest.get("shards", {})
    distinct = fetch.metrics.get("distinct_bytes")
    tokens = "tokenize" in upstream
    vocabulary = f"{BYTE_VALUES} (raw bytes)" + (f", {distinct} of them in the corpus" if distinct is not None else "")
    ui.table(
        ENCODE.name,
        [
            {"": "Total bytes", "value": f"{metrics['bytes']:,}"},
            {
                "": "Vocabulary",
                "value": f"{metrics['vocab_size']:,} (a BPE's ids; {metrics['val_bytes_per_token']} bytes a token)"
                if tokens
                else vocabulary,
            },
            {"": "Sequence length", "value": metrics["seq_len"]},
            {"": "Training sequences", "value": f"{metrics['train_sequences']:,}"},
            {"": "Validation sequences", "value": f"{metrics['val_sequences']:,}"},
            {
                "": "Shards",
                "value": f"{len(shards.get('train', []))} train, {len(shards.get('val', []))} val "
                f"(at most {SHARD_BYTES >> 20} MiB each)",
            },
        ],
        description=f"{corpus_name(fetch.manifest.get('source', ''))}, "
        + ("BPE tokens" if tokens else "byte-level tokenization"),
    )
    with open(fetch.file(FETCH.builds[0]), "rb") as corpus:
        sample = corpus.read(SAMPLE_BYTES).decode("utf-8", errors="replace")
    ui.markdown(ENCODE.name, f"First {SAMPLE_BYTES} bytes:\n\n```\n{sample}\n```\n", "Corpus sample", what="sample")


def _train(version: Version, upstream: dict[str, Version]) -> None:
    stage, metrics = version.stage, version.metrics
    history = json.loads(version.file(HISTORY).read_text())
    rows = [
        {
            "step": h["step"],
            "loss": round(h["loss"], 4),
            "perplexity": round(h["perplexity"], 2),
            "val_loss": None if (val_loss := h["val_loss"]) is None else round(val_loss, 4),
            "tokens": h["tokens"],
            "seconds": h["seconds"],
        }
        for h in history
    ]
    ui.table(
        stage,
        rows,
        description=(
            f"{stage}: {metrics['tokens_per_s']:,.0f} tokens/s, {metrics['ms_per_step']:.1f} ms/step, "
            f"{metrics['devices']} device(s), global batch {metrics['global_batch']}, "
            f"val loss {metrics['val_loss']:.4f} ({metrics.get('val_bpb', float('nan')):.3f} bits/byte, whole split), "
            f"compile {metrics['compile_s']:.1f} s"
            + (f", MFU {100 * metrics['mfu']:.1f} % ({metrics['mfu_formula']})" if metrics.get("mfu") else "")
            + (f", resumed from step {metrics['resumed_from_step']}" if metrics.get("resumed_from_step") else "")
            + (
                f", the state of step {kept['step']} delivered ({kept['why']})"
                if (kept := metrics.get("kept")) and kept["step"] != metrics["steps"] - 1
                else ""
            )
            + (f", reused from {metrics['reused_from'][:12]}" if metrics.get("reused_from") else "")
        ),
    )
    tuning = metrics.get("cpu_tuning")
    if tuning:  # the CPU step's settings: the one used and what was measured (model/training/cpu_tuning.py)
        chosen = tuning["chosen"]
        measured = tuning["measured"] or [{**chosen, "ms_per_step": None}]
        ui.table(
            stage,
            [{**row, "used": all(row[k] == v for k, v in chosen.items())} for row in measured],
            description=f"{stage}: CPU step settings ({tuning['source']}): kernels {chosen['kernels']}, "
            f"{chosen['rows_per_pass']} rows per pass, XLA options {chosen['xla']}",
            what="cpu-step",
        )


def _compare(version: Version, upstream: dict[str, Version]) -> None:
    table, throughput_png, curves_png = (version.file(name) for name in COMPARE.builds)
    result = json.loads(table.read_text())
    note, devices = result["note"], result["devices"]
    ui.table(
        COMPARE.name,
        [dict(zip(result["header"], row, strict=True)) for row in result["rows"]],
        description=f"Throughput comparison: {result['speedup']:.2f}x tokens/s on {devices} device(s)"
        + (f". {note}" if note else ""),
    )
    ui.markdown(
        COMPARE.name,
        ui.markdown_table(result["header"], result["rows"])
        + (f"\n> {note}\n" if note else "")
        + "\n"
        + ui.png_markdown("Training throughput", throughput_png)
        + "\n"
        + ui.png_markdown("Training curves", curves_png),
        description="Throughput and training curves",
        what="plots",
    )


def _checkpoint(version: Version, upstream: dict[str, Version]) -> None:
    (model,) = CHECKPOINT.builds
    trained = upstream["train_parallel"].manifest.get("params", {})
    ui.table(
        CHECKPOINT.name,
        [
            {"": "Checkpoint", "value": f"{version.location}/{model}"},
            {"": "Parameters saved", "value": f"{version.metrics['parameters']:,}"},
            {"": "Size on disk", "value": f"{version.metrics['bytes'] / 1e6:.2f} MB"},
            {"": "Model config", "value": json.dumps(trained.get("model") if isinstance(trained, dict) else None)},
        ],
        description="Orbax checkpoint of the data-parallel model (parameters + model config)",
    )


def _export(version: Version, upstream: dict[str, Version]) -> None:
    from ..tasks.export import HF  # loaded already: the stage has just built

    folder, metrics = version.file(EXPORT.builds[0]), version.metrics
    hf = version.manifest.get("hf") or {}
    rows: list[dict[str, object]] = [
        {"file": p.name, "bytes": p.stat().st_size} for p in sorted(folder.iterdir()) if p.is_file()
    ]
    if (folder / HF).is_dir():
        rows += [{"file": f"{HF}/{p.name}", "bytes": p.stat().st_size} for p in sorted((folder / HF).iterdir())]
    rows.append({"file": f"{HF}/ (transformers)", "bytes": hf.get("status")})
    ui.table(
        EXPORT.name,
        rows,
        description=f"Export: safetensors + jax.export forward ({metrics['platforms'].replace(',', ', ')}), "
        f"checked without bardflow on {metrics.get('checked_on', 'this machine')}: max |diff| "
        f"{metrics['max_abs_diff']:.1e}; transformers folder: {hf.get('status')}",
    )


def _verify(version: Version, upstream: dict[str, Version]) -> None:
    verdict = json.loads(version.file(VERIFY.builds[0]).read_text())
    diff, passed = verdict["max_abs_diff"], verdict["passed"]
    rows, length = verdict["probe_shape"]
    seed = version.manifest.get("params", {})
    ui.markdown(
        VERIFY.name,
        f"## {'PASS' if passed else 'FAIL'}: restored logits {'match' if passed else 'differ'}\n\n"
        f"max |trained - restored| = **{diff:.3e}** (tolerance {verdict['tolerance']:.0e}) on a "
        f"probe batch of {rows} x {length} validation bytes; the fresh model was initialised with seed "
        f"{seed.get('init_seed') if isinstance(seed, dict) else '?'} before restoring.\n",
        description=f"Verify: {'pass' if passed else 'FAIL'}, max diff {diff:.2e}",
    )


def _generate(version: Version, upstream: dict[str, Version]) -> None:
    samples = json.loads(version.file(GENERATE.builds[0]).read_text())
    new_bytes = version.metrics["new_bytes"] // max(1, len(samples))
    ui.markdown(
        GENERATE.name,
        "\n".join(
            f"### Prompt `{s['prompt']}`, temperature {s['temperature']}\n\n```\n{s['text']}\n```\n" for s in samples
        ),
        description=f"{len(samples)} sample{'s' if len(samples) > 1 else ''} of {new_bytes} new bytes",
    )


PAGES: dict[str, Callable[[Version, dict[str, Version]], None]] = {
    FETCH.name: _fetch,
    TOKENIZE.name: _tokenize,
    ENCODE.name: _encode,
    TRAIN_SINGLE.name: _train,
    TRAIN_PARALLEL.name: _train,
    COMPARE.name: _compare,
    CHECKPOINT.name: _checkpoint,
    EXPORT.name: _export,
    VERIFY.name: _verify,
    GENERATE.name: _generate,
}
