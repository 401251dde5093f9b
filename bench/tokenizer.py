"""``python -m bench.tokenizer [--encode-mib N] [--train-s S] [--vocabs 1024,4096,16384]``:
what a tokenizer costs and what it buys, on this machine.

Encoding: a byte-level BPE of 4,096 ids (trained on TinyShakespeare's training bytes) encodes
a corpus of ``--encode-mib`` MiB (TinyShakespeare repeated, written to a temporary file) the
way the encode stage does (``encode_to_file``: chunks on the host's cores, ids to a file):
MB/s, and the process's own memory at its peak while encoding against the corpus's size.

Training: the preset (``--preset``, default ``cpu``) on a corpus (``--corpus``: TinyShakespeare,
or ``python-sources``: this Python's standard library, every ``.py`` file in path order, about
30 MB that every machine with Python has, for a corpus a run does not repeat) with bytes and with
a BPE of each vocabulary, each trained for the same ``--train-s`` seconds (its steps from a
measured step time), and the validation text's bits per byte of each: the measure that
compares tokenizers (a loss per token divided by the bytes a token holds). The split is cut
where a bytes run cuts it, so every tokenizer is evaluated on the same text. Writes
``<date>-<backend>-tokenizer[-<corpus>].json`` under ``--out``."""

from __future__ import annotations

import argparse
import hashlib
import math
import sysconfig
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from bench.report import RESULTS, SHARED_CORPUS, machine, write_report


def anonymous_bytes() -> int:
    """The process's anonymous resident memory (``RssAnon``): what it holds itself."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) << 10
    return -1  # not told (a sandbox's /proc)


class PeakAnonymous:
    """The most ``anonymous_bytes`` while the block runs, sampled every 50 ms on a thread."""

    def __enter__(self) -> PeakAnonymous:
        self.bytes, self.done = anonymous_bytes(), threading.Event()
        self.thread = threading.Thread(target=self._watch, daemon=True)
        self.thread.start()
        return self

    def _watch(self) -> None:
        while not self.done.wait(0.05):
            self.bytes = max(self.bytes, anonymous_bytes())

    def __exit__(self, *exc) -> None:
        self.done.set()
        self.thread.join()


def encoding(corpus: Path, mib: int) -> dict:
    from bardflow.model.data.splits import training_bytes
    from bardflow.model.data.tokenizer import BpeTokenizer, encode_to_file, training_sample

    data = np.fromfile(corpus, np.uint8)
    started = time.perf_counter()
    tokenizer = BpeTokenizer.train(training_sample(data[: training_bytes(len(data), 256, 0.9)]), 4096)
    trained_s = time.perf_counter() - started
    with tempfile.TemporaryDirectory() as scratch:
        big = Path(scratch) / "corpus.txt"
        with open(big, "wb") as out:
            for _ in range(math.ceil((mib << 20) / len(data))):
                out.write(data.tobytes())
        size = big.stat().st_size
        before = anonymous_bytes()
        with PeakAnonymous() as peak:
            started = time.perf_counter()
            count = encode_to_file(tokenizer, np.memmap(big, np.uint8, mode="r"), Path(scratch) / "ids")
            seconds = time.perf_counter() - started
    return {
        "vocab_size": 4096,
        "bpe_trained_s_on_1mb": round(trained_s, 2),
        "corpus_bytes": size,
        "tokens": count,
        "bytes_per_token": round(size / count, 4),
        "seconds": round(seconds, 2),
        "mb_per_s": round(size / seconds / 1e6, 2),
        # The process's own memory (anonymous pages), not the corpus's pages the map brings in
        # (the page cache's, dropped under pressure), before and at most while encoding.
        "anonymous_mib_before": round(before / 2**20, 1) if before >= 0 else None,
        "anonymous_mib_peak": round(peak.bytes / 2**20, 1) if before >= 0 else None,
    }


def python_sources() -> np.ndarray:
    """The standard library's Python sources, concatenated in path order: a corpus of about
    30 MB that needs no download (the same files wherever the same Python runs)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(path for path in root.rglob("*.py") if "site-packages" not in path.parts)
    return np.frombuffer(b"".join(path.read_bytes() for path in files), np.uint8)


def corpus_bytes(corpus: str) -> tuple[np.ndarray, dict]:
    """The training corpus's bytes and what identifies it (``--corpus``)."""
    data = python_sources() if corpus == "python-sources" else np.fromfile(corpus, np.uint8)
    name = corpus if corpus == "python-sources" else Path(corpus).name
    return data, {"corpus": name, "bytes": len(data), "md5": hashlib.md5(data.tobytes()).hexdigest()}


def token_split(data: np.ndarray, cfg, vocab: int | None):
    """(train rows, val rows, bytes per token of the validation text, vocabulary) for bytes
    (``vocab`` None) or a BPE of ``vocab`` ids trained on the training bytes."""
    from bardflow.model.data.splits import train_order, training_bytes, windows
    from bardflow.model.data.tokenizer import BpeTokenizer, training_sample

    cut = training_bytes(len(data), cfg.data.seq_len, cfg.data.train_fraction, cfg.data.every_position)
    if vocab is None:
        train, val, per_token, size = data[:cut], data[cut:], 1.0, 256
    else:
        tokenizer = BpeTokenizer.train(training_sample(data[:cut]), vocab)
        train, val = tokenizer.encode(data[:cut].tobytes()), tokenizer.encode(data[cut:].tobytes())
        per_token, size = (len(data) - cut) / len(val), tokenizer.vocab_size
    rows = windows(train, cfg.data.seq_len, cfg.data.every_position)
    shuffled = np.asarray(rows)[np.asarray(train_order(len(rows), cfg.data.shuffle_seed)[0 : len(rows)])]
    return shuffled, np.asarray(windows(val, cfg.data.seq_len, cfg.data.every_position)), per_token, size


def trained_for(preset: str, data: np.ndarray, vocab: int | None, seconds: float, probe_steps: int) -> dict:
    """The preset trained for about ``seconds`` with this tokenizer: after a warm-up run, a
    probe of ``probe_steps`` steps measures a step, then a run of as many steps as fit. Every
    run logs at the preset's intervals, so each takes as many steps a compiled call as the
    others (``steps_per_call``'s auto divides them)."""
    import jax

    from bardflow.config.settings import TrainingRequest, build_config
    from bardflow.model.data.splits import write_split
    from bardflow.model.training.training_run import RunFiles, run_training

    settings = {} if vocab is None else {"data.tokenizer": "bpe", "data.vocab_size": vocab}
    cfg = build_config(preset, settings)
    train, val, per_token, size = token_split(data, cfg, vocab)
    devices = jax.devices()
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch)
        write_split(folder / "train", train, {})
        write_split(folder / "val", val, {})

        def run(steps: int, name: str):
            train_cfg = cfg.train.model_copy(
                update={
                    "steps": steps,
                    "warmup_steps": min(cfg.train.warmup_steps, steps // 10),
                    "eval_every": 0,
                    "single_device_steps": 0,
                }
            )
            request = TrainingRequest(
                model=cfg.model,
                train=train_cfg,
                devices=len(devices),
                platform=devices[0].platform,
                bytes_per_token=per_token,
            )
            files = RunFiles(folder / "train", folder / "val", folder / f"resume-{name}", folder / f"state-{name}")
            return run_training(request, files, devices, parallel=True)

        # A probe's time a step, its first calls included, sets the run's length: the
        # difference of two probes undercounted a TPU's step by half (2026-12-07), which ran a
        # run twice as long as asked; this errs short instead, alike for every tokenizer.
        run(probe_steps, "warm-up")  # a process's first run pays more than the others (a TPU's)
        per_step = run(probe_steps, "probe").metrics["elapsed_s"] / probe_steps
        steps = max(probe_steps, int(seconds / per_step))
        found = run(steps, "run").metrics
    return {
        "tokenizer": "bytes" if vocab is None else f"bpe-{vocab}",
        "vocab_size": size,
        "val_bytes_per_token": round(per_token, 4),
        "steps": steps,
        "training_s": found["elapsed_s"],
        "ms_per_step": found["ms_per_step"],
        "val_loss_per_token": found["val_loss"],
        "val_bpb": found["val_bpb"],
        "train_rows": len(train),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.tokenizer", description=__doc__)
    parser.add_argument(
        "--corpus",
        default=str(SHARED_CORPUS),
        help="a local copy of TinyShakespeare (the default), or python-sources for training (a larger corpus)",
    )
    parser.add_argument("--encode-mib", type=int, default=1024, help="the corpus encoded (default 1 GiB); 0: skip")
    parser.add_argument("--preset", default="cpu")
    parser.add_argument("--vocabs", default="1024,4096,16384", help="the BPE vocabularies trained beside bytes")
    parser.add_argument("--train-s", type=float, default=60.0, help="seconds of training each (0: skip)")
    parser.add_argument("--probe-steps", type=int, default=60)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    from bardflow.flows.environment import prepare_environment
    from bardflow.model.data.tokenizer import TokenizerError

    prepare_environment()
    report: dict = {"machine": machine()}
    flat: dict = {}
    if args.encode_mib:
        report["encoding"] = found = encoding(Path(args.corpus), args.encode_mib)
        flat |= {"encode_mb_per_s": found["mb_per_s"], "encode_anonymous_mib_peak": found["anonymous_mib_peak"]}
    named = "" if args.corpus == str(SHARED_CORPUS) else f"-{Path(args.corpus).stem}"
    name = f"tokenizer-{args.preset}{named}" if args.train_s else "tokenizer-encode"
    if args.train_s:
        data, corpus = corpus_bytes(args.corpus)
        runs: list[dict] = []
        report["training"] = {"preset": args.preset, "seconds_each": args.train_s, **corpus, "runs": runs}
        for vocab in [None, *(int(v) for v in args.vocabs.split(",") if v)]:
            try:
                runs.append(trained_for(args.preset, data, vocab, args.train_s, args.probe_steps))
            except TokenizerError as refused:  # a vocabulary this corpus cannot fill: said, not fatal
                runs.append({"tokenizer": f"bpe-{vocab}", "refused": str(refused)})
            print(runs[-1], flush=True)
            flat[f"val_bpb_{runs[-1]['tokenizer']}"] = runs[-1].get("val_bpb")
            write_report(report, flat, args.out, name, show=False)  # a run cut short loses only itself
    write_report(report, flat, args.out, name)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
