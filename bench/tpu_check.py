"""The TPU check: everything a TPU changes, in one call of at most ``BUDGET_S`` seconds
(``bench/tpu_check.sh`` installs what the host lacks, then runs this). One program at a
time can hold the chip, so the parts run one after another, each in its own process with its
own time limit, each reported passed / failed / skipped with the reason:

  tests     the model, kernel, step, checkpoint and sampling tests, in one process on the chip
  quality   the ``quality`` preset on TinyShakespeare's real bytes, encoded by bardflow's
            encode code, trained by the training stage's ``run_training`` (best state kept),
            then checkpointed, restored, verified and sampled (``bench/quality.py --deliver``)
  step      per preset, each in a process of its own (``bench/tpu_step.py``, nothing in JAX's
            cache): the step program a run compiles (``auto``'s steps a call), its compile
            time, step time, MFU and XLA's memory against the estimate; for ``gpt2`` a
            profile of that program by kind
  sampler   the KV-cache sampler for ``gpt2``'s bfloat16 weights at batch 1 and 64, against
            the HBM bound (``bench/sampler.py``)
  serve     the serving engine for ``codelab``, and ``gpt2`` with the Pallas decode kernels and
            a bfloat16 cache: 1, 8 and 64 concurrent sequences against the sampler alone and
            the HBM bound (``bench/serve.py``; in-process: the host opens no socket), one
            process a preset
  pipeline  ``bardflow run`` under Prefect where the host lets a server listen; where no socket
            opens it says so in one line (the quality part has run the stages' work)

``--dry-run`` runs the same commands on CPU with small shapes and a few steps. Writes
``tpu-check.json`` (a top-level ``summary`` of the headline figures), ``tpu-check.txt`` (the
table) and ``tpu-check.log`` under ``--out``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

from bench.gpu_check import SHARED_CORPUS, Check, _last_line, check_parser, run_parts, where_it_ran

BUDGET_S = 540  # 9 minutes less a margin for the installs
# The serving engine's runs: a name for its figures, the preset, the engine's options. gpt2
# without the kernels (2026-12-06's figures, docs/benchmarks.md) no longer fits the check's time.
SERVE_RUNS = (
    ("codelab", "codelab", ()),
    ("gpt2-kernels-bfloat16", "gpt2", ("--kernels", "--cache", "bfloat16")),
)
# The model's tests a device changes (the hand-written CPU kernels' are held to float32 digits
# a TPU's products do not keep: tests/test_kernels.py's Pallas ones run here instead). Of
# tests/test_model.py the causal mask only: its refinements and shapes are the same on any
# device, and each compiled cold cost the chip seconds (docs/tpu-check.md).
TPU_TESTS = [
    "tests/test_kernels.py::test_pallas_tpu_attention_matches_autodiff_of_dot_product_attention",
    "tests/test_kernels.py::test_the_model_computes_the_same_with_either_kernel",
    "tests/test_model.py::test_changing_a_later_token_never_changes_earlier_logits",
    "tests/test_checkpoint_and_sampling.py",
    "tests/test_train.py::test_bfloat16_computes_in_bfloat16_keeps_float32_state_and_tracks_float32_loss",
]
# What the step part measures of each preset within its limit: the step program a run compiles,
# its time and memory, and for gpt2 a profile of that same program. One step a call against
# ``auto``'s several, the attention kernels alone and each kernel's 50-step losses were measured
# apart (docs/tpu-check.md): ``python -m bench.tpu_step --parts calls,attention,kernels``.
PRESETS = {
    "gpt2": ("run", "profile"),
    "quality": ("run",),
    "codelab": ("run",),
}
# Each part's limit in seconds, in the order they run, by what each took on a TPU v5e
# (docs/tpu-check.md, 2026-12-07; the step part's three presets then shared one process, now
# each has its own): the step and quality parts keep what they measured when cut short;
# serving gets what is left. They add up to more than the budget: compiling still takes most
# of every part, so the last one is cut until it takes less.
LIMITS = {"tests": 100, "quality": 120, "step": 180, "sampler": 70, "serve": 540, "pipeline": 150}


def sockets_open() -> str | None:
    """Why no TCP socket opens on the loopback here, in one line; None where one does."""
    try:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            probe.listen(1)
    except OSError as error:
        return f"no TCP socket opens on this host ({error.strerror or error})"
    return None


class TpuCheck(Check):
    name = "tpu-check"

    def __init__(self, out: Path, work: Path, dry_run: bool, budget_s: float, corpus: Path | None):
        super().__init__(out, work, dry_run, budget_s)
        self.given_corpus = corpus
        self.figures: dict[str, dict] = {}  # each part's report, read back from its JSON
        if dry_run:
            self.env["JAX_PLATFORMS"] = "cpu"
        # The parts' persistent compilation cache starts empty: what they report is compiled cold.
        self.env["BARDFLOW_CACHE_DIR"] = str(work / "cache")
        self.env.pop("JAX_COMPILATION_CACHE_DIR", None)

    def corpus(self) -> Path:
        return self.given_corpus or super().corpus()

    def report_of(self, folder: Path, pattern: str) -> dict:
        found = sorted(folder.glob(pattern))
        if not found:
            raise RuntimeError(f"the part wrote no {pattern}")
        return json.loads(found[-1].read_text())

    # --- the parts ---

    def tests(self, limit_s: float) -> dict:
        # Float32 products at full precision: the tests hold kernels to float32 tolerances.
        # Each test's time in the log: on the chip each compiles cold, what the part's limit is made of.
        return self.pytest([*TPU_TESTS, "--durations=10"], limit_s, env={"JAX_DEFAULT_MATMUL_PRECISION": "highest"})

    def step(self, limit_s: float) -> dict:
        """Each preset in a process of its own: on a TPU a program compiles faster after a
        similar one in the same process (docs/tpu-check.md), so only a fresh process's compile
        time is a run's."""
        shape = ["--smoke", "--steps", "2", "--loss-steps", "3"] if self.dry_run else ["--steps", "10"]
        ends = time.monotonic() + limit_s
        done = None
        for preset, parts in PRESETS.items():
            folder = self.work / "step" / preset
            left = ends - time.monotonic()
            try:
                done = self.sh(
                    "step",
                    "env",
                    "JAX_COMPILATION_CACHE_DIR=",  # no cache at all: each step's compile_s is cold
                    sys.executable,
                    "-m",
                    "bench.tpu_step",
                    "--presets",
                    preset,
                    "--parts",
                    f"{preset}:{','.join(parts)}",
                    *shape,
                    "--budget-s",
                    str(left - 25),  # no part starts that would not end within the limit
                    "--out",
                    str(folder),
                    limit_s=left,
                )
            finally:  # what it measured before a limit cut it short is kept
                if list(folder.glob("*-tpu-step.json")):
                    report = self.report_of(folder, "*-tpu-step.json")
                    merged = self.figures.setdefault("step", {**report, "presets": {}})
                    merged["presets"].update(report.get("presets", {}))
        return {"last": _last_line(done.stdout) if done is not None else ""}

    def quality(self, limit_s: float) -> dict:
        folder = self.work / "quality"
        extra = []
        if self.dry_run:
            extra = [
                arg
                for item in (
                    "train.steps=4",
                    "train.warmup_steps=0",
                    "train.single_device_steps=0",
                    "train.log_every=2",
                )
                for arg in ("--set", item)
            ] + ["--preset", "tiny", "--target", "100"]
        else:
            extra = ["--preset", "quality", "--target", "1.47"]
        try:
            self.sh(
                "quality",
                sys.executable,
                "-m",
                "bench.quality",
                "--corpus",
                str(self.corpus()),
                "--deliver",
                "--out",
                str(folder),
                *extra,
                limit_s=limit_s,
            )
        finally:  # a run that reported, then ran past the limit (a TPU runtime's slow exit), keeps its figures
            if list(folder.glob("*-quality-*.json")):
                self.figures["quality"] = self.report_of(folder, "*-quality-*.json")
        report = self.figures["quality"]
        delivered = report["quality"]["delivered"]
        if not delivered["verified"]:
            raise RuntimeError(f"the restored model's logits differ by {delivered['max_abs_logit_diff']:.2e}")
        return {
            "val_loss": report["quality"]["val_loss"],
            "training_s": report["quality"]["training_s"],
            "seconds_to_target_from_start": report["quality"]["seconds_to_target_from_start"],
        }

    def sampler(self, limit_s: float) -> dict:
        folder = self.work / "sampler"
        shape = ["--smoke", "--batches", "1,4", "--new-bytes", "40"] if self.dry_run else ["--new-bytes", "300"]
        # gpt2's bfloat16 weights only: codelab's and float32's, 2026-12-06's figures (docs/benchmarks.md)
        shape += ["--presets", "gpt2", "--weights", "bfloat16"]
        self.sh("sampler", sys.executable, "-m", "bench.sampler", *shape, "--out", str(folder), limit_s=limit_s)
        self.figures["sampler"] = self.report_of(folder, "*-sampler.json")
        return {}

    def serve(self, limit_s: float) -> dict:
        # One process a preset, `codelab` first: a `gpt2` that runs out of time (most of it
        # compiling) keeps `codelab`'s figures.
        shape = ["--smoke", "--streams", "1,8", "--slots", "8", "--new-bytes", "40"] if self.dry_run else []
        ends = time.monotonic() + limit_s
        found: dict = {"presets": {}, "summary": {}}
        self.figures["serve"] = found
        for name, preset, options in SERVE_RUNS:
            folder = self.work / "serve" / name
            command = (sys.executable, "-m", "bench.serve", "--presets", preset, *options, *shape, "--out", str(folder))
            try:
                self.sh("serve", *command, limit_s=ends - time.monotonic())
            except TimeoutError as error:
                raise TimeoutError(f"{name}: {error}") from None
            report = self.report_of(folder, "*-serve.json")
            found["presets"][name] = report["presets"][preset]
            summary = report["summary"].items()
            found["summary"].update({name + key.removeprefix(preset): value for key, value in summary})
        return {}

    def pipeline(self, limit_s: float) -> dict:
        blocked = sockets_open()
        if blocked:
            print(
                f"pipeline: {blocked}, so Prefect's server cannot listen: the quality part ran the stages' work "
                "(encode, train, checkpoint, restore and verify, generate) without it",
                flush=True,
            )
            return {"status": "skipped", "why": f"{blocked}: Prefect's server cannot listen"}  # over "passed"
        if self.dry_run or importlib.util.find_spec("prefect") is not None:
            return super().pipeline(limit_s)
        return {"status": "skipped", "why": "Prefect is not installed here (carry it in the wheel kit)"}

    def summary(self) -> dict:
        """The headline figures of the parts that ran."""
        found: dict = {}
        step = self.figures.get("step", {}).get("presets", {})
        # Each preset's measured calls: the run's program ("run"), or one step a call and auto's ("calls").
        measured = {
            preset: calls
            for preset, report in step.items()
            if isinstance(calls := report.get("run", report.get("calls")), list) and calls
        }
        chosen = {}
        for preset, calls in measured.items():
            best = max((c for c in calls if "ms_per_step" in c), key=lambda c: c["tokens_per_s"], default=None)
            if best:
                chosen[preset] = best
        if "gpt2" in chosen:
            found["gpt2_mfu"] = chosen["gpt2"]["mfu"]
            found["gpt2_tokens_per_s"] = chosen["gpt2"]["tokens_per_s"]
        if "codelab" in chosen:
            found["codelab_tokens_per_s"] = chosen["codelab"]["tokens_per_s"]
        if "quality" in chosen:
            found["quality_step_mfu"] = chosen["quality"]["mfu"]
        # The training step's program as a run compiles it (auto's: the last of the calls measured), cold.
        found["compile_s"] = {preset: calls[-1].get("compile_s") for preset, calls in measured.items()}
        found["estimate_vs_xla"] = {p: c.get("estimate_vs_xla") for p, c in chosen.items()}
        found["attention"] = {p: r.get("step_settings", {}).get("attention") for p, r in step.items()}
        kernels = {
            p: r["kernels"]
            for p, r in step.items()
            if isinstance(r.get("kernels"), dict) and "by_kernel" in r["kernels"]
        }
        found["kernel_losses_within_bound"] = {p: k["within"] for p, k in kernels.items()}
        quality = self.figures.get("quality", {}).get("quality")
        if quality:
            found["quality_val_loss"] = quality["val_loss"]
            found["quality_train_s"] = quality["training_s"]
            found["quality_compile_each_s"] = quality.get("compile_each_s")  # side by side: see compile_s's
            # From the process's start to the first validation loss at or under the target,
            # compiling and evaluating included, with an empty compilation cache.
            found["quality_seconds_to_target"] = quality["seconds_to_target_from_start"]
            found["quality_training_s_to_target"] = quality["seconds_to_target"]
            found["quality_verified"] = (quality.get("delivered") or {}).get("verified")
        sampler = self.figures.get("sampler", {}).get("presets", {})
        found["sample_tokens_per_s"] = {}
        found["sample_bound_fraction"] = {}
        for preset, report in sampler.items():
            for weights, figures in report["by_weights"].items():
                for key, value in figures.items():
                    if key.startswith("batch_"):
                        name = f"{preset}.{weights}.{key}"
                        found["sample_tokens_per_s"][name] = value["bytes_per_s"]
                        found["sample_bound_fraction"][name] = value["bound_fraction"]
        serve = self.figures.get("serve", {})
        if serve.get("summary"):
            found["serve"] = serve["summary"]
        runs = serve.get("presets", {})
        # Seconds from the engine's start to the programs that serve any request compiled (ready),
        # and to every one compiled, cold; bytes/s at 64 streams, every program compiled.
        found["serve_ready_s"] = {label: run.get("ready_s") for label, run in runs.items()}
        found["serve_compiled_s"] = {label: run.get("compile_s") for label, run in runs.items()}
        found["serve_bytes_per_s_64"] = {
            label: next((row["bytes_per_s"] for row in run.get("streams", []) if row["streams"] == 64), None)
            for label, run in runs.items()
        }
        found["parts"] = {name: result["status"] for name, result in self.results.items()}
        return found


def main(argv: list[str] | None = None) -> int:
    parser = check_parser("python -m bench.tpu_check", __doc__, "on CPU: small shapes and a handful of steps", BUDGET_S)
    parser.add_argument(
        "--corpus",
        type=Path,
        default=Path(os.environ["BARDFLOW_CORPUS"]) if os.environ.get("BARDFLOW_CORPUS") else None,
        help=f"TinyShakespeare's bytes (default $BARDFLOW_CORPUS, else {SHARED_CORPUS}, else a generated play)",
    )
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as work:
        check = TpuCheck(args.out, Path(work), args.dry_run, args.budget_s, args.corpus)
        run_parts(check, LIMITS, args.parts, parser)
    report = {
        "dry_run": args.dry_run,
        "summary": {**check.summary(), "wall_s": round(time.monotonic() - started, 1)},
        "parts": check.results,
        "figures": check.figures,
        **where_it_ran(lambda device: f"{device} ({device.device_kind})"),
    }
    (args.out / "tpu-check.json").write_text(json.dumps(report, indent=1, default=str))
    table = [f"{'part':<9} {'status':<7} {'seconds':>7}  why"]
    table += [
        f"{name:<9} {r['status']:<7} {r.get('seconds', 0):>7.1f}  {r.get('why', '')}"
        for name, r in check.results.items()
    ]
    table += ["", "summary:", json.dumps(report["summary"], indent=1)]
    (args.out / "tpu-check.txt").write_text("\n".join(table) + "\n")
    print("\n".join(table))
    return 0 if all(r["status"] in ("passed", "skipped") for r in check.results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
