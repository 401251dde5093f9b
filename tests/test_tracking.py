"""Tracking through the real CLI and the real libraries: a run is one MLflow run (read back
with MlflowClient) and TensorBoard event files (read back with TensorBoard's own reader);
a fully cached rerun shows the same curves; over HTTP, a tracking server killed mid-run
costs one warning line and the run completes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from bardflow.flows.tracking import track_settings
from bardflow.model.config import ConfigError, build_config
from bardflow.runtime.launch import free_port
from bardflow.runtime.tracking import scalars
from tests.helpers import base_args, call, finish, play_text, start
from tests.servers import stop

mlflow_tracking = pytest.importorskip("mlflow.tracking")
TRAINING = ("train_single", "train_parallel")


def test_records_become_scalars_with_the_throughput_between_them():
    history = [{"step": 0, "loss": 5.0, "val_loss": 5.1, "val_bpb": 7.4, "tokens": 100, "seconds": 0.5},
               {"step": 10, "loss": 4.0, "val_loss": None, "val_bpb": None, "tokens": 1100, "seconds": 2.5}]
    assert scalars(history) == [(0, {"loss": 5.0, "val_loss": 5.1, "val_bpb": 7.4}),
                                (10, {"loss": 4.0, "tokens_per_s": 500.0})]


def test_track_options_name_a_destination_or_take_the_default(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert track_settings(["mlflow", "tensorboard"]) == {"track.mlflow": f"sqlite:///{tmp_path / 'mlflow.db'}",
                                                         "track.tensorboard": str(tmp_path / "runs")}
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5000")
    assert track_settings(["mlflow", "tensorboard=tb"]) == {"track.mlflow": "http://127.0.0.1:5000",
                                                            "track.tensorboard": str(tmp_path / "tb")}
    with pytest.raises(ConfigError, match="unknown tracker 'wandb'.*--track mlflow"):
        track_settings(["wandb"])


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    """``mlflow server`` on a free loopback port, started with the module (it takes a while)
    and waited for by the test that uses it."""
    home = tmp_path_factory.mktemp("mlflow-server")
    port = free_port()
    command = [str(Path(sys.executable).parent / "mlflow"), "server", "--host", "127.0.0.1", "--port", str(port),
               "--backend-store-uri", f"sqlite:///{home / 'mlflow.db'}", "--artifacts-destination",
               str(home / "artifacts"), "--workers", "1"]
    log = home / "server.log"
    process = subprocess.Popen(command, cwd=home, stdout=log.open("w"), stderr=subprocess.STDOUT,
                               start_new_session=True)
    try:
        yield {"process": process, "url": f"http://127.0.0.1:{port}", "db": f"sqlite:///{home / 'mlflow.db'}",
               "log": log}
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


def logged(client, run_id: str, name: str) -> list[tuple[int, float]]:
    return [(m.step, m.value) for m in client.get_metric_history(run_id, name)]


def assert_curve(found: list[tuple[int, float]], history: list[dict], name: str) -> None:
    assert [step for step, _ in found] == [h["step"] for h in history], name
    assert [value for _, value in found] == pytest.approx([h[name] for h in history]), name


@pytest.mark.flow
def test_a_run_is_one_mlflow_run_and_event_files_and_a_cached_rerun_shows_the_same(tmp_path, run_env,
                                                                                   mlflow_server):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(play_text(64_000, seed=11))
    uri, events = f"sqlite:///{tmp_path / 'mlflow.db'}", tmp_path / "tb"
    args = base_args(corpus, tmp_path / "store", "--track", f"mlflow={uri}", "--track", f"tensorboard={events}")
    first = json.loads(call(*args, env=run_env).stdout)
    second = json.loads(call(*args, env=run_env).stdout)
    assert {s["state"] for s in second["stages"].values()} == {"cached"}

    client = mlflow_tracking.MlflowClient(uri)
    experiment = client.get_experiment_by_name("bardflow")
    runs = client.search_runs([experiment.experiment_id], order_by=["attributes.start_time ASC"])
    assert [run.info.status for run in runs] == ["FINISHED", "FINISHED"]
    preset = build_config("tiny")
    for run, summary in zip(runs, (first, second)):
        tags, params = run.data.tags, run.data.params
        assert tags["prefect.flow_run_id"] == summary["flow_run"]
        assert tags["prefect.flow_run_url"].endswith(f"/runs/flow-run/{summary['flow_run']}")
        assert tags["bardflow.store"] == str(tmp_path / "store")
        assert {stage: tags[f"bardflow.version.{stage}"] for stage in summary["stages"]} == {
            stage: row["key"] for stage, row in summary["stages"].items()}
        # The whole configuration, as resolved: the preset, the corpus and the --set on top.
        assert params["train.steps"] == str(preset.train.steps) and params["model.d_model"] == str(preset.model.d_model)
        assert params["data.corpus"] == str(corpus) and len(params["data.md5"]) == 32
        assert {key.partition(".")[0] for key in params} == {"data", "model", "train", "verify", "generate"}
        for stage in TRAINING:
            history = json.loads((Path(summary["stages"][stage]["path"]) / "history.json").read_text())
            for name in ("loss", "val_loss", "val_bpb"):
                assert_curve(logged(client, run.info.run_id, f"{stage}/{name}"), history, name)
            throughput = logged(client, run.info.run_id, f"{stage}/tokens_per_s")
            assert [step for step, _ in throughput] == [h["step"] for h in history[1:]]
            assert all(value > 0 for _, value in throughput)
            # The same scalars in TensorBoard's event files, one folder per run and stage.
            reader = EventAccumulator(str(events / run.info.run_name / stage))
            reader.Reload()
            for name in ("loss", "val_loss"):
                assert_curve([(e.step, e.value) for e in reader.Scalars(name)], history, name)
        artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
        assert artifacts == {"curves.png", "throughput.png", "samples.json", "export"}
        exported = {Path(a.path).name for a in client.list_artifacts(run.info.run_id, "export")}
        assert {"model.safetensors", "config.json", "forward.jax"} <= exported
    assert not list(Path.cwd().glob("mlartifacts")), "artifacts were written to the working directory"


@pytest.mark.flow
def test_a_tracking_server_killed_mid_run_costs_one_warning_and_the_run_completes(tmp_path, run_env, mlflow_server):
    wait_up(mlflow_server)
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(play_text(64_000, seed=12))
    steps = 400
    args = base_args(corpus, tmp_path / "store", "--track", f"mlflow={mlflow_server['url']}", "--set",
                     f"train.steps={steps}", "--set", "train.log_every=10", "--set", f"train.checkpoint_every={steps}")
    log = tmp_path / "run.log"
    run = start(args, log, run_env)
    client = mlflow_tracking.MlflowClient(mlflow_server["url"])
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
    assert "Traceback" not in stderr
    # What reached the server before it died is in its database; the run was never ended.
    local = mlflow_tracking.MlflowClient(mlflow_server["db"])
    (tracked,) = local.search_runs([local.get_experiment_by_name("bardflow").experiment_id])
    assert tracked.info.status == "RUNNING" and tracked.data.tags["prefect.flow_run_id"] == summary["flow_run"]
    steps_logged = [step for step, _ in logged(local, tracked.info.run_id, "train_single/loss")]
    assert steps_logged and steps_logged == sorted(steps_logged) and steps_logged[-1] < steps - 1
    assert all(step % 10 == 0 for step in steps_logged)
