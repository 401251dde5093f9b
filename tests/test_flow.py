"""The pipeline end to end through the real CLI, on Prefect's embedded server,
with 2 emulated CPU devices and the tiny preset."""

import json
import os
import shutil
import subprocess
import sys

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.flow
STAGES = ["fetch", "encode", "train_single", "train_parallel", "compare", "checkpoint", "verify", "generate"]


def bardflow(*args, check=True):
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "200"}
    done = subprocess.run(
        [sys.executable, "-m", "flows.cli", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=900
    )
    if check and done.returncode != 0:
        raise AssertionError(f"bardflow {' '.join(args)} exited {done.returncode}:\n{done.stderr[-4000:]}")
    return done


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    from tests.conftest import md5_bytes, play_text

    root = tmp_path_factory.mktemp("flow")
    corpus = root / "corpus.txt"
    corpus.write_bytes(play_text(64_000))
    common = ["--preset", "tiny", "--corpus", str(corpus), "--store", str(root / "store"),
              "--set", f"data.md5={md5_bytes(corpus.read_bytes())}", "--cpu-devices", "2", "--json"]
    return root / "store", common


def run(common, *extra):
    summary = json.loads(bardflow("run", *common, *extra).stdout)
    return summary, {name: stage["state"] for name, stage in summary["stages"].items()}


def only(*ran):
    return {stage: ("ran" if stage in ran else "cached") for stage in STAGES}


def test_pipeline_runs_caches_refreshes_and_heals(workspace):
    store, common = workspace

    summary, states = run(common)
    assert states == only(*STAGES)
    stages = summary["stages"]
    assert stages["train_parallel"]["metrics"]["devices"] == 2
    assert stages["train_parallel"]["metrics"]["global_batch"] == 2 * stages["train_single"]["metrics"]["global_batch"]
    assert stages["verify"]["metrics"]["passed"] is True
    for name in ("throughput.png", "curves.png", "comparison.json"):
        assert (store / "compare" / stages["compare"]["key"] / name).stat().st_size > 0
    samples = json.loads((store / "generate" / stages["generate"]["key"] / "samples.json").read_text())
    assert [s["prompt"] for s in samples] == ["ROMEO:", "To be, or not"]
    records = list((store / ".prefect-results").iterdir())
    assert len(records) == len(STAGES)  # the cache lives beside the store it describes
    for record in records:  # task results are JSON, never pickle
        content = json.loads(record.read_text())
        assert content["metadata"]["serializer"]["type"] == "json"
        assert json.loads(content["result"])["stage"] in STAGES

    listing = json.loads(bardflow("artifacts", "--store", str(store), "--json").stdout)
    assert {row["stage"] for row in listing} == set(STAGES)
    assert all(row["bytes"] > 0 and row["created"] for row in listing)
    table = bardflow("artifacts", "train_parallel", "--store", str(store)).stdout
    assert stages["train_parallel"]["key"] in table and "tokens_per_s" in table

    assert run(common)[1] == only()  # identical rerun: everything cached
    assert run(common, "--refresh", "generate")[1] == only("generate")
    assert run(common, "--set", "generate.max_new_bytes=12")[1] == only("generate")

    # A model or training change reruns training and all after it; data stays cached.
    assert run(common, "--set", "train.steps=6")[1] == only(*STAGES[2:])

    # A version folder deleted by hand is rebuilt; nothing else reruns.
    shutil.rmtree(store / "compare" / stages["compare"]["key"])
    assert run(common)[1] == only("compare")

    # A damaged file is caught by its checksum and rebuilt; the rebuilt data is
    # identical, so everything downstream stays cached.
    arrow = store / "encode" / stages["encode"]["key"] / "train.arrow"
    data = bytearray(arrow.read_bytes())
    data[len(data) // 2] ^= 0xFF
    arrow.write_bytes(bytes(data))
    assert run(common)[1] == only("encode")


READ_ARTIFACTS = """
import json, sys
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey
from prefect.client.schemas.sorting import ArtifactSort
with get_client(sync_client=True) as client:
    found = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=sys.argv[1:])),
                                  sort=ArtifactSort.CREATED_DESC)
print(json.dumps([{"key": a.key, "type": a.type, "data": a.data} for a in found]))
"""


def test_every_stage_left_artifacts_for_the_ui(workspace):
    """Read back through the Prefect API (an embedded server on the runs' database), newest
    first: the session's database also holds other tests' runs, some stopped on purpose."""
    expected = {f"bardflow-{s.replace('_', '-')}" for s in STAGES} | {
        "bardflow-compare-plots", "bardflow-train-single-progress", "bardflow-train-parallel-progress"}
    done = subprocess.run([sys.executable, "-c", READ_ARTIFACTS, *sorted(expected)], capture_output=True,
                          text=True, timeout=600, check=True)
    by_key = {}
    for artifact in json.loads(done.stdout):
        by_key.setdefault(artifact["key"], []).append(artifact)
    assert set(by_key) == expected
    assert len(by_key["bardflow-generate"]) >= 3  # one per run that generated: a history
    assert by_key["bardflow-compare-plots"][0]["data"].count("data:image/png;base64,") == 2
    assert "Tokens/s" in by_key["bardflow-compare"][0]["data"]
    assert by_key["bardflow-train-parallel-progress"][0]["data"] == 100.0


def test_cli_refuses_bad_input_before_any_work(workspace, tmp_path):
    _, common = workspace
    done = bardflow("run", *common, "--refresh", "trian", check=False)
    assert done.returncode == 2 and "unknown stage 'trian'" in done.stderr and "train_single" in done.stderr
    done = bardflow("run", *common, "--set", "train.stepz=3", check=False)
    assert done.returncode == 1 and "unknown setting 'train.stepz'" in done.stderr
    assert "Traceback" not in done.stderr


def test_servers_bind_to_this_machine_by_default():
    from flows.cli import _parser

    assert _parser().parse_args(["ui"]).host == "127.0.0.1"


@pytest.mark.parametrize("command", [[], ["run"], ["presets"], ["artifacts"], ["ui"]])
def test_every_command_has_help(command):
    done = bardflow(*command, "--help")
    assert done.stdout.startswith("usage: bardflow")
