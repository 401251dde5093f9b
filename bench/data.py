"""``python -m bench.data --size 1G``: the data path at a corpus size of your choice, side by
side with the same bytes through ``cp`` and ``sha256sum`` on the same disk.

The corpus is generated (TinyShakespeare's lines, each block of them in a fresh seeded
order; the play generator of the tests where the shared copy is absent), never
downloaded. Each measurement runs in a process of its own, which samples its anonymous
resident memory (``RssAnon``: what the kernel cannot drop, unlike a memory map's file pages)
every few milliseconds:

  fetch, encode   the stages themselves (``tasks.stage.produce`` over a local store): MB/s,
                  CPU seconds, and peak anonymous memory above the process's idle figure
                  (after imports); and apart, the checksum a run takes of a local corpus
                  before its first stage (its md5 keys the fetch version; fetch takes the
                  md5, sha256 and byte values from that read), and the ratio with it
  cp + sha256sum  the same bytes copied and hashed, the floor a disk and a CPU set
(these three alternated, ``--stage-rounds`` times, the best of each compared)
  train           ``tiny``-shape training steps on this corpus's shards and on TinyShakespeare's,
                  alternated: seconds to the first step, tokens/s (the best of each, and the
                  median of the rounds' ratios), peak anonymous memory; ``--stage-rounds 0``
                  measures this alone, ``--set`` changes both corpora's training runs

``--check`` fails (exit 1) when a stage's memory grows by more than 512 MiB over idle.
Writes ``<date>-cpu-data-<size>.json`` under ``--out`` and prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench.report import REPO, RESULTS, SHARED_CORPUS, machine, write_report

MEMORY_BOUND_MIB = 512


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    return int(float(text[:-1]) * units[text[-1]]) if text[-1:] in units else int(text)


def make_corpus(path: Path, size: int, seed: int = 0) -> None:
    """``size`` bytes of text: TinyShakespeare's lines, each ~1 MB block in a fresh seeded order."""
    import numpy as np

    if SHARED_CORPUS.exists():
        lines = SHARED_CORPUS.read_bytes().splitlines(keepends=True)
    else:
        sys.path.insert(0, str(REPO))
        from tests.helpers import play_text

        lines = play_text(1_000_000).splitlines(keepends=True)
    rng, written = np.random.default_rng(seed), 0
    with open(path, "wb") as out:
        while written < size:
            block = b"".join(lines[i] for i in rng.permutation(len(lines)))[: size - written]
            out.write(block)
            written += len(block)


class AnonSampler:
    """Peak RssAnon of this process, sampled on a thread."""

    def __init__(self, every_s: float = 0.005):
        self.every_s, self.peak, self._stop = every_s, 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def now() -> int:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
        return 0

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.now())
            time.sleep(self.every_s)

    def __enter__(self) -> AnonSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.now())


def child(job: dict) -> dict:
    """One measurement, in this (fresh) process: of cp + sha256sum, fetch or encode, twice
    (``passes``: the first as the machine comes, the second right after the first's output
    was deleted), or of training."""
    import jax  # the imports a stage's process has loaded before its work

    from bardflow.artifacts.store import Store
    from bardflow.config.settings import build_config
    from bardflow.tasks.corpus_identity import pin

    unpinned = build_config("tiny").data.model_copy(update={"corpus": job["corpus"]})
    started = time.perf_counter()
    data = pin(unpinned, remembered=False)  # a local corpus's md5, read before a first run: its version's key
    pin_s = time.perf_counter() - started
    idle = AnonSampler.now()
    if job["what"] == "train":
        with AnonSampler() as memory:
            return train(job, Store(Path(job["store"])), data, idle, memory)
    passes = []
    for number in range(2):
        folder = Path(job["store"]) / f"pass-{number}"
        with AnonSampler() as memory:
            passes.append(measure(job["what"], data, folder))
        passes[-1].update(idle_anon_mib=round(idle / 2**20, 1), peak_anon_mib=round(memory.peak / 2**20, 1))
        shutil.rmtree(folder, ignore_errors=True)
    return {"passes": passes, "pin_s": round(pin_s, 3), "devices": len(jax.devices())}


def measure(what: str, data, folder: Path) -> dict:
    """Seconds, MB/s and CPU seconds of cp + sha256sum of the corpus, or of the stage ``what``
    into a store in ``folder`` (encode: its fetch first, not counted)."""
    from bardflow.artifacts.store import Store
    from bardflow.tasks.registry import ENCODE, FETCH
    from bardflow.tasks.stage import produce

    corpus = Path(data.corpus)
    folder.mkdir(parents=True)
    started, cpu = time.perf_counter(), cpu_seconds()
    if what == "cp_sha256sum":
        subprocess.run(["cp", str(corpus), str(folder / "copy.txt")], check=True)
        subprocess.run(["sha256sum", str(folder / "copy.txt")], check=True, capture_output=True)
        metrics = {}
    else:
        store = Store(folder)
        version = produce(FETCH, data, {}, store)[0]
        if what == "encode":
            started, cpu = time.perf_counter(), cpu_seconds()
            version = produce(ENCODE, data, {"fetch": version}, store)[0]
        metrics = version.metrics
    seconds = time.perf_counter() - started
    cpu = cpu_seconds() - cpu
    return {
        "seconds": round(seconds, 3),
        "mb_per_s": round(corpus.stat().st_size / 1e6 / seconds, 1),
        "cpu_s": round(cpu, 2),
        "metrics": metrics,
    }


def cpu_seconds() -> float:
    """User and system CPU time of this process and its finished children (cp, sha256sum)."""
    import resource

    return sum(
        usage.ru_utime + usage.ru_stime
        for usage in map(resource.getrusage, (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    )


def train(job: dict, store, data, idle: int, memory: AnonSampler) -> dict:
    import jax

    from bardflow.config.settings import TrainingRequest, build_config
    from bardflow.model.training.training_run import RunFiles, run_training
    from bardflow.tasks.registry import ENCODE, FETCH
    from bardflow.tasks.stage import produce

    fetched = produce(FETCH, data, {}, store)[0]
    encoded = produce(ENCODE, data, {"fetch": fetched}, store)[0]
    cfg = build_config(
        "tiny",
        {
            "train.steps": job["steps"],
            "train.log_every": job["steps"],
            "train.checkpoint_every": job["steps"],
            # auto's bounded evaluation (a seeded choice of the large split's rows), not the preset's 256 rows
            "train.eval_rows": 0,
            **job.get("settings", {}),
        },
    )
    request = TrainingRequest(model=cfg.model, train=cfg.train, devices=1, platform="cpu")
    first: list[float] = []
    scratch = Path(tempfile.mkdtemp(prefix="bench-data-train-"))
    started = time.perf_counter()
    summary = run_training(
        request,
        RunFiles(encoded.file("train"), encoded.file("val"), scratch / "resume", scratch / "state"),
        jax.devices()[:1],
        parallel=False,
        on_step=lambda done, total: first.append(time.perf_counter()) if not first else None,
    )
    shutil.rmtree(scratch, ignore_errors=True)
    metrics = summary.metrics
    return {
        "first_step_s": round(first[0] - started, 2) if first else None,
        "tokens_per_s": metrics["tokens_per_s"],
        "eval_rows": metrics["eval_rows"],
        "val_split_rows": metrics["val_split_rows"],
        "val_loss": metrics["val_loss"],
        "idle_anon_mib": round(idle / 2**20, 1),
        "peak_anon_mib": round(memory.peak / 2**20, 1),
    }


def in_child(job: dict) -> dict:
    done = subprocess.run(
        [sys.executable, "-m", "bench.data", "--child", json.dumps(job)],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={**os.environ, "PREFECT_LOGGING_LEVEL": "WARNING"},
    )
    if done.returncode:
        raise SystemExit(f"{job['what']} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.data", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size", default="100M", help="corpus size: 100M, 1G, 4G (default 100M)")
    parser.add_argument("--steps", type=int, default=200, help="training steps per run (default 200)")
    parser.add_argument("--rounds", type=int, default=2, help="training runs per corpus, alternated (default 2)")
    parser.add_argument(
        "--stage-rounds",
        type=int,
        default=3,
        help="rounds of cp + sha256sum, fetch and encode, "
        "alternated; the best of each is compared (default 3; 0: training only)",
    )
    parser.add_argument(
        "--set",
        dest="settings",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a setting of the training runs (both corpora), as bardflow run --set takes it",
    )
    parser.add_argument(
        "--work",
        type=Path,
        default=None,
        help="folder for the corpus and stores (default: a temporary one; it needs about 4x the size)",
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help=f"exit 1 when a stage's anonymous memory grows by more than {MEMORY_BOUND_MIB} MiB",
    )
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return 0
    if args.rounds < 1:
        parser.error(f"--rounds takes 1 or more training runs per corpus, not {args.rounds}")
    size = parse_size(args.size)
    settings = dict(setting.split("=", 1) for setting in args.settings)
    work = Path(tempfile.mkdtemp(prefix="bardflow-bench-data-", dir=args.work))
    try:
        corpus = work / "corpus.txt"
        started = time.perf_counter()
        make_corpus(corpus, size)
        print(f"generated {size / 1e6:,.0f} MB of text in {time.perf_counter() - started:.1f} s", flush=True)
        # Alternated, each in a fresh process after the same imports and the same read of the
        # corpus, the best of each kept. Each measures twice: as the machine comes, and right
        # after its first pass's output was deleted: on a virtual machine whose host takes back
        # memory the guest leaves free, writing into such memory can be far slower
        # (docs/benchmarks.md, "Data at any size").
        stage_rounds: dict[str, list[dict]] = {"cp_sha256sum": [], "fetch": [], "encode": []}
        for _ in range(args.stage_rounds):
            for what in stage_rounds:
                stage_rounds[what].append(
                    in_child({"what": what, "corpus": str(corpus), "store": str(work / f"store-{what}")})
                )
                shutil.rmtree(work / f"store-{what}", ignore_errors=True)
            print(
                "  ".join(
                    f"{what}: {' then '.join(str(p['mb_per_s']) for p in done[-1]['passes'])} MB/s"
                    for what, done in stage_rounds.items()
                ),
                flush=True,
            )
        best = (
            [
                {
                    what: min((r["passes"][number] for r in done), key=lambda p: p["seconds"])
                    for what, done in stage_rounds.items()
                }
                for number in range(2)
            ]
            if args.stage_rounds
            else []
        )
        small = SHARED_CORPUS if SHARED_CORPUS.exists() else None
        if small is None:
            small = work / "small.txt"
            make_corpus(small, 1_115_394)
        rounds: dict[str, list[dict]] = {"large": [], "tinyshakespeare": []}
        runs = [("tinyshakespeare", small), ("large", corpus)]
        for number in range(args.rounds):  # alternated, the best of each kept: a host's noise is not the data's
            for name, path in runs if number % 2 == 0 else runs[::-1]:  # each first as often as the other
                rounds[name].append(
                    in_child(
                        {
                            "what": "train",
                            "corpus": str(path),
                            "store": str(work / f"store-{name}"),
                            "steps": args.steps,
                            "settings": settings,
                        }
                    )
                )
            print(
                "  ".join(f"{name}: {done[-1]['tokens_per_s']:,.0f} tokens/s" for name, done in rounds.items()),
                flush=True,
            )
        trained = {name: max(runs_of, key=lambda r: r["tokens_per_s"]) for name, runs_of in rounds.items()}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    mb = size / 1e6
    growth = {
        what: max(
            (p["peak_anon_mib"] - p["idle_anon_mib"] for r in stage_rounds[what] for p in r["passes"]), default=0.0
        )
        for what in ("fetch", "encode")
    }
    growth["train"] = trained["large"]["peak_anon_mib"] - trained["tinyshakespeare"]["peak_anon_mib"]
    flat: dict[str, float | int | None] = {"corpus_mb": round(mb, 1)}
    # A local corpus is read once before the run for its checksum (the fetch version's key),
    # which fetch then takes rather than computing it again: counted apart, and with.
    checksum_s = min((r["pin_s"] for r in stage_rounds["fetch"]), default=0.0)
    for number, runs in enumerate(best):  # the first pass's figures, then the second's
        stages_s = runs["fetch"]["seconds"] + runs["encode"]["seconds"]
        suffix = ("_as_it_comes", "_memory_just_freed")[number]
        flat.update(
            {
                f"fetch_mb_per_s{suffix}": runs["fetch"]["mb_per_s"],
                f"encode_mb_per_s{suffix}": runs["encode"]["mb_per_s"],
                f"fetch_encode_mb_per_s{suffix}": round(mb / stages_s, 1),
                f"cp_sha256sum_mb_per_s{suffix}": runs["cp_sha256sum"]["mb_per_s"],
                f"fetch_encode_vs_cp_sha256sum{suffix}": round(runs["cp_sha256sum"]["seconds"] / stages_s, 3),
                f"checksum_fetch_encode_vs_cp_sha256sum{suffix}": round(
                    runs["cp_sha256sum"]["seconds"] / (checksum_s + stages_s), 3
                ),
                f"fetch_encode_cpu_s{suffix}": round(runs["fetch"]["cpu_s"] + runs["encode"]["cpu_s"], 2),
                f"cp_sha256sum_cpu_s{suffix}": runs["cp_sha256sum"]["cpu_s"],
            }
        )
    if best:
        flat.update(
            {
                "local_checksum_before_run_s": checksum_s,
                "fetch_anon_growth_mib": round(growth["fetch"], 1),
                "encode_anon_growth_mib": round(growth["encode"], 1),
            }
        )
    flat.update(
        {
            "train_anon_vs_tinyshakespeare_mib": round(growth["train"], 1),
            "first_step_s": trained["large"]["first_step_s"],
            "first_step_s_tinyshakespeare": trained["tinyshakespeare"]["first_step_s"],
            "tokens_per_s": trained["large"]["tokens_per_s"],
            "tokens_per_s_tinyshakespeare": trained["tinyshakespeare"]["tokens_per_s"],
            "tokens_per_s_ratio": round(
                trained["large"]["tokens_per_s"] / trained["tinyshakespeare"]["tokens_per_s"], 3
            ),
            # Each round's two runs ran back to back: their ratios show the spread of the best's.
            "tokens_per_s_ratio_median": round(
                statistics.median(
                    large["tokens_per_s"] / small["tokens_per_s"]
                    for large, small in zip(rounds["large"], rounds["tinyshakespeare"], strict=True)
                ),
                3,
            ),
            "eval_rows": trained["large"]["eval_rows"],
            "val_split_rows": trained["large"]["val_split_rows"],
        }
    )
    report = {
        "machine": machine(),
        "size_bytes": size,
        "steps": args.steps,
        "settings": settings,
        "stages": stage_rounds,
        "train": rounds,
    }
    write_report(report, flat, args.out, f"data-{args.size.lower()}")
    over = {what: grown for what, grown in growth.items() if grown > MEMORY_BOUND_MIB}
    if args.check and over:
        print(f"memory grew by more than {MEMORY_BOUND_MIB} MiB: {over}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
