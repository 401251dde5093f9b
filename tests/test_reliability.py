"""Faults a user meets, through the real CLI: a killed run resumes, two runs share a
store, and bad input gets one clear error, a non-zero exit and loses nothing."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import time

import pytest

from bardflow.artifacts.store import Store
from bardflow.config.settings import DataConfig
from bardflow.tasks.registry import FETCH
from bardflow.tasks.stage import produce
from tests.helpers import REPO, bardflow, base_args, call, checkpoint_steps, cli, finish, md5_bytes, play_text, start

pytestmark = pytest.mark.flow


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_bytes(play_text(64_000))
    return path


def test_two_runs_on_one_store_both_finish(tmp_path, corpus, run_env):
    """At once, and on two servers: one run on the shared server, the other as a first-time
    user starts it (no PREFECT_API_URL: Prefect's embedded server). The store is the cache,
    so what one builds the other uses, whatever server each reports to."""
    store = tmp_path / "store"
    plain = {k: v for k, v in run_env.items() if k != "PREFECT_API_URL"}
    first = start([*base_args(corpus, store, devices=1), "--verbose"], tmp_path / "a.log", plain)
    second = call(*base_args(corpus, store, devices=1), env=run_env)  # in this process, beside the first
    b, a = json.loads(second.stdout), finish(first)
    assert {n: s["key"] for n, s in a["stages"].items()} == {n: s["key"] for n, s in b["stages"].items()}
    for stage in a["stages"]:
        versions = [p for p in (store / stage).iterdir() if not p.name.startswith(".")]
        assert len(versions) == 1, f"{stage}: {versions}"
        assert Store(store).lookup(stage, versions[0].name) is not None
        # Built once: each stage ran in one of the two runs, and the other found it.
        assert sorted((a["stages"][stage]["state"], b["stages"][stage]["state"])) == ["cached", "ran"], stage
    log = (tmp_path / "a.log").read_text()
    assert "starting a temporary Prefect server for this run" in log
    # Its links point where the run can be seen once its own server is gone: `bardflow ui`.
    # (Prefect's own lines, "View at" among them, reach the terminal with --verbose.)
    assert f"View at http://127.0.0.1:4200/runs/flow-run/{a['flow_run']}" in log, log[-3000:]
    # Without --verbose the terminal shows each stage's end, not Prefect's bookkeeping: the
    # log and the UI keep that.
    quiet = second.stderr
    assert all(f"{stage}: {b['stages'][stage]['state']} in " in quiet for stage in b["stages"]), quiet[-3000:]
    assert "Beginning flow run" not in quiet and "Finished in state" not in quiet and "| INFO" not in quiet
    assert a["ui"] == f"http://127.0.0.1:4200/runs/flow-run/{a['flow_run']}" and a["ui_served"] is False


BAD_INPUTS = {
    "md5 mismatch, truncated corpus": (
        ["--corpus", "{truncated}", "--set", "data.md5=6fb458f1232090904fb40fe944165e91"],
        ["md5 mismatch", "expected 6fb458f1232090904fb40fe944165e91", "--set data.md5=", "truncated or another file"],
    ),
    "empty corpus": (["--corpus", "{empty}", "--set", "data.md5=d41d8cd98f00b204e9800998ecf8427e"], ["is empty"]),
    "corpus shorter than a sequence": (
        ["--corpus", "{short}", "--set", "data.md5={short_md5}"],
        ["too few", "smaller data.seq_len"],
    ),
    # These ask for the real corpus' checksum, which the store does not hold yet: a
    # corpus already in the store would be reused whatever its source (by design).
    "missing corpus": (["--corpus", "{missing}", "--set", "data.md5={real_md5}"], ["does not exist", "--corpus"]),
    "URL not found": (
        ["--corpus", "{missing_url}", "--set", "data.md5={real_md5}"],
        ["could not download", "Not Found", "after 1 attempt(s)", "--corpus PATH"],
    ),
    "seq_len > max_seq_len": (["--set", "data.seq_len=64"], ["max_seq_len", "lower data.seq_len"]),
    "d_model not divisible": (["--set", "model.d_model=33"], ["not divisible", "num_heads"]),
    "zero steps": (["--set", "train.steps=0"], ["train.steps", "greater than 0"]),
    "negative batch": (["--set", "train.per_device_batch=-4"], ["train.per_device_batch", "greater than 0"]),
    "zero log interval": (["--set", "train.log_every=0"], ["train.log_every", "greater than 0"]),
    "zero checkpoint interval": (["--set", "train.checkpoint_every=0"], ["train.checkpoint_every"]),
    "negative temperature": (
        ["--set", 'generate.prompts=[{"text": "ROMEO:", "temperature": -1}]'],
        ["temperature", "greater than or equal to 0"],
    ),
    "empty prompt": (["--set", 'generate.prompts=[{"text": ""}]'], ["text", "at least 1 character"]),
    "unwritable store": (["--store", "{blocked}/store"], ["cannot write to the store", "--store / BARDFLOW_STORE"]),
    "unknown refresh stage": (["--refresh", "trian"], ["unknown stage 'trian'", "train_single"]),
    "unknown setting": (["--set", "train.stepz=3"], ["unknown setting 'train.stepz'", "bardflow presets"]),
    "wrong type": (["--set", "train.steps=many"], ["train.steps", "integer"]),
}


@pytest.fixture(scope="module")
def missing_url():
    """A URL on this machine that answers 404 (a refused connection is retried with backoff:
    tests/test_stages.py covers that)."""
    import http.server
    import threading

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    server.RequestHandlerClass = type(
        "NotFound",
        (http.server.BaseHTTPRequestHandler,),
        {"do_GET": lambda self: self.send_error(404), "log_message": lambda self, *args: None},
    )
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_port}/input.txt"
    finally:
        server.shutdown()


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_gets_one_clear_error_and_loses_nothing(case, tmp_path, corpus, run_env, missing_url):
    store = tmp_path / "store"
    md5 = md5_bytes(corpus.read_bytes())
    earlier, _ = produce(FETCH, DataConfig(corpus=str(corpus), md5=md5), {}, Store(store))  # an earlier version
    manifest_before = (earlier.path / "manifest.json").read_text()
    (tmp_path / "empty.txt").write_bytes(b"")
    (tmp_path / "short.txt").write_bytes(b"To be, or not to be")
    (tmp_path / "truncated.txt").write_bytes(corpus.read_bytes()[:1000])
    (tmp_path / "blocked").write_text("a file where a folder would go: no writes, even as root")
    values = {
        "empty": tmp_path / "empty.txt",
        "short": tmp_path / "short.txt",
        "missing": tmp_path / "gone.txt",
        "truncated": tmp_path / "truncated.txt",
        "blocked": tmp_path / "blocked",
        "short_md5": md5_bytes(b"To be, or not to be"),
        "real_md5": "6fb458f1232090904fb40fe944165e91",
        "missing_url": missing_url,
    }
    extra, words = BAD_INPUTS[case]

    def fill(arg: str) -> str:
        for name, value in values.items():
            arg = arg.replace("{" + name + "}", str(value))
        return arg

    done = call(*base_args(corpus, store, *map(fill, extra)), env=run_env, check=False)

    assert done.returncode != 0
    errors = [line for line in done.stderr.splitlines() if line.startswith("bardflow: error: ")]
    assert len(errors) == 1, done.stderr[-3000:]
    assert done.stderr.strip().splitlines()[-1] == errors[0], done.stderr[-3000:]  # the last line, after Prefect's own
    # Once: Prefect's own reports of it (the task's failure and state, the flow's) stay in the
    # log and the UI (the same line came four more times, as ERROR lines).
    assert done.stderr.count(errors[0].removeprefix("bardflow: error: ")[:80]) == 1, done.stderr[-3000:]
    for word in words:
        assert word in errors[0], errors[0]
    assert "Traceback" not in done.stderr, "an explained error is shown without a traceback"
    assert not list(store.glob("*/.build-*")), "a half-written version is visible"
    assert (earlier.path / "manifest.json").read_text() == manifest_before
    assert Store(store).lookup("fetch", earlier.key) is not None
    published = {p for p in store.glob("*/*") if not p.name.startswith(".") and not p.parent.name.startswith(".")}
    # Only a stage that succeeded before the failing one (a fetched corpus) may publish.
    assert {p.parent.name for p in published - {earlier.path}} <= {"fetch"}
    assert all(Store(store).lookup(p.parent.name, p.name) is not None for p in published)


@pytest.fixture
def small_disk(tmp_path, request):
    """A tmpfs of ``request.param`` bytes (root may mount one; elsewhere the test says why it skips)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={request.param}", "tmpfs", str(mount)], capture_output=True, text=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here ({done.stderr.strip() or done.returncode}): needs root")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)


@pytest.mark.flow
@pytest.mark.parametrize(
    "small_disk, line",
    [
        ("100k", "bardflow: error: no room for the encoded splits (train/, val/)"),  # refused before writing
        ("300k", "bardflow: error: no room for the checkpoint of step"),  # a training checkpoint
    ],
    indirect=["small_disk"],
    ids=["version", "checkpoint"],
)
def test_a_full_disk_ends_in_one_line_and_the_rerun_on_a_larger_one_finishes(small_disk, line, corpus, run_env):
    store = small_disk / "store"
    done = call(*base_args(corpus, store, devices=1), env=run_env, check=False)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1].startswith(line)
    assert "free some space or put the store on a larger disk" in done.stderr
    assert "Traceback" not in done.stderr and "Event loop is closed" not in done.stderr
    assert not list(store.glob("*/.lock-*")) and not list(store.glob("*/.build-*"))  # nothing half-written trusted
    if "checkpoint" not in line:
        return
    assert (store / "encode").is_dir()  # the stages before it are kept
    subprocess.run(["mount", "-o", "remount,size=4m", str(small_disk)], check=True)
    states = {
        name: s["state"]
        for name, s in json.loads(call(*base_args(corpus, store, devices=1), env=run_env).stdout)["stages"].items()
    }
    assert states["encode"] == "cached" and states["train_single"] == "ran"


@pytest.mark.parametrize("small_disk", ["8m"], indirect=True)
@pytest.mark.parametrize("server", ["kept", "embedded"])
def test_a_prefect_database_on_a_full_disk_is_refused_in_one_line_before_any_work(small_disk, server, corpus, tmp_path):
    """The server a run would start keeps its SQLite database in PREFECT_HOME: with no room to
    grow there, the run is refused before a server starts or a stage runs (a full disk
    mid-run ends in the same line: prefect_server/process.py, full_database)."""
    env = {name: value for name, value in os.environ.items() if name != "PREFECT_API_URL"}
    env.update(PREFECT_HOME=str(small_disk / "prefect"), BARDFLOW_CACHE_DIR=str(tmp_path / "cache"))
    env["BARDFLOW_SERVER"] = server
    store = tmp_path / "store"
    done = bardflow(*base_args(corpus, store, devices=1), env=env, check=False)
    assert done.returncode == 1, done.stderr[-3000:]
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith(f"bardflow: error: the disk under the Prefect database in {small_disk / 'prefect'} has ")
    assert "set PREFECT_HOME to a folder on a disk with room" in line
    assert not store.exists() and not (tmp_path / "cache" / "servers").exists()


@pytest.mark.flow
def test_a_training_process_that_aborts_in_a_collective_is_one_line_and_a_failed_run(
    tmp_path, corpus, run_env, prefect_server
):
    """On emulated CPU devices train_parallel trains in one supervised process, so that XLA's
    own end of a stalled collective (abort(): SIGABRT, a page of C++ stack trace) is this
    stage's failure: one line naming the step and both fixes, the trace left in the log,
    the Prefect run Failed, not Running."""
    store = tmp_path / "store"
    run = start(
        base_args(
            corpus,
            store,
            "--set",
            "train.steps=2000",
            "--set",
            "train.checkpoint_every=50",
            "--set",
            "train.single_device_steps=5",
        ),
        tmp_path / "run.log",
        run_env,
    )
    deadline = time.monotonic() + 300
    while not (
        list(store.glob("train_parallel/.resume-*/launch/process-0.pid"))
        and [s for s in checkpoint_steps(store, "train_parallel") if s >= 50]
    ):
        assert run.poll() is None and time.monotonic() < deadline, (tmp_path / "run.log").read_text()[-3000:]
        time.sleep(0.05)
    (pid_file,) = store.glob("train_parallel/.resume-*/launch/process-0.pid")
    os.kill(int(pid_file.read_text()), signal.SIGABRT)  # what XLA:CPU's rendezvous timeout does
    run.communicate(timeout=60)
    stderr = (tmp_path / "run.log").read_text()
    assert run.returncode == 1, stderr[-3000:]
    last = stderr.strip().splitlines()[-1]
    assert last.startswith(
        "bardflow: error: train_parallel failed: the training process was killed by signal 6 (SIGABRT) at step "
    ), last
    saved = max(checkpoint_steps(store, "train_parallel"))
    assert f"rerun the same command to resume from the checkpoint of step {saved}" in last
    assert "--cpu-devices 1" in last and "process-0.log" in last
    assert "Traceback" not in stderr and "Fatal Python error" not in stderr and " @ " not in stderr
    recent = prefect_server.api("/flow_runs/filter", {"sort": "START_TIME_DESC", "limit": 50})  # the server is shared
    (ours,) = [run for run in recent if run["parameters"].get("store") == str(store)]
    assert ours["state"]["type"] in ("FAILED", "CRASHED"), ours["state"]


def _bound_by_permissions(command: list[str]) -> list[str]:
    """``command`` as a process that file permissions bind: root keeps its uid but drops the
    capabilities that let it write into a folder without write permission."""
    if os.geteuid() != 0:
        return command
    if shutil.which("capsh") is None:
        pytest.skip("root here, and no capsh to drop the capabilities that override file permissions")
    return ["capsh", "--drop=cap_dac_override,cap_dac_read_search,cap_fowner", "--", "-c", shlex.join(command)]


@pytest.mark.flow
def test_a_store_that_turns_read_only_mid_run_ends_in_one_line_and_the_rerun_resumes(tmp_path, corpus, run_env):
    """Orbax's background writers meeting a read-only folder used to fail one by one while
    the others waited on them: ~750 lines, then a process that never exited."""
    store = tmp_path / "store"
    args = base_args(corpus, store, "--set", "train.steps=600", "--set", "train.checkpoint_every=100", devices=1)
    log = tmp_path / "run.log"
    run = subprocess.Popen(
        _bound_by_permissions(cli(*args)), cwd=REPO, env=run_env, stdout=subprocess.PIPE, stderr=open(log, "w")
    )
    deadline = time.monotonic() + 300
    while not [s for s in checkpoint_steps(store, "train_single") if s >= 100]:
        assert run.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.02)
    subprocess.run(["find", str(store), "-type", "d", "-exec", "chmod", "a-w", "{}", "+"], check=True)
    refused = time.monotonic()
    run.communicate(timeout=60)
    ended_s, stderr = time.monotonic() - refused, log.read_text()
    assert run.returncode == 1, stderr[-3000:]
    assert ended_s < 20, f"{ended_s:.1f} s from the refusal to the exit"
    (line,) = [line for line in stderr.splitlines() if "error" in line.lower()]
    assert line.startswith("bardflow: error: cannot write the checkpoint of step "), line
    assert "(Permission denied); make it writable or pick another with --store" in line
    assert "Traceback" not in stderr
    subprocess.run(["find", str(store), "-type", "d", "-exec", "chmod", "u+w", "{}", "+"], check=True)
    saved = max(checkpoint_steps(store, "train_single"))
    summary = json.loads(call(*args, env=run_env).stdout)
    assert summary["stages"]["train_single"]["state"] == "ran"
    (version,) = Store(store).versions("train_single")
    assert version.manifest["resumed_from_step"] == saved
    assert not list(store.glob("*/.lock-*")) and not list(store.glob("*/.build-*"))
