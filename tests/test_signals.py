"""Ctrl-C and SIGTERM, as a terminal, a scheduler or a worker sends them: the run stops
within 10 s, saves a checkpoint of the step it reached, exits 130 or 143 with one line,
leaves no process behind, and the rerun resumes to exactly the weights of a run never
interrupted.

One store is stopped twice in a row (SIGINT to the process group in train_single, SIGTERM to
the main process alone in a two-process train_parallel), then run to the end, and compared
with an uninterrupted run. Both stops use the run's own embedded Prefect server (the one a
group Ctrl-C used to kill first, and the one a SIGTERM to the main process used to orphan);
a stop on a chosen server is the deployment tests' cancel (tests/test_deployment.py), and a
background server that dies mid-run is tests/test_pool_server.py's."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import REPO

pytestmark = pytest.mark.flow
STEPS = 600  # long enough that a loaded machine still signals train_single before it ends


def descendants(pid: int) -> list[int]:
    found = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout.split()
    return [int(child) for child in found] + [grand for child in found for grand in descendants(int(child))]


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


@pytest.fixture(scope="module")
def chain(tmp_path_factory, prefect_server):
    from tests.helpers import md5_bytes, play_text

    root = tmp_path_factory.mktemp("signals")
    corpus = root / "corpus.txt"
    corpus.write_bytes(play_text(64_000, seed=5))
    args = [
        "--preset",
        "tiny",
        "--corpus",
        str(corpus),
        "--processes",
        "2",
        "--cpu-devices",
        "2",
        "--set",
        f"data.md5={md5_bytes(corpus.read_bytes())}",
        "--set",
        f"train.steps={STEPS}",
        "--set",
        f"train.log_every={STEPS // 10}",
        "--set",
        f"train.checkpoint_every={STEPS}",
    ]
    own_server = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    # The session's Prefect home: its database is already made, as on a user's machine.
    own_server.update(BARDFLOW_SERVER_FILE=str(root / "no-server.json"))
    shared = {**os.environ, "PREFECT_API_URL": prefect_server.env["PREFECT_API_URL"]}
    return {"args": args, "store": root / "store", "own_server": own_server, "shared": shared}


def stop_run(chain, env, stage: str, sig: signal.Signals, group: bool) -> dict:
    """Starts `bardflow run`, sends ``sig`` once ``stage`` reports training progress, and
    waits for the exit."""
    command = [sys.executable, "-m", "bardflow", "run", *chain["args"], "--store", str(chain["store"])]
    process = subprocess.Popen(
        command,
        cwd=REPO,
        env={**env, "PYTHONUNBUFFERED": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    seen = []
    for line in process.stderr:
        seen.append(line)
        if f"{stage} (" in line and f"/{STEPS} (" in line:  # a progress line: training is under way
            break
    else:
        pytest.fail("the run ended before training:\n" + "".join(seen[-30:]))
    children = descendants(process.pid)
    sent = time.monotonic()
    if group:
        os.killpg(process.pid, sig)
    else:
        os.kill(process.pid, sig)
    rest = process.stderr.read()
    process.wait(timeout=60)
    return {
        "code": process.returncode,
        "seconds": time.monotonic() - sent,
        "children": children,
        "last_line": rest.strip().splitlines()[-1],
        "stderr": rest,
    }


@pytest.mark.parametrize(
    "stage, sig, group",
    [
        ("train_single", signal.SIGINT, True),
        ("train_parallel", signal.SIGTERM, False),
    ],
    ids=["group-SIGINT", "main-SIGTERM-processes"],
)
def test_a_signal_stops_the_run_within_10_s_at_a_saved_step(chain, stage, sig, group):
    stopped = stop_run(chain, chain["own_server"], stage, sig, group)
    assert stopped["code"] == 128 + sig, stopped["stderr"][-3000:]
    assert stopped["seconds"] < 10, stopped["seconds"]
    assert stopped["last_line"].startswith(f"bardflow: stopped by {sig.name} during {stage}")
    assert "checkpoint of step" in stopped["last_line"] and "resume" in stopped["last_line"]
    assert "Traceback" not in stopped["stderr"]
    assert stopped["children"], "the run had no child process (its embedded server)"
    time.sleep(0.5)
    assert not [pid for pid in stopped["children"] if alive(pid)], "a process was left behind"


def test_the_run_s_own_server_dying_mid_run_ends_it_in_one_line(chain):
    """Not a signal to the run: its embedded Prefect server killed while training goes on.
    (The run then stops as on SIGTERM, whose way through train_parallel's processes is the
    stop test's above.)"""
    steps = 10 * STEPS  # a training of its own, still going (9 tenths of it) when the server is gone
    command = [
        sys.executable,
        "-m",
        "bardflow",
        "run",
        *chain["args"],
        "--store",
        str(chain["store"]),
        "--set",
        f"train.steps={steps}",
        "--set",
        f"train.log_every={steps // 10}",
    ]
    process = subprocess.Popen(
        command,
        cwd=REPO,
        env={**chain["own_server"], "PYTHONUNBUFFERED": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    for line in process.stderr:
        if "train_single (" in line and f"/{steps} (" in line:
            break
    listed = subprocess.run(
        ["ps", "-o", "pid=,args=", "--ppid", str(process.pid)], capture_output=True, text=True
    ).stdout.splitlines()
    server = next(int(row.split()[0]) for row in listed if "uvicorn" in row)
    killed = time.monotonic()
    os.killpg(server, signal.SIGKILL)
    rest = process.stderr.read()
    process.wait(timeout=60)
    took_s = time.monotonic() - killed
    assert process.returncode == 1 and took_s < 5, took_s  # it took 9.7 s while the run waited out its grace
    assert rest.strip().splitlines()[-1].startswith(f"bardflow: error: the run's Prefect server (pid {server}) exited")
    # The stage's build folder and the version's lock file go with it (they used to stay).
    assert not [p for p in chain["store"].glob("*/.*") if p.name.startswith((".build-", ".lock-"))]
    assert "Traceback" not in rest
    # What Prefect could no longer send is dropped quietly (it used to print a warning and a 3 KB line).
    assert "EventsWorker" not in rest and "prefect.events" not in rest, rest[-3000:]


def test_the_rerun_resumes_to_the_weights_of_an_uninterrupted_run(chain, tmp_path):
    """After two stops, the rerun ends with exactly the weights and losses of each training
    stage trained in one go (here, in this process, from the same request and data)."""
    import jax

    from bardflow.artifacts.store import Store
    from bardflow.config.settings import TrainingRequest
    from bardflow.model.training.training_run import RunFiles, run_training
    from bardflow.tasks.encode import TRAIN, VAL
    from bardflow.tasks.train import training_fingerprint
    from tests.helpers import call

    if not list(chain["store"].glob("train_parallel/.resume-*")):  # run on its own: stop once first
        assert stop_run(chain, chain["shared"], "train_parallel", signal.SIGTERM, True)["code"] == 143
    resumed = json.loads(
        call("run", *chain["args"], "--store", str(chain["store"]), "--json", env=chain["shared"]).stdout
    )["stages"]
    assert resumed["train_parallel"]["metrics"]["resumed_from_step"] > 0
    store = Store(chain["store"])
    encode = store.lookup("encode", resumed["encode"]["key"])
    for stage, parallel in (("train_single", False), ("train_parallel", True)):
        version = store.lookup(stage, resumed[stage]["key"])
        request = TrainingRequest.model_validate(version.manifest["params"])
        files = RunFiles(
            train=encode.file(TRAIN),
            val=encode.file(VAL),
            resume=tmp_path / stage / "resume",
            state=tmp_path / stage / "state",
        )
        whole = run_training(request, files, jax.devices()[: request.devices], parallel)
        assert whole.metrics["resumed_from_step"] is None
        assert training_fingerprint(whole) == version.fingerprint, stage  # bit for bit
