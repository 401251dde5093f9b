"""Tracking through the real CLI and the real libraries: over HTTP, a tracking server killed
mid-run costs one warning line and the run completes. (A run tracked in MLflow and
TensorBoard, and its cached rerun, read back with their own readers: tests/test_flow.py.)"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from bardflow.config.settings import ConfigError
from bardflow.flows.tracking import track_settings
from bardflow.model.training.trackers import scalars
from bardflow.processes.launch import free_port
from tests.helpers import base_args, finish, logged, play_text, require, start
from tests.servers import stop

require("mlflow")


def test_records_become_scalars_with_the_throughput_between_them():
    history = [
        {"step": 0, "loss": 5.0, "val_loss": 5.1, "val_bpb": 7.4, "tokens": 100, "seconds": 0.5},
        {"step": 10, "loss": 4.0, "val_loss": None, "val_bpb": None, "tokens": 1100, "seconds": 2.5},
    ]
    assert scalars(history) == [
        (0, {"loss": 5.0, "val_loss": 5.1, "val_bpb": 7.4}),
        (10, {"loss": 4.0, "tokens_per_s": 500.0}),
    ]


def test_a_run_says_where_its_trackers_wrote_and_how_to_see_it():
    from bardflow.config.settings import TrackConfig
    from bardflow.flows.tracking import RunTracking

    lines = RunTracking(TrackConfig(tensorboard="runs"), "bold-fox", print).where()
    assert lines == ["TensorBoard: event files in runs/bold-fox; see them with `tensorboard --logdir runs`"]


def test_track_options_name_a_destination_or_take_the_default(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert track_settings(["mlflow", "tensorboard"]) == {
        "track.mlflow": f"sqlite:///{tmp_path / 'mlflow.db'}",
        "track.tensorboard": str(tmp_path / "runs"),
    }
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5000")
    assert track_settings(["mlflow", "tensorboard=tb"]) == {
        "track.mlflow": "http://127.0.0.1:5000",
        "track.tensorboard": str(tmp_path / "tb"),
    }
    with pytest.raises(ConfigError, match="unknown tracker 'wandb'.*--track mlflow"):
        track_settings(["wandb"])


@pytest.mark.parametrize("where", ["file:///tmp/mlruns", "mlruns", "/tmp/mlruns"])
def test_an_mlflow_folder_is_refused_naming_the_database_form(where):
    """MLflow 3 refuses its file store with a 120-line traceback, after the run began."""
    from bardflow.config.settings import build_config

    with pytest.raises(ConfigError) as refused:
        build_config("tiny", track_settings([f"mlflow={where}"]))
    message = str(refused.value)
    assert message.startswith(f"invalid configuration: track.mlflow: {where!r} is a folder; MLflow no longer")
    assert "--track mlflow=sqlite:///PATH/mlflow.db" in message and "Value error" not in message


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory, mlflow_db):
    """``mlflow server`` on a free loopback port, started with the module (it takes a while)
    and waited for by the test that uses it."""
    home = tmp_path_factory.mktemp("mlflow-server")
    mlflow_db(home / "mlflow.db")
    port = free_port()
    command = [
        str(Path(sys.executable).parent / "mlflow"),
        "server",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--backend-store-uri",
        f"sqlite:///{home / 'mlflow.db'}",
        "--artifacts-destination",
        str(home / "artifacts"),
        "--workers",
        "1",
    ]
    log = home / "server.log"
    # Without MLflow 3's job runner (six more processes, for GenAI evaluation jobs): a tracking
    # server, as a team runs one for training runs.
    process = subprocess.Popen(
        command,
        cwd=home,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},
    )
    try:
        yield {
            "process": process,
            "url": f"http://127.0.0.1:{port}",
            "db": f"sqlite:///{home / 'mlflow.db'}",
            "log": log,
        }
    finally:
        stop(process)


def wait_up(server: dict, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert server["process"].poll() is None, server["log"].read_text()[-3000:]
        try:
            urllib.request.urlopen(f"{server['url']}/health", timeout=2)
            return
        except OSError:
            time.sleep(0.3)
    raise AssertionError("mlflow server did not come up:\n" + server["log"].read_text()[-3000:])


@pytest.mark.flow
def test_a_tracking_server_killed_mid_run_costs_one_warning_and_the_run_completes(tmp_path, run_env, mlflow_server):
    from mlflow.tracking import MlflowClient

    wait_up(mlflow_server)
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(play_text(64_000, seed=12))
    steps = 400
    taken = tmp_path / "taken"  # a file where the TensorBoard folder should be: no folder can be made there
    taken.write_text("")
    # One device: the subject is the tracking, not parallel training (no training process).
    args = base_args(
        corpus,
        tmp_path / "store",
        "--track",
        f"mlflow={mlflow_server['url']}",
        "--track",
        f"tensorboard={taken}",
        "--set",
        f"train.steps={steps}",
        "--set",
        "train.log_every=10",
        "--set",
        f"train.checkpoint_every={steps}",
        devices=1,
    )
    log = tmp_path / "run.log"
    run = start(args, log, run_env)
    client = MlflowClient(mlflow_server["url"])
    deadline = time.monotonic() + 300
    while True:  # its first records reach the server over HTTP, as training goes on
        assert run.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        experiment = client.get_experiment_by_name("bardflow")
        found = experiment and client.search_runs([experiment.experiment_id])
        if found and "train_single/loss" in found[0].data.metrics:
            break
        time.sleep(0.2)
    os.killpg(mlflow_server["process"].pid, signal.SIGKILL)
    summary = finish(run)
    stderr = log.read_text()
    assert {row["state"] for row in summary["stages"].values()} == {"ran"}
    warnings = [line for line in stderr.splitlines() if "MLflow at" in line]
    assert len(warnings) == 1, stderr[-3000:]
    assert f"MLflow at {mlflow_server['url']} failed while" in warnings[0] and "goes on without it" in warnings[0]
    # A TensorBoard folder that cannot be made: one warning for the run, not one per training stage.
    warnings = [line for line in stderr.splitlines() if "TensorBoard at" in line]
    assert len(warnings) == 1 and f"TensorBoard at {taken} failed" in warnings[0], stderr[-3000:]
    assert "Traceback" not in stderr
    # What reached the server before it died is in its database; the run was never ended.
    local = MlflowClient(mlflow_server["db"])
    (tracked,) = local.search_runs([local.get_experiment_by_name("bardflow").experiment_id])
    assert tracked.info.status == "RUNNING" and tracked.data.tags["prefect.flow_run_id"] == summary["flow_run"]
    steps_logged = [step for step, _ in logged(local, tracked.info.run_id, "train_single/loss")]
    assert steps_logged and steps_logged == sorted(steps_logged) and steps_logged[-1] < steps - 1
    assert all(step % 10 == 0 for step in steps_logged)
