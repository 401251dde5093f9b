"""The pipeline end to end through the real CLI, with 2 emulated CPU devices and the tiny
preset, on the session's shared Prefect server; its first run tracked in MLflow and
TensorBoard, read back with their own readers. (A run on the embedded server that a plain
``bardflow run`` starts: tests/test_reliability.py, two runs on one store.)"""

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from bardflow.tasks.registry import BYTES_RUN
from tests.helpers import call, logged

pytestmark = pytest.mark.flow
STAGES = list(BYTES_RUN)  # the stages of a run of bytes: no tokenize


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    from tests.helpers import md5_bytes, play_text

    root = tmp_path_factory.mktemp("flow")
    corpus = root / "corpus.txt"
    corpus.write_bytes(play_text(64_000))
    # Your own text as the README shows it: no md5 to pass (it is computed and keys the version);
    # the preset and a setting from a config file, --set on top of it where a test adds one.
    (root / "run.yaml").write_text("preset: tiny\ntrain:\n  single_device_steps: 10\n")
    common = [
        "--config",
        str(root / "run.yaml"),
        "--corpus",
        str(corpus),
        "--store",
        str(root / "store"),
        "--cpu-devices",
        "2",
        "--json",
    ]
    return root / "store", common, md5_bytes(corpus.read_bytes())


def tracked(root):
    """Where a run is tracked: MLflow in a SQLite file, and TensorBoard event files."""
    return ["--track", f"mlflow=sqlite:///{root / 'mlflow.db'}", "--track", f"tensorboard={root / 'tb'}"]


@pytest.fixture(scope="module")
def first_run(workspace, run_env, mlflow_db):
    """The pipeline on a fresh store, tracked in MLflow and TensorBoard: every stage runs."""
    store, common, _ = workspace
    mlflow_db(store.parent / "mlflow.db")
    return json.loads(call("run", *common, *tracked(store.parent), env=run_env).stdout)


def run(common, *extra, env):
    summary = json.loads(call("run", *common, *extra, env=env).stdout)
    return summary, {name: stage["state"] for name, stage in summary["stages"].items()}


def only(*ran):
    return {stage: ("ran" if stage in ran else "cached") for stage in STAGES}


def test_a_fresh_run_builds_every_stage(workspace, first_run, prefect_server):
    store, _, md5 = workspace
    # The run's page, as printed, is on the server it reported to, which still answers for it.
    assert first_run["ui"] == f"{prefect_server.url}/runs/flow-run/{first_run['flow_run']}" and first_run["ui_served"]
    assert prefect_server.api(f"/flow_runs/{first_run['flow_run']}")["state"]["type"] == "COMPLETED"
    stages = first_run["stages"]
    assert {name: stage["state"] for name, stage in stages.items()} == only(*STAGES)
    assert stages["fetch"]["metrics"]["md5"] == md5  # computed, recorded, shown
    assert stages["train_parallel"]["metrics"]["devices"] == 2
    # No MFU on a CPU, whose peak bardflow does not know: said, not guessed.
    assert (
        stages["train_parallel"]["metrics"]["mfu"] is None
        and stages["train_parallel"]["metrics"]["flops_per_token"] > 0
    )
    assert stages["train_parallel"]["metrics"]["mfu_note"] == "no float32 peak known for 'cpu'"
    # train_single measures throughput on the first 10 of the schedule's 20 steps.
    assert (stages["train_single"]["metrics"]["steps"], stages["train_parallel"]["metrics"]["steps"]) == (10, 20)
    assert stages["train_parallel"]["metrics"]["global_batch"] == 2 * stages["train_single"]["metrics"]["global_batch"]
    assert stages["verify"]["metrics"]["passed"] is True
    for name in ("throughput.png", "curves.png", "comparison.json"):
        assert (store / "compare" / stages["compare"]["key"] / name).stat().st_size > 0
    samples = json.loads((store / "generate" / stages["generate"]["key"] / "samples.json").read_text())
    assert [s["prompt"] for s in samples] == ["ROMEO:", "To be, or not"]
    assert first_run["samples"] == samples  # the pay-off is in the summary too
    # The store is the cache: nothing of a run is pickled or kept beside it.
    assert sorted(p.name for p in store.iterdir()) == sorted(STAGES)

    listing = json.loads(call("artifacts", "--store", str(store), "--json").stdout)
    assert {row["stage"] for row in listing} == set(STAGES)
    assert all(row["bytes"] > 0 and row["created"] for row in listing)
    table = call("artifacts", "train_parallel", "--store", str(store)).stdout
    assert stages["train_parallel"]["key"] in table and "tokens_per_s" in table
    # One stage's listing ends with each version's folder, whole; every row names its corpus.
    exports = call("artifacts", "export", "--store", str(store)).stdout
    assert stages["export"]["path"] in exports and "corpus=corpus.txt" in exports, exports
    assert {row["corpus"].split(" ")[0] for row in listing} == {"corpus.txt"}
    # generate's listing ends with what the stage is for: its samples.
    shown = call("artifacts", "generate", "--store", str(store)).stdout
    assert f"samples of {stages['generate']['key'][:12]}, the newest:" in shown
    assert samples[1]["text"].splitlines()[0][:20] in shown


def test_cached_refreshed_changed_and_healed(workspace, first_run, run_env):
    store, common, md5 = workspace
    stages = first_run["stages"]
    # A rerun finds everything cached, with the md5 pinned by hand too: the same versions.
    # (Identical reruns: the read-only store's, and the healing run below.)
    assert run(common, "--set", f"data.md5={md5}", env=run_env)[1] == only()
    # A refreshed stage reruns alone, and a shorter throughput run reruns train_single and
    # the comparison only (one run for all three).
    # Retraining the same weights (--refresh train_parallel) leaves their readers cached: a
    # version's fingerprint describes what it holds, not how fast it was made.
    refreshed = run(
        common,
        "--refresh",
        "generate",
        "--refresh",
        "train_parallel",
        "--set",
        "train.single_device_steps=5",
        env=run_env,
    )[1]
    # Built again with the stored output: the stored version (and its figures) is kept, and
    # the summary says so rather than show that version's timings as this run's.
    assert {"generate": "ran (unchanged)", "train_parallel": "ran (unchanged)"}.items() <= refreshed.items()
    assert {stage: state.removesuffix(" (unchanged)") for stage, state in refreshed.items()} == only(
        "generate", "train_single", "train_parallel", "compare"
    )
    # (A changed generation setting reruns only generate too: the `bardflow-samples/generate`
    # deployment in test_deployment.py.)
    # A model or training change reruns training and all after it; data stays cached.
    assert run(common, "--set", "train.steps=12", env=run_env)[1] == only(*STAGES[2:])

    # A version folder deleted by hand is rebuilt, and so is one with a damaged file (caught
    # by its checksum); the rebuilt data is identical, so what reads it stays cached.
    shutil.rmtree(store / "compare" / stages["compare"]["key"])
    arrow = store / "encode" / stages["encode"]["key"] / "train" / "00000.arrow"
    data = bytearray(arrow.read_bytes())
    data[len(data) // 2] ^= 0xFF
    arrow.write_bytes(bytes(data))
    summary, states = run(common, env=run_env)
    assert states == only("encode", "compare")
    assert summary["stages"]["encode"]["key"] == stages["encode"]["key"]
    assert list((store / "encode" / ".replaced").iterdir())  # the damaged one is set aside, not deleted


def test_every_stage_left_artifacts_for_the_ui(first_run, prefect_server):
    """Read back through the Prefect API: the run's own artifacts, one key per stage."""
    found = prefect_server.api("/artifacts/filter", {"artifacts": {"flow_run_id": {"any_": [first_run["flow_run"]]}}})
    by_key = {}
    for artifact in found:
        by_key.setdefault(artifact["key"], []).append(artifact)
    expected = {f"bardflow-{s.replace('_', '-')}" for s in STAGES} | {
        "bardflow-compare-plots",
        "bardflow-encode-sample",
        "bardflow-train-single-progress",
        "bardflow-train-parallel-progress",
        "bardflow-fetch-progress",
        "bardflow-encode-progress",
        "bardflow-run",
        "bardflow-train-single-cpu-step",
        "bardflow-train-parallel-cpu-step",
    }
    assert set(by_key) == expected
    assert by_key["bardflow-compare-plots"][0]["data"].count("data:image/png;base64,") == 2
    assert "Tokens/s" in json.dumps(by_key["bardflow-compare"][0]["data"])
    for stage in ("train-parallel", "fetch", "encode"):  # fetch and encode count bytes
        assert by_key[f"bardflow-{stage}-progress"][0]["data"] == 100.0
    states = prefect_server.stage_states(first_run["flow_run"])
    assert sorted(states) == sorted(STAGES) and set(states.values()) == {"Completed"}


def test_a_read_only_store_serves_a_cached_run_and_refuses_only_a_build(workspace, first_run, run_env, tmp_path):
    """A published version is read without the store's locks, so a store mounted read-only
    (a shared, archived one) still serves every stage it holds; a stage that must build
    says so in one line."""
    store, common, _ = workspace
    view = tmp_path / "read-only"
    view.mkdir()
    done = subprocess.run(["mount", "--bind", "-o", "ro", str(store), str(view)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot bind-mount a read-only view here ({done.stderr.strip() or done.returncode}): needs root")
    try:
        args = [str(view) if arg == str(store) else arg for arg in common]
        assert run(args, env=run_env)[1] == only()
        refused = call("run", *args, "--refresh", "generate", env=run_env, check=False)
        assert refused.returncode == 1
        last = refused.stderr.strip().splitlines()[-1]
        assert last.startswith(f"bardflow: error: cannot write to the store at {view}") and "Read-only" in last, last
    finally:
        subprocess.run(["umount", "-l", str(view)], capture_output=True)


def test_the_exported_model_generates_text_without_bardflow(first_run):
    """examples/generate_from_export.py, which imports jax, numpy and safetensors only, samples
    from the export stage's folder."""
    import sys
    from pathlib import Path

    from tests.helpers import REPO

    folder = Path(first_run["stages"]["export"]["path"]) / "export"
    done = subprocess.run(
        [
            sys.executable,
            "-I",
            str(REPO / "examples" / "generate_from_export.py"),
            str(folder),
            "--prompt",
            "ROMEO:",
            "--bytes",
            "40",
            "--seed",
            "1",
        ],
        capture_output=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    text = done.stdout.rstrip(b"\n")
    assert text.startswith(b"ROMEO:") and 40 <= len(text) - len(b"ROMEO:") <= 40 * 3  # 40 bytes (utf-8 replaced)
    source = (REPO / "examples" / "generate_from_export.py").read_text()
    assert not [line for line in source.splitlines() if line.startswith(("import bardflow", "from bardflow"))]


def test_the_export_example_refuses_a_damaged_or_mixed_up_export_in_one_line(first_run, tmp_path):
    """One flipped byte in the weights used to sample garbage with exit 0; in forward.jax, a
    raw deserialization traceback; a forward.jax of another configuration, a raw pytree error.
    The version folder is taken as well as the export folder inside it."""
    import hashlib
    import shutil
    import sys
    from pathlib import Path

    import jax
    from flax import nnx

    from bardflow.config.settings import build_config
    from bardflow.model.inference.export import export_forward, portable_config
    from bardflow.model.network.transformer import Transformer
    from tests.helpers import REPO

    version = Path(first_run["stages"]["export"]["path"])

    def sample(folder: Path) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-I", str(REPO / "examples" / "generate_from_export.py"), str(folder), "--bytes", "3"],
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )

    assert sample(version).returncode == 0  # the version folder: its export folder is found
    assert "holds no bardflow export" in sample(tmp_path).stderr

    def damaged(name: str, change) -> Path:
        folder = tmp_path / name.replace(".", "-")
        shutil.copytree(version / "export", folder)
        change(folder)
        return folder

    def flip(name: str):
        def change(folder: Path) -> None:
            data = bytearray((folder / name).read_bytes())
            data[len(data) // 2] ^= 0x01
            (folder / name).write_bytes(bytes(data))

        return change

    def other_configuration(folder: Path) -> None:  # a forward pass of another shape, its checksum updated
        cfg = build_config("tiny", {"model.d_model": 48}).model
        (folder / "forward.jax").write_bytes(
            export_forward(Transformer(cfg, rngs=nnx.Rngs(0)), portable_config(cfg), platforms=(jax.default_backend(),))
        )
        sums = json.loads((folder / "checksums.json").read_text())
        sums["sha256"]["forward.jax"] = hashlib.sha256((folder / "forward.jax").read_bytes()).hexdigest()
        (folder / "checksums.json").write_text(json.dumps(sums))

    def truncated_checksums(folder: Path) -> None:  # each used to end in a traceback
        (folder / "checksums.json").write_text((folder / "checksums.json").read_text()[:30])

    for folder, words in (
        (damaged("checksums-truncated", truncated_checksums), "checksums.json is damaged (JSONDecodeError"),
        (damaged("checksums-list", lambda f: (f / "checksums.json").write_text("[]")), "is damaged (TypeError"),
        (damaged("model.safetensors", flip("model.safetensors")), "model.safetensors does not match"),
        (damaged("forward.jax", flip("forward.jax")), "forward.jax does not match its checksum"),
        (damaged("other", other_configuration), "the two files come from different exports"),
    ):
        done = sample(folder)
        line = done.stderr.strip()
        assert done.returncode == 1 and "\n" not in line and line.startswith("error: ") and words in line, done.stderr


def test_a_run_is_one_mlflow_run_and_event_files_and_a_cached_rerun_shows_the_same(workspace, first_run, run_env):
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from bardflow.config.settings import build_config

    store, common, _ = workspace
    root = store.parent
    second = json.loads(call("run", *common, *tracked(root), env=run_env).stdout)
    assert {s["state"] for s in second["stages"].values()} == {"cached"}

    client = MlflowClient(f"sqlite:///{root / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("bardflow")
    # The run ends saying where it was tracked and how to see it.
    assert any(
        line.startswith("MLflow: run ") and "mlflow ui --backend-store-uri sqlite:///" in line
        for line in second["tracking"]
    ), second["tracking"]
    assert any("tensorboard --logdir" in line for line in second["tracking"]), second["tracking"]
    runs = client.search_runs([experiment.experiment_id], order_by=["attributes.start_time ASC"])
    assert [run.info.status for run in runs] == ["FINISHED", "FINISHED"]
    preset = build_config("tiny")
    for run, summary in zip(runs, (first_run, second), strict=True):
        tags, params = run.data.tags, run.data.params
        assert tags["prefect.flow_run_id"] == summary["flow_run"]
        assert tags["prefect.flow_run_url"].endswith(f"/runs/flow-run/{summary['flow_run']}")
        assert tags["bardflow.store"] == str(store)
        assert {stage: tags[f"bardflow.version.{stage}"] for stage in summary["stages"]} == {
            stage: row["key"] for stage, row in summary["stages"].items()
        }
        # The whole configuration, as resolved: the preset, the corpus and the config file's setting.
        assert params["train.steps"] == str(preset.train.steps) and params["model.d_model"] == str(preset.model.d_model)
        assert params["train.single_device_steps"] == "10" and params["data.corpus"] == str(root / "corpus.txt")
        assert {key.partition(".")[0] for key in params} == {"data", "model", "train", "verify", "generate"}
        for stage in ("train_single", "train_parallel"):
            history = json.loads((Path(summary["stages"][stage]["path"]) / "history.json").read_text())
            for name in ("loss", "val_loss", "val_bpb"):
                assert_curve(logged(client, run.info.run_id, f"{stage}/{name}"), history, name)
            throughput = logged(client, run.info.run_id, f"{stage}/tokens_per_s")
            assert [step for step, _ in throughput] == [h["step"] for h in history[1:]]
            assert all(value > 0 for _, value in throughput)
            # The same scalars in TensorBoard's event files, one folder per run and stage.
            reader = EventAccumulator(str(root / "tb" / run.info.run_name / stage))
            reader.Reload()
            for name in ("loss", "val_loss"):
                assert_curve([(e.step, e.value) for e in reader.Scalars(name)], history, name)
        artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
        assert artifacts == {"curves.png", "throughput.png", "samples.json", "export"}
        exported = {Path(a.path).name for a in client.list_artifacts(run.info.run_id, "export")}
        assert {"model.safetensors", "config.json", "forward.jax"} <= exported
        # Beside the tracking database, not in the working directory (which is the user's: a
        # folder left there by their own runs is none of this test's business).
        assert run.info.artifact_uri.startswith((str(root), f"file://{root}")), run.info.artifact_uri


def assert_curve(found: list[tuple[int, float]], history: list[dict], name: str) -> None:
    assert [step for step, _ in found] == [h["step"] for h in history], name
    assert [value for _, value in found] == pytest.approx([h[name] for h in history]), name


def test_serve_answers_for_the_run_s_model_and_ends_on_sighup(workspace, first_run, run_env):
    """``bardflow serve`` with a run's settings: the stages come back cached, the checkpoint's
    model answers the openai client greedily as the sampler does, and a closed terminal's SIGHUP
    ends it cleanly, as SIGTERM does (it killed it mid-stream).
    ``--server embedded``: the run's own Prefect server is stopped once the model is found, not
    kept up (and its memory held) for as long as the model serves."""
    import signal
    import socket
    import sys

    from openai import OpenAI

    from bardflow.model.inference.sampling import generate
    from bardflow.model.training.checkpoint import load_model
    from tests.helpers import REPO, children

    store, common, _ = workspace
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [sys.executable, "-m", "bardflow", "serve", *common, "--port", str(port), "--slots", "2"]
    command += ["--server", "embedded"]
    process = subprocess.Popen(
        command, cwd=REPO, env=run_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        line = process.stdout.readline() if process.stdout else ""
        key = first_run["stages"]["checkpoint"]["key"]
        assert line.startswith(f"serving bardflow-{key[:12]} at http://127.0.0.1:{port}/v1 (this machine only"), (
            line + (process.stderr.read() if process.poll() is not None and process.stderr else "")
        )
        assert not children(process.pid)  # the embedded Prefect server is gone
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        answer = client.completions.create(model=f"bardflow-{key[:12]}", prompt="ROMEO:", max_tokens=20, temperature=0)
        model = load_model(store / "checkpoint" / key / "model")
        expected = generate(model, "ROMEO:", 20, 0.0, 0, model.max_seq_len)[6:]
        assert answer.choices[0].text == expected.decode("utf-8", errors="replace")
    finally:
        process.send_signal(signal.SIGHUP)
        _, err = process.communicate(timeout=30)
    assert process.returncode == 0 and err.strip().endswith("bardflow: the server stopped"), err[-2000:]
    # No terminal, so no bar: one line says what the wait before the first line is.
    assert re.search(r"^bardflow: compiling the \d+ programs that serve any request$", err, re.MULTILINE), err[-2000:]


def test_serve_stopped_while_it_compiles_ends_in_one_line(workspace, first_run, run_env):
    """Ctrl-C while the server's programs compile ends the command with one line and 130 (128
    + SIGINT), after at most the compiles under way: no traceback, nothing served."""
    import signal
    import socket
    import sys

    from tests.helpers import REPO

    store, _, _ = workspace
    key = first_run["stages"]["checkpoint"]["key"]
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [sys.executable, "-m", "bardflow", "serve", key, "--store", str(store), "--port", str(port)]
    # No compiled program from the cache: the signal comes while they compile.
    env = {**run_env, "JAX_COMPILATION_CACHE_DIR": ""}
    process = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        lines = iter(process.stderr.readline, "") if process.stderr else iter(())
        assert any(re.match(r"bardflow: compiling the \d+ programs that serve any request$", line) for line in lines)
    finally:
        process.send_signal(signal.SIGINT)
        out, err = process.communicate(timeout=60)
    assert process.returncode == 130 and not out, (out, err)
    assert err.strip() == "bardflow: stopped by SIGINT while compiling the server's programs", err[-2000:]


def test_serve_refuses_a_checkpoint_whose_files_no_longer_match_its_checksums(workspace, first_run, tmp_path, capsys):
    """A bit flipped in a served version's weights: refused in one line naming the file, where
    the manifest's seal alone would have let it serve."""
    import shutil
    import socket

    from bardflow.cli.main import main

    store, _, _ = workspace
    key = first_run["stages"]["checkpoint"]["key"]
    copy = tmp_path / "store"
    shutil.copytree(store / "checkpoint" / key, copy / "checkpoint" / key)
    weights = max((p for p in (copy / "checkpoint" / key).rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0x01
    weights.write_bytes(bytes(data))
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    assert main(["serve", key[:12], "--store", str(copy), "--port", str(port)]) == 1
    line = capsys.readouterr().err.strip()
    assert line.startswith(f"bardflow: error: the checkpoint version {key[:12]} is damaged: ") and "\n" not in line
    assert weights.relative_to(copy / "checkpoint" / key).as_posix() in line
