"""What several test files use: the repository's paths, generated play-shaped text, and the
command line run as a user runs it (``python -m bardflow``) with its JSON summary."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from bench.commands import tiny

REPO = Path(__file__).resolve().parents[1]
# What tests keep for people to look at (screenshots, timings): the latest session's.
OUTPUT = Path(os.environ.get("BARDFLOW_TEST_OUTPUT") or Path(tempfile.gettempdir()) / "bardflow-test-output")
# A copy of TinyShakespeare for the tests that need its very bytes (BARDFLOW_TEST_CORPUS, or
# beside the clone); the others generate their text.
SHARED_CORPUS = Path(
    os.environ.get("BARDFLOW_TEST_CORPUS") or REPO.parent / "shared" / "data" / "tinyshakespeare.txt"
).expanduser()


def play_text(n_bytes: int, seed: int = 0) -> bytes:
    """Deterministic play-shaped text: speaker names, colons, short lines."""
    rng = np.random.default_rng(seed)
    names = ["ROMEO", "JULIET", "HAMLET", "FIRST CITIZEN", "KING RICHARD III"]
    words = "the of and to my thou thee lord good love what shall not with be is".split()
    out = []
    size = 0
    while size < n_bytes:
        line = f"{rng.choice(names)}:\n" + " ".join(rng.choice(words, size=int(rng.integers(4, 12)))) + ".\n\n"
        out.append(line)
        size += len(line)
    return "".join(out).encode()[:n_bytes]


def require(*modules: str) -> None:
    """Skips the calling test module where one of ``modules`` is not installed, without
    importing them: collection imports every module in every worker, and torch,
    transformers or mlflow cost seconds there for the one worker that runs their tests."""
    import importlib.util

    import pytest

    missing = [name for name in modules if importlib.util.find_spec(name) is None]
    if missing:
        pytest.skip(f"needs {', '.join(missing)} (the test extra)", allow_module_level=True)


def children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (Linux's /proc)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # ended while listed
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def md5_bytes(data: bytes) -> str:
    return hashlib.md5(data).hexdigest()


def jitted(model):
    """``model``'s forward pass compiled whole, once per shape (as the sampler and training
    run it), for tests that call it many times: run op by op, each of its hundreds of
    operations is a program of its own to compile, and to dispatch at every call."""
    from functools import partial

    import jax
    from flax import nnx

    graphdef, state = nnx.split(model)

    @partial(jax.jit, static_argnames=("last_only", "span"))
    def forward(state, tokens, positions=None, cache=None, last_only=False, span=None):
        return nnx.merge(graphdef, state)(tokens, positions, cache, last_only=last_only, span=span)

    return lambda tokens, positions=None, cache=None, **options: forward(state, tokens, positions, cache, **options)


def logged(client, run_id: str, name: str) -> list[tuple[int, float]]:
    """An MLflow run's metric ``name``, as (step, value) pairs."""
    return [(m.step, m.value) for m in client.get_metric_history(run_id, name)]


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "bardflow", *args]


def bardflow(*args, env=None, check=True):
    """``bardflow ARGS`` to the end; with ``check``, a non-zero exit fails the test with its stderr."""
    env = {**(env or os.environ), "PYTHONUNBUFFERED": "1", "COLUMNS": "200"}
    done = subprocess.run(cli(*args), cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    if check and done.returncode != 0:
        raise AssertionError(f"bardflow {' '.join(args)} exited {done.returncode}:\n{done.stderr[-4000:]}")
    return done


def call(*args, env=None, check=True) -> subprocess.CompletedProcess:
    """``bardflow ARGS`` called in this process (``bardflow.cli.main.main``), its output
    captured: what a test that is not about the process itself (its signals, its exit, its
    start-up) runs, without a new interpreter's imports and compilations. ``env`` is the
    command's whole environment, as for ``bardflow``; it must name a Prefect server, so that
    no embedded one is started here."""
    import contextlib
    import io
    import signal

    from prefect.settings import PREFECT_API_URL, temporary_settings

    from bardflow.cli.ending import settle_reports
    from bardflow.cli.main import main
    from bardflow.processes import stopping

    env = dict(env or os.environ)
    if args[0] in ("run", "sweep"):
        assert env.get("PREFECT_API_URL"), "an in-process run needs the session's Prefect server (run_env)"
    saved, handlers = dict(os.environ), {s: signal.getsignal(s) for s in stopping.SIGNALS}
    out, err = io.StringIO(), io.StringIO()
    os.environ.clear()
    os.environ.update(env)
    consoles = {handler: handler.stream for handler in _console_handlers()}
    for handler in consoles:  # Prefect's log lines go where the command's stderr goes
        handler.setStream(err)
        handler.console.file = err
    try:
        with (
            temporary_settings(updates={PREFECT_API_URL: env.get("PREFECT_API_URL")}),
            contextlib.redirect_stdout(out),
            contextlib.redirect_stderr(err),
        ):
            try:
                code = main([str(arg) for arg in args])
            except SystemExit as exit:  # argparse's usage errors
                code = exit.code if isinstance(exit.code, int) else 2
        settle_reports()  # as the command's exit does: now, while the session's server is up
    finally:
        for handler, stream in consoles.items():
            handler.setStream(stream)
            handler.console.file = stream
        os.environ.clear()
        os.environ.update(saved)
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
    assert stopping.requested() is None, "an in-process run was stopped: this process cannot run another"
    done = subprocess.CompletedProcess(["bardflow", *args], code, out.getvalue(), err.getvalue())
    if check and code != 0:
        raise AssertionError(f"bardflow {' '.join(map(str, args))} returned {code}:\n{done.stderr[-4000:]}")
    return done


def _console_handlers() -> list:
    import logging

    from prefect.logging.handlers import PrefectConsoleHandler

    loggers = [logging.getLogger(), *(logging.getLogger(name) for name in list(logging.root.manager.loggerDict))]
    return list(
        {
            id(h): h
            for logger in loggers
            for h in getattr(logger, "handlers", [])
            if isinstance(h, PrefectConsoleHandler)
        }.values()
    )


def start(args: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen:
    """``bardflow ARGS`` in the background, in a session of its own, stderr to ``log``."""
    return subprocess.Popen(
        cli(*args), cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=open(log, "w"), text=True, start_new_session=True
    )


def finish(process: subprocess.Popen, timeout: float = 600) -> dict:
    out, _ = process.communicate(timeout=timeout)
    assert process.returncode == 0, f"exit {process.returncode}: {Path(process.args[-1]).name}"
    return json.loads(out)


def base_args(corpus: Path, store: Path, *extra: str, devices: int = 2) -> list[str]:
    """A ``tiny`` run of ``corpus`` on ``devices`` emulated devices, its summary as JSON. With
    one, train_parallel takes over train_single's version: no training process is started."""
    return ["run", *tiny(corpus, store, "--json", *extra, devices=devices)]


def checkpoint_steps(store: Path, stage: str) -> list[int]:
    """The steps of the resumable checkpoints a training stage keeps in ``store``."""
    return sorted(int(p.name) for p in store.glob(f"{stage}/.resume-*/*") if p.name.isdigit())


def without_seconds(history):
    """The record of a run but its clock, which no two runs share."""
    return [{k: v for k, v in entry.items() if k != "seconds"} for entry in history]


class Webhook:
    """A webhook receiver on 127.0.0.1, as a chat service's would be: what it was sent, in order."""

    def __init__(self):
        import http.server
        import threading

        received = self.received = []

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                received.append(json.loads(self.rfile.read(int(self.headers.get("content-length", 0)))))
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def wait_for(self, test, timeout_s: float = 60) -> dict:
        """The first message that ``test`` accepts, waiting for it to arrive."""
        import time

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            found = [message for message in self.received if test(message)]
            if found:
                return found[0]
            time.sleep(0.2)
        raise AssertionError(f"no such message within {timeout_s} s; received: {self.received}")

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
