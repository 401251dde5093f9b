"""The README's "On a GPU worker" path, for real and on CPU: a Prefect server on
127.0.0.1, the README's own lines that create the pools and run `prefect deploy --all` from
this repository's prefect.yaml, a worker whose store is a bucket on an S3 server (as a pool of workers
shares one), and `prefect deployment run ... --watch`. Then a browser looks at the
artifacts as a person would."""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
import uuid
from datetime import datetime
from pathlib import Path

import pytest

from bardflow.tasks.registry import BYTES_RUN
from tests.cdp import Browser, chromium_binary
from tests.helpers import OUTPUT, REPO, SHARED_CORPUS, Webhook, call, play_text
from tests.servers import Server

pytestmark = pytest.mark.flow
STAGES = list(BYTES_RUN)  # the stages of a run of bytes: no tokenize
BIN = Path(sys.executable).parent


@pytest.fixture(scope="module")
def worker_corpus(tmp_path_factory) -> str:
    """The offline corpus a worker's host keeps (BARDFLOW_CORPUS): TinyShakespeare where a copy
    is at hand, else play-shaped text of its own."""
    if SHARED_CORPUS.exists():
        return SHARED_CORPUS.as_uri()
    generated = tmp_path_factory.mktemp("worker-corpus") / "corpus.txt"
    generated.write_bytes(play_text(300_000))
    return generated.as_uri()


def readme_steps() -> list[str]:
    """The README's commands that make the pools and the deployments ("On a GPU worker")."""
    section = (REPO / "README.md").read_text().split("## On a GPU worker", 1)[1]
    block = section.split("```bash\n", 1)[1].split("```", 1)[0]
    steps = [line for line in block.splitlines() if "work-pool create" in line or " deploy " in line]
    assert len(steps) == 2 and steps[-1] == "prefect --no-prompt deploy --all", steps
    return steps


@pytest.fixture(scope="module")
def deployed(prefect_server: Server, object_server, tmp_path_factory, worker_corpus):
    """The README's commands against the session's server: the `gpu` process pool, every
    deployment of prefect.yaml, and a worker (stopped when the module is done)."""
    store = object_server.prefix("deployed")
    with prefect_server.deployments():
        for line in readme_steps():  # the pools, then `prefect --no-prompt deploy --all`, exactly as written
            done = prefect_server.run("bash", "-c", f'PATH="{BIN}:$PATH"; {line}')
            assert done.returncode == 0, line + "\n" + done.stdout + done.stderr
    # The worker's host has an offline mirror of the corpus, the bucket's credentials and a
    # working folder of its own; flow runs inherit the worker's environment, as on a GPU host.
    worker = prefect_server.start(
        "worker",
        str(BIN / "prefect"),
        "worker",
        "start",
        "--pool",
        "gpu",
        env={
            **prefect_server.env,
            **object_server.env,
            "BARDFLOW_CORPUS": worker_corpus,
            "BARDFLOW_WORKDIR": str(tmp_path_factory.mktemp("worker-workdir")),
        },
    )
    try:
        yield prefect_server, store, object_server
    finally:
        prefect_server.stop_worker(worker)
        assert worker.poll() is not None, "the worker was left running"


@pytest.fixture(scope="module")
def first_deployment_run(deployed) -> dict:
    """`prefect deployment run 'bardflow-pipeline/pipeline'` on a fresh store, as the README says."""
    server, store, _ = deployed
    run_id, started = deployment_run(server, "bardflow-pipeline/pipeline", "preset=tiny", f"store={store}")
    return {"id": run_id, "started": started}


def deployment_run(server: Server, name: str, *params: str) -> tuple[str, float]:
    """Runs the README's command; returns the flow run id and when the command started."""
    started = time.time()
    args = [arg for p in params for arg in ("--param", p)]
    done = server.run(str(BIN / "prefect"), "deployment", "run", name, *args, "--watch", timeout=900)
    assert done.returncode == 0, f"{name} exited {done.returncode}:\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
    match = re.search(r"UUID:\s*([0-9a-f-]{36})", done.stdout)
    assert match, done.stdout
    return match.group(1), started


def test_deployment_runs_reruns_one_stage_and_generates_from_cache(deployed, first_deployment_run):
    server, store, bucket = deployed
    timings = {}
    tiny = ["preset=tiny", f"store={store}"]

    run_id = first_deployment_run["id"]
    flow_run = server.api("/flow_runs/filter", {"flow_runs": {"id": {"any_": [run_id]}}})[0]
    assert flow_run["state"]["type"] == "COMPLETED"
    assert set(server.stage_states(run_id).values()) == {"Completed"}
    timings["deployment_run_to_flow_start_s"] = round(
        datetime.fromisoformat(flow_run["start_time"]).timestamp() - first_deployment_run["started"], 1
    )
    keys = {a["key"] for a in server.api("/artifacts/filter", {"artifacts": {"flow_run_id": {"any_": [run_id]}}})}
    assert {f"bardflow-{s.replace('_', '-')}" for s in STAGES} <= keys

    # The second deployment: new samples, every other stage from the bucket. (--refresh
    # through the same parameters is tests/test_flow.py's.)
    started = time.time()
    run_id, _ = deployment_run(server, "bardflow-samples/generate", *tiny, 'prompts=["HAMLET:"]')
    timings["generate_run_s"] = round(time.time() - started, 1)
    states = server.stage_states(run_id)
    assert states == {s: ("Completed" if s == "generate" else "Cached") for s in STAGES}
    fs = bucket.filesystem()  # what the bucket holds, as any other machine would read it
    samples = [json.loads(fs.cat_file(p)) for p in fs.glob(f"{store[5:]}/generate/*/build-*/samples.json")]
    assert any(s[0]["prompt"] == "HAMLET:" for s in samples)

    (OUTPUT / "deployment").mkdir(parents=True, exist_ok=True)
    (OUTPUT / "deployment" / "timings.json").write_text(json.dumps(timings, indent=1))


def test_the_tpu_and_cpu_deployments_are_the_pipeline_on_pools_of_their_own(deployed):
    """prefect.yaml's `pipeline-tpu` and `pipeline-cpu`, as `deploy --all` registered them: the
    pipeline's flow on the pool `tpu` or `cpu`, with that platform's environment. A worker of
    any pool runs a deployment the same way (the `gpu` pool's runs above and below); what sets
    these two apart is what the server holds."""
    server, _, _ = deployed
    found = {
        d["name"]: d
        for d in server.api(
            "/deployments/filter", {"deployments": {"name": {"any_": ["pipeline", "pipeline-tpu", "pipeline-cpu"]}}}
        )
    }
    pipeline = found["pipeline"]
    for name, pool, preset in (("pipeline-tpu", "tpu", "codelab"), ("pipeline-cpu", "cpu", "cpu")):
        deployment = found[name]
        assert deployment["work_pool_name"] == pool
        assert (deployment["flow_id"], deployment["entrypoint"]) == (pipeline["flow_id"], pipeline["entrypoint"])
        assert deployment["parameters"] == {"preset": preset}
        env = deployment["job_variables"]["env"]
        assert env["JAX_PLATFORMS"] == pool and env["BARDFLOW_STORE"] == "store" and env["DO_NOT_TRACK"] == "1"
    assert {pool["name"] for pool in server.api("/work_pools/filter", {})} >= {"gpu", "tpu", "cpu"}


def test_the_ui_shows_every_stage_and_renders_the_plots(deployed, first_deployment_run):
    server, _, _ = deployed
    binary = chromium_binary()
    if binary is None:
        pytest.skip("chromium is not installed (.ci/run installs it)")
    run_filter = {"flow_run_id": {"any_": [first_deployment_run["id"]]}}
    compare = server.api("/artifacts/filter", {"artifacts": {"key": {"any_": ["bardflow-compare"]}, **run_filter}})
    plots = server.api("/artifacts/filter", {"artifacts": {"key": {"any_": ["bardflow-compare-plots"]}, **run_filter}})[
        0
    ]
    shots = OUTPUT / "deployment"
    shots.mkdir(parents=True, exist_ok=True)
    browser = Browser(binary)
    try:
        browser.open(f"{server.url}/artifacts", "document.body.innerText.includes('bardflow-generate')")
        listing = browser.text()
        browser.screenshot(shots / "artifacts.png")
        for stage in STAGES:
            assert f"bardflow-{stage.replace('_', '-')}" in listing

        browser.open(
            f"{server.url}/artifacts/artifact/{plots['id']}",
            "document.images.length >= 2 && [...document.images].every(i => i.complete)",
        )
        browser.screenshot(shots / "compare-plots.png")
        page = browser.text()
        # The comparison table's numbers, as the compare stage computed them.
        table = compare[0]["data"]
        for row in json.loads(table) if isinstance(table, str) else table:
            assert str(row["data-parallel (2 devices)"]) in page and str(row["single device"]) in page
        widths = browser.evaluate("[...document.images].map(i => i.naturalWidth)")
        assert len(widths) >= 2 and all(w > 0 for w in widths), widths
    finally:
        browser.close()


def test_a_cancelled_run_stops_training_the_rerun_resumes_and_a_killed_one_ends_crashed(deployed, run_env):
    """Cancelling, as the UI's Cancel and `prefect flow-run cancel` do: the worker sends SIGTERM, the
    flow run's process saves a checkpoint of the step it reached and exits well within the
    worker's grace period, the run and its stage end Cancelled, and the rerun resumes from that step. That
    rerun's process is then killed outright (out of memory, say): the worker reports the run
    Crashed within seconds, a message says so (bardflow notify), and the store keeps what the
    reliability table promises. (Training to the end after a stop is test_signals.py's.)"""
    server, store, bucket = deployed  # the first run's data, if it ran, come back cached
    # What `bardflow run --config` reads, as the deployment's settings (the preset named in it).
    settings = {"preset": "tiny", "train": {"steps": 4000, "log_every": 1000, "checkpoint_every": 4000}}
    params = {"store": store, "settings": settings}
    # One device, as on a host with one GPU: train_parallel reuses train_single's version (and
    # the tests' other XLA flags, tests/conftest.py, stay: the last device count counts).
    one_device = {"XLA_FLAGS": f"{os.environ['XLA_FLAGS']} --xla_force_host_platform_device_count=1"}
    # The host's training slot on (a name of this test's own): a cancelled run gives it back.
    slot = f"bardflow-training-cancel-{uuid.uuid4().hex[:8]}"
    one_device["BARDFLOW_TRAINING_SLOT"] = slot

    deployment = server.api("/deployments/name/bardflow-pipeline/pipeline")["id"]

    def start_run() -> str:
        """What `prefect deployment run` sends (the first test runs that command), without its
        interpreter's start-up."""
        return server.api(
            f"/deployments/{deployment}/create_flow_run", {"parameters": params, "job_variables": {"env": one_device}}
        )["id"]

    run_id = start_run()
    stopped = cancel_in_training(server, run_id)
    step = int(re.search(r"at step (\d+)", stopped).group(1))
    assert server.api(f"/v2/concurrency_limits/{slot}")["active_slots"] == 0

    hook = Webhook()
    call("notify", "add", hook.url, "--name", "deployment-tests", env=run_env)
    try:
        rerun = start_run()
        pid = wait_for_training(server, rerun)
        assert f"train_single: resuming from its checkpoint of step {step}" in messages_of(server, rerun)
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        while (state := server.api(f"/flow_runs/{rerun}")["state"])["type"] == "RUNNING":
            assert time.monotonic() - killed < CRASHED_WITHIN_S, "still Running"
            time.sleep(0.3)
        assert state["type"] == "CRASHED", state
        # Killed outright, it gave nothing back: the next run on the host takes the slot over
        # (tests/test_slots.py), else its lease lapses.
        assert server.api(f"/v2/concurrency_limits/{slot}")["active_slots"] == 1
        name = server.api(f"/flow_runs/{rerun}")["name"]
        message = hook.wait_for(lambda m: m["subject"] == f"bardflow: {name} crashed")
        assert message["body"].startswith(f"bardflow run {name} (bardflow-pipeline) crashed: ")
        assert message["body"].endswith(f"/runs/flow-run/{rerun}")
    finally:
        call("notify", "remove", "deployment-tests", env=run_env)
        hook.close()
    # The store as after any kill: the checkpoint that the cancel saved is in the bucket (its
    # commit record last), and no train_single version of this training was published.
    fs = bucket.filesystem()
    assert fs.glob(f"{store[5:]}/train_single/.resume-*/{step}.json")
    published = [json.loads(fs.cat_file(path)) for path in fs.glob(f"{store[5:]}/train_single/*/manifest.json")]
    assert not [m for m in published if m["params"]["train"]["steps"] == 4000]


CRASHED_WITHIN_S = 15  # the worker reports its flow run's process gone (docs/reliability.md)


def wait_for_training(server: Server, run_id: str) -> int:
    """Waits until train_single reports progress; the flow run's process id."""
    deadline = time.monotonic() + 300
    # A progress line: training is under way.
    while not any(m.startswith("train_single (") and "/4000" in m for m in messages_of(server, run_id)):
        state = server.api(f"/flow_runs/{run_id}")["state"]
        assert state["type"] in ("SCHEDULED", "PENDING", "RUNNING") and time.monotonic() < deadline, (
            f"the run never reached training: {state['type']} {state.get('message')}\n"
            + "\n".join(messages_of(server, run_id)[-20:])
        )
        time.sleep(0.5)
    return int(str(server.api(f"/flow_runs/{run_id}")["infrastructure_pid"]).rsplit(":", 1)[-1])


def cancel_in_training(server: Server, run_id: str) -> str:
    """Cancels the run once train_single reports progress; the run's line saying where it stopped."""
    pid = wait_for_training(server, run_id)
    cancelled = time.monotonic()
    cancelling = {"state": {"type": "CANCELLING", "name": "Cancelling"}}  # what the UI's Cancel and the CLI send
    assert server.api(f"/flow_runs/{run_id}/set_state", cancelling)["status"] == "ACCEPT"
    while (state := server.api(f"/flow_runs/{run_id}")["state"])["type"] not in (
        "CANCELLED",
        "FAILED",
        "COMPLETED",
        "CRASHED",
    ):
        assert time.monotonic() - cancelled < 30, "not stopped within the worker's grace period"
        time.sleep(0.3)
    assert state["type"] == "CANCELLED", state
    # The flow ends Cancelled itself; its process exits once Prefect has sent its last records.
    while Path(f"/proc/{pid}").exists() and Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z":
        assert time.monotonic() - cancelled < 30, "the flow run's process is still there"
        time.sleep(0.2)
    # A cancel is the user's choice: the stage ends Cancelled too, not Failed, with one line
    # that says where a new run of the deployment goes on, and the worker prints no error.
    assert server.stage_states(run_id)["train_single"] == "Cancelled"
    prefix = "cancelled: stopped by SIGTERM during train_single at step"
    stopped = [m for m in messages_of(server, run_id) if m.startswith(prefix)]
    assert len(stopped) == 1 and "is saved: run the deployment again to resume from it" in stopped[0], stopped
    # The worker's terminal: that line once, and no engine error or Prefect's repeat of it.
    terminal = (server.home / "worker.log").read_text()
    said = stopped[0].removeprefix("cancelled: ")
    assert terminal.count(said) == 1 and "Engine execution exited with unexpected exception" not in terminal
    return stopped[0]


def messages_of(server: Server, run_id: str) -> list[str]:
    """The run's newest 200 log messages, oldest first (the API returns at most 200 at a time)."""
    newest = server.api(
        "/logs/filter", {"logs": {"flow_run_id": {"any_": [run_id]}}, "sort": "TIMESTAMP_DESC", "limit": 200}
    )
    return [log["message"] for log in reversed(newest)]
