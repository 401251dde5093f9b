"""train_parallel across processes: real JAX processes on 127.0.0.1 joined by
``jax.distributed`` with gloo CPU collectives, one emulated device each."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from bardflow.config.settings import TrackingTarget, TrainingRequest, build_config
from bardflow.model.data.splits import Batches, encode, write_split
from bardflow.model.training.checkpoint import TrainingCheckpoints, load_train_state
from bardflow.model.training.evaluation import val_batches
from bardflow.model.training.loop import TrainingSetup, train
from bardflow.model.training.placement import Placement
from bardflow.model.training.step import init_state
from bardflow.model.training.step_settings import resolve
from bardflow.processes.distributed import DistributedError, ProcessGroup
from bardflow.processes.launch import launch_local, process_command, process_env
from bardflow.tasks import train_process
from tests.helpers import REPO, base_args, call, checkpoint_steps, play_text, start

TINY = build_config("tiny")


def test_the_group_comes_from_bardflow_variables_or_the_scheduler():
    env = {"BARDFLOW_COORDINATOR": "10.0.0.1:1234", "BARDFLOW_NUM_PROCESSES": "4", "BARDFLOW_PROCESS_ID": "3"}
    assert ProcessGroup.from_env(env) == ProcessGroup(4, 3, "10.0.0.1:1234")
    assert ProcessGroup.from_env({"SLURM_NTASKS": "2", "SLURM_PROCID": "1"}) == ProcessGroup(2, 1, None)
    assert ProcessGroup.from_env({"SLURM_NTASKS": "1", "SLURM_PROCID": "0"}) is None
    assert ProcessGroup.from_env({"OMPI_COMM_WORLD_SIZE": "3", "OMPI_COMM_WORLD_RANK": "0"}) == ProcessGroup(3, 0, None)
    tpu = {"TPU_WORKER_HOSTNAMES": "t0,t1,t2,t3", "TPU_WORKER_ID": "2"}
    assert ProcessGroup.from_env(tpu) == ProcessGroup(4, 2, None)
    assert ProcessGroup.from_env({"TPU_WORKER_HOSTNAMES": "t0", "TPU_WORKER_ID": "0"}) is None  # one host
    indexed_job = {"BARDFLOW_COORDINATOR": "job-0.svc:1234", "BARDFLOW_NUM_PROCESSES": "2", "JOB_COMPLETION_INDEX": "1"}
    assert ProcessGroup.from_env(indexed_job) == ProcessGroup(2, 1, "job-0.svc:1234")
    assert ProcessGroup.from_env({}) is None
    for bad, message in [
        ({"BARDFLOW_NUM_PROCESSES": "2", "BARDFLOW_PROCESS_ID": "0"}, "BARDFLOW_COORDINATOR is not set"),
        ({**env, "BARDFLOW_PROCESS_ID": "4"}, "outside 0..3"),
        ({**env, "BARDFLOW_PROCESS_ID": "one"}, "must be integers"),
    ]:
        with pytest.raises(DistributedError, match=message):
            ProcessGroup.from_env(bad)


def test_a_run_takes_the_emulated_devices_its_flags_ask_for_even_where_jax_already_has_more(monkeypatch):
    """JAX reads XLA_FLAGS once: a run called in a process whose JAX emulates two CPU devices
    and asked for one (``--cpu-devices 1``, the last flag) trains on one."""
    from bardflow.processes.distributed import hardware, requested_cpu_devices

    flag = "--xla_force_host_platform_device_count"
    assert requested_cpu_devices(f"{flag}=2 --xla_dump_to=/tmp/x {flag}=1") == 1
    assert requested_cpu_devices("--xla_dump_to=/tmp/x") is None
    monkeypatch.setenv("XLA_FLAGS", f"{os.environ['XLA_FLAGS']} {flag}=1")
    assert hardware() == (1, "cpu")
    monkeypatch.setenv("XLA_FLAGS", f"{flag}=8")
    assert hardware() == (2, "cpu")  # never more than JAX has


def test_processes_must_share_the_devices_out_evenly():
    from bardflow.config.settings import ConfigError
    from bardflow.tasks.stage import RunPlan

    request = RunPlan(TINY, devices=2, platform="cpu", processes=2).parallel_training()
    assert request.model_dump(include={"devices", "processes"}) == {"devices": 2, "processes": 2}
    with pytest.raises(ConfigError, match="processes=3 cannot share out the 2 cpu device"):
        RunPlan(TINY, devices=2, platform="cpu", processes=3).parallel_training()


def test_every_process_gets_its_share_of_the_devices_and_no_gpu_preallocation():
    """What a host with N GPUs gives each of its N processes; the flow process itself never
    preallocates either (``bardflow run`` and the flow module set it before JAX starts)."""
    base = {"CUDA_VISIBLE_DEVICES": "4,5,6,7", "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    gpus = [process_env(i, 4, 1234, 1, "gpu", base) for i in range(4)]
    assert [env["CUDA_VISIBLE_DEVICES"] for env in gpus] == ["4", "5", "6", "7"]
    assert {env["XLA_PYTHON_CLIENT_PREALLOCATE"] for env in gpus} == {"false"}
    assert [env["BARDFLOW_PROCESS_ID"] for env in gpus] == ["0", "1", "2", "3"]
    assert {env["BARDFLOW_COORDINATOR"] for env in gpus} == {"127.0.0.1:1234"}
    two_each = [process_env(i, 2, 1234, 2, "gpu", {}) for i in range(2)]
    assert [env["CUDA_VISIBLE_DEVICES"] for env in two_each] == ["0,1", "2,3"]
    cpu = process_env(1, 2, 1234, 3, "cpu", base)
    assert cpu["XLA_FLAGS"] == "--xla_force_host_platform_device_count=3" and cpu["JAX_PLATFORMS"] == "cpu"

    from bardflow.flows.environment import prepare_environment

    saved = os.environ.pop("XLA_PYTHON_CLIENT_PREALLOCATE", None)
    try:
        prepare_environment()
        assert os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"
    finally:
        os.environ.pop("XLA_PYTHON_CLIENT_PREALLOCATE", None)
        if saved is not None:
            os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = saved


def describe_run(folder: Path, cfg, report: TrackingTarget | None = None) -> object:
    """Arrow files of a generated corpus and the description process 0 gets: ``spec.json``."""
    split = encode(play_text(64_000), TINY.data.seq_len, 0.9, 0)
    write_split(folder / "train", split.train, {})
    write_split(folder / "val", split.val, {})
    request = TrainingRequest(model=TINY.model, train=cfg, devices=2, platform="cpu", processes=2, report=report)
    (folder / "out").mkdir()
    spec = {
        "request": request.model_dump(mode="json"),
        "train": str(folder / "train"),
        "val": str(folder / "val"),
        "state": str(folder / "out" / "state"),
        "resume": str(folder / "resume"),
        "result": str(folder / "result.json"),
    }
    (folder / "spec.json").write_text(json.dumps(spec))
    return split


@pytest.mark.processes
def test_two_processes_train_exactly_like_one_process_with_two_devices(tmp_path):
    # Two passes per step: each process sums its passes' gradients, then one all-reduce; Muon
    # orthogonalises half of the matrices in each process, then a second one.
    cfg = TINY.train.model_copy(update={"steps": 40, "micro_batch": 2, "optimizer": "muon"})
    # Both processes are told where to track; process 0 alone writes.
    split = describe_run(tmp_path, cfg, TrackingTarget(stage="train_parallel", tensorboard=str(tmp_path / "tb")))
    seen = []
    launch_local(
        train_process,
        tmp_path / "spec.json",
        processes=2,
        devices_per_process=1,
        platform="cpu",
        on_step=lambda done, total: seen.append(done),
    )
    assert seen[-1] == 40  # process 0 reported its progress

    step = resolve(TINY.model, cfg, TINY.data.seq_len, "cpu")  # the settings a training run resolves here
    graphdef, state = init_state(step.model(TINY.model), cfg)
    one = train(
        TrainingSetup(
            graphdef,
            state,
            Batches(split.train, 8),
            val_batches(split.val, 8, multiple=2),
            Placement.data_parallel(jax.devices()),
            cfg,
            step=step,
        )
    )

    result = json.loads((tmp_path / "result.json").read_text())
    assert result["metrics"]["processes"] == 2 and result["metrics"]["devices"] == 2
    assert result["metrics"]["rows_per_pass"] == 2
    assert len(result["devices"]) == 2
    two_losses = [h["loss"] for h in result["history"]]
    # Measured: identical to the last bit (the same reduction over the same two shards);
    # the tolerance allows only float32 reassociation.
    np.testing.assert_allclose(two_losses, [h["loss"] for h in one.history], rtol=1e-6)
    np.testing.assert_allclose(result["metrics"]["val_loss"], one.val_loss, rtol=1e-4)  # rounded to 4 places
    _, template = init_state(TINY.model, cfg)
    saved = jax.tree.leaves(load_train_state(tmp_path / "out" / "state", template))
    for theirs, ours in zip(saved, jax.tree.leaves(jax.device_get(one.state)), strict=True):
        if np.issubdtype(np.asarray(ours).dtype, np.floating):
            np.testing.assert_allclose(np.asarray(theirs), np.asarray(ours), rtol=1e-6, atol=1e-7)
    (events,) = (tmp_path / "tb").iterdir()  # one writer: process 0's
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    reader = EventAccumulator(str(events))
    reader.Reload()
    assert [e.step for e in reader.Scalars("loss")] == [h["step"] for h in result["history"]]
    # Each process read only its own half of every batch.
    for index, rows in enumerate(("[0, 4)", "[4, 8)")):
        log = (tmp_path / f"process-{index}.log").read_text()
        assert f"process {index} of 2: rows {rows} of every global batch of 8" in log


@pytest.mark.processes
def test_two_processes_of_two_devices_resume_fsdp_training_and_end_like_one_process(tmp_path):
    """A checkpoint written here (two devices, fsdp) resumed by two processes of two devices
    each: every process holds its part of each split array, process 0 gathers the state to
    write the next checkpoint and the final state, and the losses are one process's."""
    # The cpu preset's width (arrays large enough to split), one block, a short context.
    shape = build_config("cpu", {"model.num_layers": 1, "data.seq_len": 32, "model.max_seq_len": 32})
    cfg = shape.train.model_copy(
        update={
            "steps": 8,
            "single_device_steps": 0,
            "warmup_steps": 2,
            "log_every": 1,
            "checkpoint_every": 2,
            "per_device_batch": 2,
            "sharding": "fsdp",
        }
    )
    split = encode(play_text(200_000), shape.data.seq_len, 0.9, 0, every_position=True)
    write_split(tmp_path / "train", split.train, {})
    write_split(tmp_path / "val", split.val[:16], {})
    # Here: the same global batch of 8 on this process's two devices, split the same way.
    step = resolve(shape.model, cfg, shape.data.seq_len, "cpu")
    here = cfg.model_copy(update={"per_device_batch": 4})
    graphdef, state = init_state(step.model(shape.model), here)
    checkpoints = TrainingCheckpoints(tmp_path / "resume", 8)
    one = train(
        TrainingSetup(
            graphdef,
            state,
            Batches(split.train, 8),
            [],
            Placement.data_parallel(jax.devices(), fsdp=True),
            here,
            checkpoints=checkpoints,
            step=step,
        )
    )
    checkpoints.close()
    for later in TrainingCheckpoints.steps(tmp_path / "resume")[1:]:  # from the checkpoint of step 2
        shutil.rmtree(tmp_path / "resume" / str(later))
    request = TrainingRequest(model=shape.model, train=cfg, devices=4, platform="cpu", processes=2)
    spec = {
        "request": request.model_dump(mode="json"),
        "train": str(tmp_path / "train"),
        "val": str(tmp_path / "val"),
        "state": str(tmp_path / "state"),
        "resume": str(tmp_path / "resume"),
        "result": str(tmp_path / "result.json"),
    }
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    launch_local(train_process, tmp_path / "spec.json", processes=2, devices_per_process=2, platform="cpu")
    resumed = json.loads((tmp_path / "result.json").read_text())
    assert resumed["metrics"]["layout"] == "fsdp" and resumed["metrics"]["devices"] == 4
    assert resumed["metrics"]["resumed_from_step"] == 2
    assert resumed["metrics"]["resumed_layout"] == {"devices": 2, "layout": "fsdp"}
    assert TrainingCheckpoints.steps(tmp_path / "resume")[-1] == 6  # written by process 0, gathered
    np.testing.assert_allclose([h["loss"] for h in resumed["history"]], [h["loss"] for h in one.history], rtol=1e-5)
    _, template = init_state(shape.model, here)
    saved = jax.tree.leaves(load_train_state(tmp_path / "state", template))
    for theirs, ours in zip(saved, jax.tree.leaves(jax.device_get(one.state)), strict=True):
        if np.issubdtype(np.asarray(ours).dtype, np.floating):
            # Measured: a few values differ by up to 3e-5 (Muon's matrices orthogonalised on
            # four devices, not two; Adam's division by small second moments spreads it); a part
            # of a state taken from the wrong device or process differs by its whole size, ~1e-2.
            np.testing.assert_allclose(np.asarray(theirs), np.asarray(ours), rtol=1e-2, atol=1e-4)


@pytest.mark.processes
def test_a_killed_process_fails_the_stage_fast_and_a_rerun_resumes(tmp_path, run_env):
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(play_text(64_000))
    store = tmp_path / "store"
    long = (
        "--processes",
        "2",
        "--set",
        "train.steps=100",
        "--set",
        "train.checkpoint_every=20",
        "--set",
        "train.single_device_steps=5",
    )
    run = start(base_args(corpus, store, *long), tmp_path / "killed.log", run_env)
    deadline = time.monotonic() + 300
    while not [s for s in checkpoint_steps(store, "train_parallel") if s >= 40]:
        assert run.poll() is None and time.monotonic() < deadline, (tmp_path / "killed.log").read_text()[-3000:]
        time.sleep(0.05)
    (pid_file,) = store.glob("train_parallel/.resume-*/launch/process-1.pid")  # written by the launcher
    os.kill(int(pid_file.read_text()), signal.SIGKILL)
    killed_at = time.monotonic()
    run.communicate(timeout=60)
    assert time.monotonic() - killed_at < 60
    assert run.returncode == 1
    error = (tmp_path / "killed.log").read_text().strip().splitlines()
    last = next(line for line in reversed(error) if line.startswith("bardflow: error:"))
    assert "train_parallel failed: process 1 of 2 was killed by signal 9 (SIGKILL)" in last
    saved = max(checkpoint_steps(store, "train_parallel"))
    assert f"rerun the same command to resume from the checkpoint of step {saved}" in "\n".join(error)
    assert not list(store.glob("train_parallel/[0-9a-f]*"))  # nothing published

    summary = json.loads(call(*base_args(corpus, store, *long), env=run_env).stdout)
    metrics = summary["stages"]["train_parallel"]["metrics"]
    assert summary["stages"]["train_parallel"]["state"] == "ran"
    assert metrics["resumed_from_step"] == saved and metrics["processes"] == 2 and metrics["steps"] == 100
    assert summary["stages"]["verify"]["metrics"]["passed"] is True
    assert not list(store.glob("train_parallel/.resume-*"))  # resume state is removed once published
    assert not list(store.glob("*/.build-*")), "no half-built version is left behind"


# A run's launcher, as the train_parallel stage is one: it trains the spec in one supervised
# process of two emulated devices (what `--cpu-devices 2` does).
LAUNCHER = (
    "import sys; from pathlib import Path; from bardflow.processes.launch import launch_local; "
    "from bardflow.tasks import train_process; launch_local(train_process, Path(sys.argv[1]), 1, 2, 'cpu')"
)


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


@pytest.mark.processes
def test_a_training_process_stops_with_its_run_and_leaves_its_resume_folder_to_the_rerun(tmp_path):
    """`kill -9` of a run's whole process group, mid-training: the training process (a
    session of its own, out of that group's reach) stops within seconds instead of training
    on, and leaves the resume folder to the rerun; while it ran, it was the folder's one
    writer."""
    from bardflow.artifacts.resume import ResumeFolder
    from bardflow.errors import StoreError

    describe_run(tmp_path, TINY.train.model_copy(update={"steps": 100_000, "checkpoint_every": 10, "log_every": 10}))
    spec = json.loads((tmp_path / "spec.json").read_text())
    spec["request"]["processes"] = 1
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    run = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, str(tmp_path / "spec.json")],
        cwd=REPO,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    resume = ResumeFolder(tmp_path / "resume")
    deadline = time.monotonic() + 120
    while not (TrainingCheckpoints.steps(resume.path) and (tmp_path / "process-0.pid").exists()):
        assert run.poll() is None and time.monotonic() < deadline, (tmp_path / "process-0.log").read_text()[-2000:]
        time.sleep(0.05)
    trainer = int((tmp_path / "process-0.pid").read_text())
    with pytest.raises(StoreError, match=rf"process {trainer} still writes checkpoints"):
        with resume.writing(wait_s=0):
            pass
    os.killpg(run.pid, signal.SIGKILL)
    run.wait()
    killed = time.monotonic()
    while _alive(trainer):
        assert time.monotonic() - killed < 15, "the training process trains on without its run"
        time.sleep(0.1)
    with resume.writing(wait_s=0):  # free at once
        steps = TrainingCheckpoints.steps(resume.path)
    time.sleep(1.0)
    assert TrainingCheckpoints.steps(resume.path) == steps and not (tmp_path / "result.json").exists()
    assert "is gone" in (tmp_path / "process-0.log").read_text()


@pytest.mark.processes
def test_without_a_launcher_a_dead_process_stops_the_other_within_the_heartbeat_timeout(tmp_path):
    """What a cluster relies on: JAX's coordination service notices the missing heartbeats."""
    describe_run(tmp_path, TINY.train.model_copy(update={"steps": 100_000, "checkpoint_every": 100_000}))
    from bardflow.processes.distributed import HEARTBEAT
    from bardflow.processes.launch import free_port

    port, timeout_s = free_port(), 5  # shorter than the default 30 s, to keep the test short
    logs = [tmp_path / f"p{i}.log" for i in range(2)]
    processes = [
        subprocess.Popen(
            process_command(train_process, tmp_path / "spec.json" if i == 0 else None),
            cwd=REPO,
            env=process_env(i, 2, port, 1, "cpu", {**os.environ, HEARTBEAT: str(timeout_s)}),
            stdout=open(logs[i], "w"),
            stderr=subprocess.STDOUT,
        )
        for i in range(2)
    ]
    try:
        deadline = time.monotonic() + 120
        while not re.search(r"bardflow-progress [1-9]\d+ ", logs[0].read_text()):  # training, past step 10
            assert processes[0].poll() is None and time.monotonic() < deadline, logs[0].read_text()[-2000:]
            time.sleep(0.5)
        processes[1].kill()
        killed_at = time.monotonic()
        processes[0].wait(timeout=90)
        assert time.monotonic() - killed_at < timeout_s + 30
        assert processes[0].returncode != 0
        assert "stopped sending heartbeats" in logs[0].read_text()
    finally:
        for process in processes:
            process.kill()


def test_cluster_examples_run_the_same_command_on_every_host():
    import yaml

    service, job = yaml.safe_load_all((REPO / "deploy" / "kubernetes" / "train-job.yaml").read_text())
    assert service["kind"] == "Service" and service["spec"]["clusterIP"] == "None"
    assert job["apiVersion"] == "batch/v1" and job["kind"] == "Job"
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed" and spec["completions"] == spec["parallelism"]
    pod = spec["template"]["spec"]
    assert pod["subdomain"] == service["metadata"]["name"]
    assert service["spec"]["selector"].items() <= spec["template"]["metadata"]["labels"].items()
    (container,) = pod["containers"]
    assert container["command"][:2] == ["bardflow", "run"]
    env = {e["name"]: e for e in container["env"]}
    assert env["BARDFLOW_NUM_PROCESSES"]["value"] == str(spec["completions"])
    assert (
        env["BARDFLOW_PROCESS_ID"]["valueFrom"]["fieldRef"]["fieldPath"]
        == "metadata.annotations['batch.kubernetes.io/job-completion-index']"
    )
    host, port = env["BARDFLOW_COORDINATOR"]["value"].rsplit(":", 1)
    assert host == f"{job['metadata']['name']}-0.{service['metadata']['name']}"
    assert int(port) == service["spec"]["ports"][0]["port"] == container["ports"][0]["containerPort"]
    mounts = {m["name"] for m in container["volumeMounts"]}
    assert mounts == {v["name"] for v in pod["volumes"]}
    # No shared volume: the store is a bucket, credentials come from a Secret, and each pod
    # keeps its working folder on a volume of its own.
    assert env["BARDFLOW_STORE"]["value"].startswith("s3://")
    assert container["envFrom"][0]["secretRef"]["name"]
    assert all("emptyDir" in v for v in pod["volumes"])
    assert any(m["mountPath"] == env["BARDFLOW_WORKDIR"]["value"] for m in container["volumeMounts"])

    sbatch = REPO / "deploy" / "slurm" / "train.sbatch"
    subprocess.run(["bash", "-n", str(sbatch)], check=True)  # the shell syntax
    text = sbatch.read_text()
    directives = dict(re.findall(r"^#SBATCH --([\w-]+)=(\S+)", text, re.M))
    assert int(directives["nodes"]) >= 2 and directives["ntasks-per-node"] == "1"
    assert re.search(r"^srun .*bardflow run", text, re.M)
    # What each srun task sees is a group of its own.
    assert ProcessGroup.from_env({"SLURM_NTASKS": directives["nodes"], "SLURM_PROCID": "1"}).process_id == 1
