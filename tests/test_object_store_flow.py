"""The pipeline on a bucket that several machines share, through the real CLI: each
"machine" is a working folder of its own (``BARDFLOW_WORKDIR``), the S3 server is real
(SeaweedFS), and nothing but the bucket is shared between them."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from bardflow.processes.launch import free_port
from bardflow.tasks.registry import BYTES_RUN
from bench.commands import tiny
from tests.helpers import call, finish, play_text, start

pytestmark = pytest.mark.flow


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_bytes(play_text(64_000))
    return path


def machine(run_env: dict, object_server, workdir: Path, **extra: str) -> dict[str, str]:
    """The environment of a ``bardflow run`` on a machine whose only link to the others is the bucket."""
    return {**run_env, **object_server.env, "BARDFLOW_WORKDIR": str(workdir), **extra}


def args(corpus: Path, store: str, *extra: str) -> list[str]:
    return ["run", *tiny(corpus, store, "--json", *extra, devices=None)]


def committed(object_server, store: str) -> dict[str, list[str]]:
    """stage -> keys of the versions whose manifest is in the bucket; and the build prefixes."""
    fs = object_server.filesystem()
    found: dict[str, list[str]] = {}
    for path in fs.glob(f"{store[5:]}/*/*/manifest.json"):
        stage, key = path.split("/")[-3:-1]
        found.setdefault(stage, []).append(key)
    return found


def build_prefixes(object_server, store: str) -> set[str]:
    """The build prefixes that hold objects (SeaweedFS may keep an emptied one as a folder)."""
    found = object_server.filesystem().find(store[5:], detail=True)
    return {
        path.rsplit("/build-", 1)[0] + "/build-" + path.rsplit("/build-", 1)[1].split("/")[0]
        for path, info in found.items()
        if info["type"] == "file" and "/build-" in path
    }


def params_digest_of(version_path: str, workdir: Path) -> str:
    """The digest of a training version's parameters, read from the bucket."""
    from bardflow.artifacts.objects import open_store
    from bardflow.model.training.checkpoint import params_digest
    from bardflow.tasks.train import trained_model

    store, stage, key = version_path.rsplit("/", 2)
    return params_digest(trained_model(open_store(store, workdir).lookup(stage, key))[0])


@pytest.fixture(scope="module")
def shared_bucket(tmp_path_factory, corpus, run_env, object_server):
    """Two machines start on one empty bucket at the same moment: a two-host cluster run
    (process 0 and a follower, each with its own working folder) and a plain run."""
    store, root = object_server.prefix("shared"), tmp_path_factory.mktemp("machines")
    cluster = {"BARDFLOW_COORDINATOR": f"127.0.0.1:{free_port()}", "BARDFLOW_NUM_PROCESSES": "2"}
    leader = start(
        args(corpus, store, "--cpu-devices", "1"),
        root / "leader.log",
        machine(run_env, object_server, root / "host-0", BARDFLOW_PROCESS_ID="0", **cluster),
    )
    follower = start(
        args(corpus, store, "--cpu-devices", "1"),
        root / "follower.log",
        machine(run_env, object_server, root / "host-1", BARDFLOW_PROCESS_ID="1", **cluster),
    )
    try:
        # The plain run in this process, while the cluster's two run beside it.
        plain = json.loads(
            call(
                *args(corpus, store, "--cpu-devices", "2"), env=machine(run_env, object_server, root / "laptop")
            ).stdout
        )
        runs = {"cluster": finish(leader), "plain": plain}
        follower.communicate(timeout=60)
    finally:  # a follower whose leader failed would wait for it for an hour
        for process in (leader, follower):
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
    assert follower.returncode == 0, (root / "follower.log").read_text()[-2000:]
    return store, root, runs


def test_two_machines_building_at_once_share_one_version_of_each_stage(shared_bucket, object_server, monkeypatch):
    store, root, runs = shared_bucket
    cluster, plain = runs["cluster"]["stages"], runs["plain"]["stages"]
    versions = committed(object_server, store)
    for stage in ("fetch", "encode", "train_single"):  # asked for by both, built once
        assert versions[stage] == [cluster[stage]["key"]] == [plain[stage]["key"]], stage
    # train_parallel differs: 2 processes x 1 device there, 1 process x 2 devices here.
    assert cluster["train_parallel"]["metrics"]["processes"] == 2
    assert plain["train_parallel"]["metrics"]["processes"] == 1
    assert len(build_prefixes(object_server, store)) == sum(len(keys) for keys in versions.values())
    assert cluster["train_parallel"]["path"].startswith(store + "/train_parallel/")
    # The follower had no store of its own: it read the data from the bucket into its own folder.
    assert list((root / "host-1").rglob("train/00000.arrow"))
    assert not list((root / "host-1").rglob("corpus.txt")), "the follower reads only what it trains on"
    # Two processes, no shared filesystem: the same parameters to the last bit as one
    # process driving both devices.
    for name, value in object_server.env.items():
        monkeypatch.setenv(name, value)
    assert params_digest_of(cluster["train_parallel"]["path"], root / "check") == params_digest_of(
        plain["train_parallel"]["path"], root / "check"
    )


def test_a_worker_without_keys_of_its_own_takes_them_from_a_prefect_block(
    shared_bucket, object_server, corpus, run_env, prefect_server
):
    """BARDFLOW_STORE_CREDENTIALS names an AWS Credentials block (prefect-aws) on the server:
    keys, region and endpoint come from there; a wrong key in it is one line that names it."""
    from prefect.settings import PREFECT_API_URL, temporary_settings
    from prefect_aws import AwsCredentials

    store, root, _ = shared_bucket
    with temporary_settings(updates={PREFECT_API_URL: prefect_server.env["PREFECT_API_URL"]}):
        for name, secret in (("bucket-keys", object_server.SECRET_KEY), ("stale-keys", "wrong")):
            AwsCredentials(
                aws_access_key_id=object_server.ACCESS_KEY,
                aws_secret_access_key=secret,
                region_name="us-east-1",
                aws_client_parameters={"endpoint_url": object_server.url},
            ).save(name, overwrite=True)
    keyless = {k: v for k, v in machine(run_env, object_server, root / "keyless").items() if not k.startswith("AWS_")}
    cached = json.loads(
        call(
            *args(corpus, store, "--cpu-devices", "2"),
            env={**keyless, "BARDFLOW_STORE_CREDENTIALS": "aws-credentials/bucket-keys"},
        ).stdout
    )
    assert {s["state"] for s in cached["stages"].values()} == {"cached"}
    refused = call(
        *args(corpus, store, "--cpu-devices", "2"),
        env={**keyless, "BARDFLOW_STORE_CREDENTIALS": "aws-credentials/stale-keys"},
        check=False,
    )
    lines = [line for line in refused.stderr.splitlines() if line.startswith("bardflow: error:")]
    assert refused.returncode == 1 and len(lines) == 1, refused.stderr
    assert "AWS_SECRET_ACCESS_KEY" in lines[0] and "Prefect block aws-credentials/stale-keys" in lines[0]
    missing = call(
        *args(corpus, store), env={**keyless, "BARDFLOW_STORE_CREDENTIALS": "aws-credentials/none-such"}, check=False
    )
    assert missing.returncode == 1 and "the Prefect server has no such block" in missing.stderr.splitlines()[-1]


def test_a_third_machine_finds_every_stage_cached_and_repairs_what_is_damaged(
    shared_bucket, object_server, corpus, run_env
):
    store, root, runs = shared_bucket
    env = machine(run_env, object_server, root / "third")
    cached = json.loads(call(*args(corpus, store, "--cpu-devices", "2", "--processes", "2"), env=env).stdout)
    assert {s["state"] for s in cached["stages"].values()} == {"cached"}
    assert cached["stages"]["train_parallel"]["key"] == runs["cluster"]["stages"]["train_parallel"]["key"]
    rows = json.loads(call("artifacts", "--store", store, "--json", env=env).stdout)
    assert {row["stage"] for row in rows} == set(BYTES_RUN) and all(row["path"].startswith(store) for row in rows)

    fs = object_server.filesystem()
    (corpus_object,) = fs.glob(f"{store[5:]}/fetch/*/build-*/corpus.txt")
    fs.pipe_file(corpus_object, b"X" + fs.cat_file(corpus_object)[1:])  # bit rot in the bucket
    repaired = call(*args(corpus, store, "--cpu-devices", "2", "--refresh", "generate"), env=env)
    log, repaired = repaired.stderr, json.loads(repaired.stdout)
    states = {name: stage["state"] for name, stage in repaired["stages"].items()}
    assert states == {name: "ran" if name in ("fetch", "generate") else "cached" for name in BYTES_RUN}
    assert "damaged" in log
    assert repaired["stages"]["fetch"]["key"] == runs["plain"]["stages"]["fetch"]["key"]
    assert fs.cat_file(fs.glob(f"{store[5:]}/fetch/*/build-*/corpus.txt")[0]) == corpus.read_bytes()


def test_a_run_killed_on_one_machine_resumes_on_another(tmp_path, corpus, run_env, object_server, monkeypatch):
    """kill -9 (the machine and its disk gone), then the same run elsewhere: it resumes from
    the last checkpoint in the bucket and ends bitwise where a run never interrupted does."""
    store = object_server.prefix("resume")
    long = ("--set", "train.steps=300", "--set", "train.checkpoint_every=100", "--set", "train.log_every=100")
    # One device: train_single is what is cut short, and train_parallel then takes over its
    # version (no training process to start).
    victim = start(
        args(corpus, store, "--cpu-devices", "1", *long),
        tmp_path / "victim.log",
        machine(run_env, object_server, tmp_path / "preempted"),
    )
    fs, deadline = object_server.filesystem(), time.monotonic() + 300

    def committed_steps() -> list[int]:
        return [int(Path(p).stem) for p in fs.glob(f"{store[5:]}/train_single/.resume-*/*.json")]

    def saving_started() -> bool:
        """A checkpoint is being written on the victim's own disk (Orbax's folders begin with
        the step; listed while they are renamed)."""
        try:
            return any(
                entry.name[:1].isdigit()
                for folder in (tmp_path / "preempted").glob("*/train_single/.resume-*")
                for entry in folder.iterdir()
            )
        except FileNotFoundError:
            return False

    def alive() -> bool:
        return victim.poll() is None and time.monotonic() < deadline

    while not saving_started():
        assert alive(), "the run never began to save a checkpoint"
        time.sleep(0.02)
    # From its first save on, the run moves in slices of 20 ms and the bucket is listed while it
    # stands still: however fast the machine, it cannot commit a checkpoint, finish and publish
    # its version between two looks.
    while True:
        os.killpg(victim.pid, signal.SIGSTOP)
        if any(step >= 100 for step in committed_steps()):
            break
        os.killpg(victim.pid, signal.SIGCONT)
        assert alive(), "no checkpoint reached the bucket"
        time.sleep(0.02)
    os.killpg(victim.pid, signal.SIGKILL)  # the machine is gone, and its disk with it
    victim.wait()
    saved = max(committed_steps())

    resumed = json.loads(
        call(
            *args(corpus, store, "--cpu-devices", "1", *long),
            env=machine(run_env, object_server, tmp_path / "replacement"),
        ).stdout
    )
    single = resumed["stages"]["train_single"]
    assert single["state"] == "ran" and single["metrics"]["resumed_from_step"] == saved >= 100

    # Same loss history and bitwise the same parameters as the run never interrupted: the
    # same request trained here, in one go, by the code the stage runs.
    import jax

    from bardflow.artifacts.objects import open_store
    from bardflow.config.settings import TrainingRequest
    from bardflow.model.training.checkpoint import params_digest
    from bardflow.model.training.training_run import RunFiles, run_training
    from bardflow.tasks.train import trained_model
    from tests.helpers import without_seconds

    for name, value in object_server.env.items():
        monkeypatch.setenv(name, value)
    bucket = open_store(store, tmp_path / "checker")
    version = bucket.lookup("train_single", single["key"])
    assert version.manifest["resumed_from_step"] == saved
    data = bucket.lookup("encode", resumed["stages"]["encode"]["key"])
    assert not list(data.path.rglob("*.arrow"))  # a new machine's mirror: shards come as they are read
    files = RunFiles(
        train=data.file("train"),
        val=data.file("val"),
        resume=tmp_path / "ref-resume",
        state=tmp_path / "ref-state",
        shards=data.manifest["shards"],
        bring=data.bring,
    )
    reference = run_training(
        TrainingRequest.model_validate(version.manifest["params"]), files, [jax.devices()[0]], parallel=False
    )
    assert reference.metrics["resumed_from_step"] is None
    assert without_seconds(json.loads(version.file("history.json").read_text())) == without_seconds(reference.history)
    assert params_digest(trained_model(version)[0]) == reference.params_digest
    left = [
        p
        for p, info in fs.find(f"{store[5:]}/train_single", detail=True).items()
        if info["type"] == "file" and "/.resume-" in p
    ]
    assert not left, "the checkpoints go once the version is in"


@pytest.mark.parametrize("case", ["missing bucket", "wrong credentials", "unreachable endpoint"])
def test_a_store_that_cannot_be_used_stops_the_run_in_one_line(case, tmp_path, corpus, run_env, object_server):
    store = "s3://no-such-bucket-here/x" if case == "missing bucket" else object_server.prefix("refused")
    extra = {
        "wrong credentials": {"AWS_SECRET_ACCESS_KEY": "wrong"},
        "unreachable endpoint": {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{free_port()}"},
    }.get(case, {})
    done = call(*args(corpus, store), env=machine(run_env, object_server, tmp_path / "w", **extra), check=False)
    error = done.stderr.strip()
    assert done.returncode == 1
    lines = [line for line in error.splitlines() if line.startswith("bardflow: error:")]
    assert len(lines) == 1 and len(error.splitlines()) == 1, error
    assert {
        "missing bucket": "does not exist",
        "wrong credentials": "AWS_SECRET_ACCESS_KEY",
        "unreachable endpoint": "AWS_ENDPOINT_URL",
    }[case] in lines[0]
    assert not (tmp_path / "w").exists() or not list((tmp_path / "w").rglob("*.*"))
    if case != "missing bucket":
        assert committed(object_server, store) == {}
