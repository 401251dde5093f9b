"""The GPU check: everything a GPU changes, in one call of at most ``BUDGET_S`` seconds
(``bench/gpu_check.sh`` installs the wheel kit, then runs this).

Parts, each in its own processes with its own time limit (capped by what is left of the
budget), each reported passed / failed / skipped with the reason, so that one failure
does not lose the rest:

  tests       the tests a GPU changes: kernels against XLA, bfloat16 training, the sampler
  pipeline    `bardflow run --preset codelab` on Prefect's embedded server, fresh then cached
  deployment  `prefect deployment run 'bardflow-pipeline/pipeline'` through a process worker
  gpt2        the gpt2 preset (85 M parameters) across the host's GPUs, replicated, fsdp and
              fsdp with remat: tokens/s, MFU, XLA's memory per device against the estimate
  quality     the `quality` preset's time to validation loss 1.47
  bench       codelab-style step against bardflow's, MFU, float32 against bfloat16, generation
  vllm        the pipeline's transformers folder served by vLLM, its greedy text held to the
              export's (skipped, and not counted a failure, where vLLM is not installed)

Peak GPU memory of each part comes from sampling ``nvidia-smi``. ``--dry-run`` runs the same
commands on CPU with the `tiny` preset and a handful of steps, so that every command the GPU
run executes has run before it. Writes ``gpu-check.json``, ``gpu-check.txt`` (the table) and
``gpu-check.log`` (each part's output, last lines) under ``--out``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from bench.commands import bardflow

REPO = Path(__file__).resolve().parents[1]
BUDGET_S = 530  # 9 minutes less a margin for the wheel kit's install
SHARED_CORPUS = REPO.parent / "shared" / "data" / "tinyshakespeare.txt"
GPU_TESTS = [
    "tests/test_kernels.py",
    "tests/test_checkpoint_and_sampling.py",
    "tests/test_bench_baselines.py",
    "tests/test_train.py::test_bfloat16_computes_in_bfloat16_keeps_float32_state_and_tracks_float32_loss",
]


class MemorySampler:
    """The largest GPU memory in use while it runs (MiB), from ``nvidia-smi`` every 0.5 s."""

    def __init__(self) -> None:
        self.peak_mib: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True) if shutil.which("nvidia-smi") else None

    def _sample(self) -> None:
        while not self._stop.is_set():
            done = subprocess.run(
                ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                capture_output=True,
                text=True,
            )
            values = [float(v) for v in done.stdout.split() if v.replace(".", "").isdigit()]
            if values:
                self.peak_mib = max(self.peak_mib or 0.0, max(values))
            self._stop.wait(0.5)

    def __enter__(self) -> MemorySampler:
        if self._thread:
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join(timeout=2)


class Check:
    name = "gpu-check"  # its files under --out: NAME.json, NAME.txt, NAME.log

    def __init__(self, out: Path, work: Path, dry_run: bool, budget_s: float):
        self.out, self.work, self.dry_run = out, work, dry_run
        self.deadline = time.monotonic() + budget_s
        self.results: dict[str, dict] = {}
        self.log = (out / f"{self.name}.log").open("w")
        self.env = {
            **os.environ,
            "PYTHONUNBUFFERED": "1",
            "PREFECT_HOME": str(work / "prefect"),
            "BARDFLOW_SERVER_FILE": str(work / "server.json"),
            # Each part's runs on a server of their own, as the parts were measured: the
            # deployment part starts the background server itself.
            "BARDFLOW_SERVER": "embedded",
            "PREFECT_WORKER_QUERY_SECONDS": "2",
            "PYTHONPATH": os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(REPO)])),
        }
        self.env.pop("PREFECT_API_URL", None)
        if dry_run:
            # A GPU host never measures a CPU step; on CPU the tuner would time the quality
            # shape's candidates, most of that part's budget (docs/gpu-check.md).
            self.env["BARDFLOW_CPU_TUNING"] = "off"

    def sh(self, part: str, *command: str, limit_s: float, env: dict | None = None) -> subprocess.CompletedProcess:
        """One command of a part, within the part's time left; its output goes to the log."""
        left = min(limit_s, self.deadline - time.monotonic())
        if left <= 1:
            raise TimeoutError("no time left in the check's budget")
        self.log.write(f"\n=== [{part}] {' '.join(command)}\n")
        self.log.flush()
        try:
            done = subprocess.run(command, cwd=REPO, env=env or self.env, capture_output=True, text=True, timeout=left)
        except subprocess.TimeoutExpired as expired:
            self.log.write(_text(expired.stdout)[-4000:] + _text(expired.stderr)[-4000:])
            raise TimeoutError(f"`{' '.join(command[:4])} …` ran past its {left:.0f} s") from None
        self.log.write(done.stdout[-4000:] + done.stderr[-6000:])
        self.log.flush()
        if done.returncode != 0:
            raise RuntimeError(f"`{' '.join(command[:4])} …` exited {done.returncode}: {_last_line(done.stderr)}")
        return done

    def part(self, name: str, limit_s: float, body) -> None:
        started = time.monotonic()
        if self.deadline - started < 5:
            self.results[name] = {"status": "skipped", "why": "the check's time budget is spent"}
            return
        with MemorySampler() as memory:
            try:
                figures = body(limit_s)
                result = (
                    {"status": "skipped", "why": f"{name} is not installed", "optional": True}
                    if figures is None
                    else {"status": "passed", **figures}
                )
            except Exception as error:  # noqa: BLE001 - one part's failure must not lose the others
                result = {"status": "failed", "why": str(error)[:500]}
        result["seconds"] = round(time.monotonic() - started, 1)
        result["peak_gpu_mib"] = memory.peak_mib
        self.results[name] = result
        print(f"{name:<11} {result['status']:<7} {result['seconds']:>6.1f} s  {result.get('why', '')}", flush=True)

    # --- the parts ---

    def tests(self, limit_s: float) -> dict:
        return self.pytest(GPU_TESTS, limit_s)

    def pytest(self, tests: list[str], limit_s: float, env: dict | None = None) -> dict:
        """The tests in one process, on the device (on CPU in a dry run)."""
        if not self.dry_run:
            env = {**self.env, **(env or {}), "BARDFLOW_TEST_DEVICE": "accelerator"}
        done = self.sh(
            "tests", sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests, limit_s=limit_s, env=env
        )
        return {"summary": _last_line(done.stdout)}

    def corpus(self) -> Path:
        if SHARED_CORPUS.exists():
            return SHARED_CORPUS
        path = self.work / "corpus.txt"  # offline: a small play of its own
        if not path.exists():
            sys.path.insert(0, str(REPO))
            from tests.conftest import play_text

            path.write_bytes(play_text(64_000))
        return path

    def run_args(self) -> list[str]:
        corpus = self.corpus()
        args = ["--corpus", str(corpus), "--store", str(self.work / "store")]
        if self.dry_run:
            args += ["--preset", "tiny"]
        else:
            args += ["--preset", "codelab"]
        if corpus != SHARED_CORPUS:
            import hashlib

            args += ["--set", f"data.md5={hashlib.md5(corpus.read_bytes()).hexdigest()}"]
        return args

    def pipeline(self, limit_s: float) -> dict:
        figures = {}
        for label in ("fresh", "cached"):
            started = time.monotonic()
            done = self.sh(
                "pipeline", sys.executable, "-m", "bardflow", "run", *self.run_args(), "--json", limit_s=limit_s
            )
            summary = json.loads(done.stdout)
            figures[label] = {
                "wall_s": round(time.monotonic() - started, 1),
                "stages_s": {n: s["seconds"] for n, s in summary["stages"].items()},
                "states": {n: s["state"] for n, s in summary["stages"].items()},
            }
        if set(figures["cached"]["states"].values()) != {"cached"}:
            raise RuntimeError(f"the rerun was not fully cached: {figures['cached']['states']}")
        train = json.loads(done.stdout)["stages"]["train_parallel"]["metrics"]
        figures["val_loss"], figures["tokens_per_s"] = train.get("val_loss"), train.get("tokens_per_s")
        return figures

    def deployment(self, limit_s: float) -> dict:
        from bardflow.processes.launch import free_port

        port = free_port()
        env = {**self.env, "PREFECT_API_URL": f"http://127.0.0.1:{port}/api"}
        prefect = [sys.executable, "-m", "prefect"]
        worker = None
        try:
            self.sh("deployment", *bardflow("server", "start", "--port", str(port)), limit_s=limit_s, env=env)
            self.sh(
                "deployment",
                *prefect,
                "work-pool",
                "create",
                "--overwrite",
                "--type",
                "process",
                "gpu-check",
                limit_s=60,
                env=env,
            )
            self.sh(
                "deployment",
                *prefect,
                "--no-prompt",
                "deploy",
                "--name",
                "pipeline",
                "--pool",
                "gpu-check",
                limit_s=60,
                env=env,
            )
            worker = subprocess.Popen(
                [*prefect, "worker", "start", "--pool", "gpu-check"],
                cwd=REPO,
                env=env,
                stdout=self.log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            args = self.run_args()
            params = {
                "preset": args[args.index("--preset") + 1],
                "corpus": args[1],
                "store": args[3],
                "refresh": ["generate"],
            }
            started = time.time()
            done = self.sh(
                "deployment",
                *prefect,
                "deployment",
                "run",
                "bardflow-pipeline/pipeline",
                "--params",
                json.dumps(params),
                "--watch",
                limit_s=limit_s,
                env=env,
            )
            finished = time.time()
            run_id = re.search(r"UUID:\s*([0-9a-f-]{36})", done.stdout).group(1)
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/flow_runs/{run_id}") as answer:
                run = json.loads(answer.read())
            from datetime import datetime

            flow_start = datetime.fromisoformat(run["start_time"]).timestamp()
            if run["state"]["type"] != "COMPLETED":
                raise RuntimeError(f"the deployment run ended {run['state']['name']}")
            return {
                "run_to_flow_start_s": round(flow_start - started, 1),
                "run_to_done_s": round(finished - started, 1),
            }
        finally:
            if worker is not None:
                for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGKILL):
                    if worker.poll() is None:
                        os.killpg(worker.pid, sig)
                        try:
                            worker.wait(timeout=10)
                        except subprocess.TimeoutExpired:
                            continue
            subprocess.run(
                [sys.executable, "-m", "bardflow", "server", "stop"], cwd=REPO, env=env, capture_output=True, timeout=30
            )

    def bench(self, limit_s: float) -> dict:
        # The quick mode: the full one's generation and precision rounds ran past the part's
        # limit on an H200 (docs/gpu-check.md).
        steps = ["--smoke"] if self.dry_run else ["--quick", "--steps", "100", "--pairs", "3"]
        # The pipeline part has timed the whole pipeline already.
        done = self.sh(
            "bench", sys.executable, "-m", "bench", *steps, "--no-pipeline", "--out", str(self.out), limit_s=limit_s
        )
        return {"table": done.stdout.strip().splitlines()[-25:]}

    def gpt2(self, limit_s: float) -> dict:
        shape = ["--steps", "20"]
        if self.dry_run:  # its shape, smaller, on two emulated CPU devices
            shape = ["--steps", "2", "--cpu-devices", "2"] + [
                arg
                for item in (
                    "model.num_layers=2",
                    "data.seq_len=64",
                    "model.max_seq_len=64",
                    "train.per_device_batch=2",
                )
                for arg in ("--set", item)
            ]
        done = self.sh(
            "gpt2",
            sys.executable,
            "-m",
            "bench.fsdp",
            "--preset",
            "gpt2",
            *shape,
            "--out",
            str(self.out),
            limit_s=limit_s,
        )
        return {"table": done.stdout.strip().splitlines()[-21:]}

    def step_calls(self, limit_s: float) -> dict:
        """Several steps per compiled call against one, and cuDNN's fused attention against
        XLA's (50 steps' losses), on the codelab step (``bench/step_calls.py``)."""
        shape = ["--preset", "tiny", "--counts", "1,4", "--steps", "8", "--rounds", "1"]
        if not self.dry_run:
            shape = ["--preset", "codelab", "--counts", "1,4,10,16", "--steps", "80", "--rounds", "3"]
        done = self.sh(
            "step_calls", sys.executable, "-m", "bench.step_calls", *shape, "--out", str(self.out), limit_s=limit_s
        )
        return {"table": done.stdout.strip().splitlines()[-16:]}

    def vllm(self, limit_s: float) -> dict | None:
        if importlib.util.find_spec("vllm") is None:
            return None
        versions = sorted((self.work / "store" / "export").glob("*/manifest.json"), key=lambda p: p.stat().st_mtime)
        if not versions:
            raise RuntimeError("the pipeline part wrote no export to serve")
        done = self.sh(
            "vllm", sys.executable, str(REPO / "bench" / "vllm_check.py"), str(versions[-1].parent), limit_s=limit_s
        )
        figures = json.loads(done.stdout.strip().splitlines()[-1])
        if not figures["greedy_equal"]:
            raise RuntimeError(
                f"vLLM's greedy continuation differs from the export's at byte "
                f"{figures['first_difference']} of {figures['bytes']}"
            )
        return figures

    def quality(self, limit_s: float) -> dict:
        extra = []
        if self.dry_run:
            extra = ["--corpus", str(self.corpus())] + [
                arg
                for item in (
                    "train.steps=2",
                    "train.warmup_steps=0",
                    "train.single_device_steps=0",
                    "train.per_device_batch=1",
                    "train.log_every=1",
                )
                for arg in ("--set", item)
            ]
        done = self.sh(
            "quality",
            sys.executable,
            "-m",
            "bench.quality",
            "--preset",
            "quality",
            "--target",
            "100" if self.dry_run else "1.47",
            "--out",
            str(self.out),
            *extra,
            limit_s=limit_s,
        )
        return {"table": done.stdout.strip().splitlines()[-12:]}


def _text(value) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else (value or "")


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1][:300] if lines else ""


def check_parser(prog: str, description: str | None, dry_run: str, budget_s: float) -> argparse.ArgumentParser:
    """The options a one-call check takes (this one's and bench/tpu_check.py's)."""
    parser = argparse.ArgumentParser(
        prog=prog, description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dry-run", action="store_true", help=dry_run)
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", REPO / "bench" / "results")))
    parser.add_argument("--budget-s", type=float, default=budget_s)
    parser.add_argument(
        "--parts",
        type=lambda text: text.split(","),
        default=None,
        metavar="NAME,NAME",
        help="only these parts (e.g. to run again those that failed); default: all",
    )
    return parser


def run_parts(check: Check, limits: dict[str, float], chosen: list[str] | None, parser) -> None:
    """The parts ``chosen`` (None: all) in the order of ``limits``, each within its limit."""
    unknown = set(chosen or ()) - set(limits)
    if unknown:
        parser.error(f"no part named {', '.join(sorted(unknown))}; the parts: {', '.join(limits)}")
    for name, limit_s in limits.items():
        if chosen is None or name in chosen:
            check.part(name, limit_s, getattr(check, name))
    check.log.close()


def where_it_ran(describe=str) -> dict:
    """The Python and the devices a check ran on, for its report."""
    import platform

    found: dict = {"python": platform.python_version()}
    try:
        import jax

        found["devices"] = [describe(d) for d in jax.devices()]
    except Exception as error:  # noqa: BLE001 - the report says so
        found["devices"] = f"jax: {error}"
    return found


def main(argv: list[str] | None = None) -> int:
    parser = check_parser(
        "python -m bench.gpu_check", __doc__, "on CPU: the tiny preset and a handful of steps", BUDGET_S
    )
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as work:
        check = Check(args.out, Path(work), args.dry_run, args.budget_s)
        # The benchmark after the parts that check the product: on an H200 its generation rounds
        # alone outran a 100-s limit, and what is left of the budget is what it gets.
        limits = {
            "tests": 90,
            "pipeline": 150,
            "deployment": 120,
            "gpt2": 100,
            "step_calls": 90,
            "quality": 150,
            "bench": 180,
            "vllm": 120,
        }
        run_parts(check, limits, args.parts, parser)
    report = {"dry_run": args.dry_run, "parts": check.results, **where_it_ran()}
    (args.out / "gpu-check.json").write_text(json.dumps(report, indent=1))
    table = [f"{'part':<11} {'status':<7} {'seconds':>7}  {'peak MiB':>8}  why"]
    table += [
        f"{name:<11} {r['status']:<7} {r.get('seconds', 0):>7.1f}  {r.get('peak_gpu_mib') or '—':>8}  "
        f"{r.get('why', '')}"
        for name, r in check.results.items()
    ]
    (args.out / "gpu-check.txt").write_text("\n".join(table) + "\n")
    print("\n".join(table))
    return 0 if all(r["status"] == "passed" or r.get("optional") for r in check.results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
