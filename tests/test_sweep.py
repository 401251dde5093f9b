"""``bardflow sweep`` and ``bardflow runs``: a grid refused before any work when it is bad;
a small sweep end to end on the session's Prefect server (child flow runs of one parent,
shared stages built once, a failed run failing its row only, one comparison artifact whose
plots render in a browser); the same sweep fanned out over two workers of a work pool; the
trained versions listed and diffed from the store alone."""

import itertools
import json
import os
import threading
import time

import pytest

from bardflow.config.settings import ConfigError
from bardflow.flows.sweep_configs import grid_configurations
from bench.commands import tiny
from tests.helpers import OUTPUT, Webhook, bardflow, call


@pytest.mark.parametrize(
    "grid, listed, max_runs, words",
    [
        (["train.steps="], [], 32, ["lists no values"]),
        (["train.stepz=1,2"], [], 32, ["sweep run 1", "unknown setting 'train.stepz'"]),
        (["train.steps=5,0"], [], 32, ["sweep run 2 (train.steps=0)", "greater than 0"]),
        (["train.steps=5,6", "train.steps=7"], [], 32, ["names train.steps twice"]),
        (["train.steps=5,5"], [], 32, ["runs 1 and 2 are the same configuration"]),
        (["train.steps=1,2,3", "model.num_layers=1,2"], [], 5, ["6 runs", "maximum of 5", "--max-runs 6"]),
        ([], ["[1]"], 32, ["JSON object"]),
        ([], [], 32, ["at least one --grid"]),
    ],
)
def test_a_bad_sweep_is_refused_with_what_and_how(grid, listed, max_runs, words):
    with pytest.raises(ConfigError) as error:
        grid_configurations("tiny", {}, grid, listed, max_runs)
    for word in words:
        assert word in str(error.value)


def test_a_grid_is_every_combination_then_the_listed_ones():
    runs = grid_configurations(
        "tiny",
        {"train.steps": 8},
        ["train.learning_rate=0.001,0.01", "model.num_layers=1,2"],
        ['{"train.per_device_batch": 2}'],
    )
    assert runs == [
        {"train.learning_rate": 0.001, "model.num_layers": 1},
        {"train.learning_rate": 0.001, "model.num_layers": 2},
        {"train.learning_rate": 0.01, "model.num_layers": 1},
        {"train.learning_rate": 0.01, "model.num_layers": 2},
        {"train.per_device_batch": 2},
    ]


def test_the_command_refuses_a_bad_grid_before_any_work(tmp_path):
    done = bardflow(
        "sweep", "--preset", "tiny", "--store", str(tmp_path / "store"), "--grid", "train.steps=0,5", check=False
    )
    assert done.returncode != 0 and "bardflow: error: sweep run 1 (train.steps=0)" in done.stderr
    assert "Traceback" not in done.stderr and not (tmp_path / "store").exists()


@pytest.fixture(scope="module")
def swept(tmp_path_factory, run_env, mlflow_db):
    """A local sweep of three configurations (one diverges), tracked in MLflow."""
    from tests.helpers import play_text

    root = tmp_path_factory.mktemp("sweep")
    corpus = root / "corpus.txt"
    corpus.write_bytes(play_text(64_000))
    store = root / "store"
    arguments = tiny(corpus, store, settings=["train.single_device_steps=5"])
    tracked = mlflow_db(root / "mlflow.db")
    # Told by a webhook (bardflow notify): the failed run and the finished sweep.
    hook = Webhook()
    call("notify", "add", hook.url, "--name", "sweep-tests", env=run_env)
    try:
        done = call(
            "sweep",
            *arguments,
            "--grid",
            "train.learning_rate=0.003,0.01",
            "--list",
            '{"train.learning_rate": 1e30}',
            "--track",
            f"mlflow={tracked}",
            "--json",
            env=run_env,
        )
        yield (
            store,
            {**json.loads(done.stdout), "arguments": arguments, "mlflow": tracked, "hook": hook, "env": run_env},
        )
    finally:
        call("notify", "remove", "sweep-tests", env=run_env)
        hook.close()


@pytest.mark.flow
def test_a_failed_run_and_a_finished_sweep_each_send_one_message_with_a_link(swept, prefect_server):
    _, result = swept
    hook = result["hook"]
    failed = hook.wait_for(lambda m: m["subject"] == "bardflow: sweep-run-3-of-3 failed in train_single")
    assert failed["body"].startswith(
        "bardflow run sweep-run-3-of-3 (bardflow-pipeline) failed in stage train_single: loss became nan at step"
    )
    link = failed["body"].splitlines()[-1]
    assert link.startswith(f"{prefect_server.url}/runs/flow-run/")
    assert prefect_server.api(f"/flow_runs/{link.rsplit('/', 1)[1]}")["name"] == "sweep-run-3-of-3"

    parent = prefect_server.api(f"/flow_runs/{result['flow_run']}")["name"]
    finished = hook.wait_for(lambda m: m["subject"] == f"bardflow: sweep {parent} finished")
    best = min((row for row in result["rows"] if row["status"] == "completed"), key=lambda row: row["val_loss"])
    assert (
        f"finished: 3 runs, 1 failed\nbest: run {best['run']}, validation loss {best['val_loss']:.4f}: "
        f"--set train.learning_rate={best['train.learning_rate']}\n" in finished["body"]
    )
    assert finished["body"].endswith(f"{prefect_server.url}/runs/flow-run/{result['flow_run']}")
    time.sleep(1)  # one message each, not one per retry or per state
    assert sum(m["subject"] in (failed["subject"], finished["subject"]) for m in hook.received) == 2

    listed = json.loads(call("notify", "list", "--json", env=result["env"]).stdout)
    assert {"name": "sweep-tests", "messages": ["crashed", "failed", "sweep"], "enabled": True} in listed
    for args, words in (
        (["add", "mailto:ops@example.org"], "is not an http(s) webhook URL"),
        (["add"], "takes a webhook URL or --block TYPE/NAME"),
        (["add", "--block", "slack-webhook/none-such"], "no block slack-webhook/none-such"),
        (["remove", "none-such"], "no notification named 'none-such'"),
    ):
        refused = call("notify", *args, env=result["env"], check=False)
        assert refused.returncode in (1, 2) and words in refused.stderr.strip().splitlines()[-1], refused.stderr


@pytest.mark.flow
def test_a_sweep_runs_each_configuration_as_a_child_run_and_compares_them(swept, prefect_server):
    store, result = swept
    rows, runs = result["rows"], result["runs"]
    assert [list(row)[:3] for row in rows] == [["run", "train.learning_rate", "status"]] * 3  # what differs first
    assert [row["status"] for row in rows] == ["completed", "completed", "failed"]
    assert "loss became nan" in runs[2]["error"]  # the failed run fails its row, not the sweep
    # Shared stages are built once: the second run finds fetch and encode cached.
    assert runs[0]["stages"]["encode"]["state"] == "ran" and runs[1]["stages"]["encode"]["state"] == "cached"
    assert runs[0]["stages"]["encode"]["key"] == runs[1]["stages"]["encode"]["key"]
    assert rows[0]["train_parallel"] != rows[1]["train_parallel"] and rows[0]["val_loss"] > 0
    # --cpu-devices 1, in a process whose JAX already emulates two devices: the run takes one
    # (and trains train_parallel here, with no training process to start).
    assert {runs[0]["stages"][stage]["metrics"]["devices"] for stage in ("train_single", "train_parallel")} == {1}

    children = prefect_server.api("/flow_runs/filter", {"flow_runs": {"name": {"like_": "sweep-run-"}}})
    ours = [run for run in children if run["parameters"].get("store") == str(store)]
    assert len(ours) == 3
    parents = {prefect_server.api(f"/task_runs/{run['parent_task_run_id']}")["flow_run_id"] for run in ours}
    assert parents == {result["flow_run"]}

    # Tracked, the children are the runs of one MLflow experiment named after the sweep.
    from mlflow.tracking import MlflowClient

    client = MlflowClient(result["mlflow"])
    (experiment,) = [e for e in client.search_experiments() if e.name.startswith("sweep-")]
    parent = prefect_server.api(f"/flow_runs/{result['flow_run']}")
    assert experiment.name == f"sweep-{parent['name']}"
    tracked = client.search_runs([experiment.experiment_id], order_by=["attributes.start_time ASC"])
    assert [run.info.run_name for run in tracked] == [f"sweep-run-{n}-of-3" for n in (1, 2, 3)]
    assert [run.data.params["train.learning_rate"] for run in tracked] == ["0.003", "0.01", "1e+30"]
    assert [run.info.status for run in tracked] == ["FINISHED", "FINISHED", "FAILED"]

    artifact = prefect_server.api(
        "/artifacts/filter",
        {"artifacts": {"key": {"any_": ["bardflow-sweep"]}, "flow_run_id": {"any_": [result["flow_run"]]}}},
    )[0]
    assert "train.learning_rate" in artifact["data"] and "failed" in artifact["data"]
    assert artifact["data"].count("data:image/png;base64,") == 1
    best = min((row for row in rows if row["status"] == "completed"), key=lambda row: row["val_loss"])
    assert (
        artifact["data"]
        .rstrip()
        .endswith(  # ranked last: the best, ready to paste
            f"**Best**: run {best['run']}, validation loss {best['val_loss']:.4f}: "
            f"`--set train.learning_rate={best['train.learning_rate']}`"
        )
    )

    from tests.cdp import Browser, chromium_binary

    binary = chromium_binary()
    if binary is None:
        pytest.skip("chromium is not installed (.ci/run installs it)")
    browser = Browser(binary)
    try:
        browser.open(
            f"{prefect_server.url}/artifacts/artifact/{artifact['id']}",
            "document.images.length >= 1 && [...document.images].every(i => i.complete)",
        )
        (OUTPUT / "sweep").mkdir(parents=True, exist_ok=True)
        browser.screenshot(OUTPUT / "sweep" / "sweep-artifact.png")
        assert all(w > 0 for w in browser.evaluate("[...document.images].map(i => i.naturalWidth)"))
        assert "0.003" in browser.text() and "0.01" in browser.text()
    finally:
        browser.close()


@pytest.mark.flow
def test_runs_lists_and_diffs_trained_versions_from_the_store_alone(swept):
    store, result = swept
    env = {"PREFECT_API_URL": "http://127.0.0.1:9/api"}  # no server is needed (none answers there)
    listing = json.loads(call("runs", "--store", str(store), "--json", env={**os.environ, **env}).stdout)
    parallel = [row for row in listing if row["stage"] == "train_parallel"]
    assert {row["differs"]["train.learning_rate"] for row in parallel} >= {0.003, 0.01}  # (the pool's sweep adds one)
    assert all(row["val_loss"] > 0 for row in parallel)
    a, b = result["rows"][0]["train_parallel"], result["rows"][1]["train_parallel"]
    diff = json.loads(
        call("runs", "--store", str(store), "--diff", a[:8], b[:8], "--json", env={**os.environ, **env}).stdout
    )
    assert diff["differences"]["settings.train.learning_rate"] == {"a": 0.003, "b": 0.01}
    assert not any(key.startswith(("libraries.", "data.")) for key in diff["differences"])  # same data, same libraries
    assert diff["figures"]["val_loss"]["b_minus_a"] == pytest.approx(
        result["rows"][1]["val_loss"] - result["rows"][0]["val_loss"]
    )
    missing = call("runs", "--store", str(store), "--diff", "zzzz", b, check=False)
    assert missing.returncode == 1 and "no trained version with a key starting 'zzzz'" in missing.stderr


SLOT_NAME = "bardflow-training-sweepers-host"


def hold_the_slot_until(server, name: str, waiting: threading.Event, timeout_s: float = 120) -> None:
    """Holds the training slot ``name`` until a run logs that it waits for it."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from bardflow.prefect_server.slots import training_slot

    with (
        temporary_settings(updates={PREFECT_API_URL: server.env["PREFECT_API_URL"]}),
        training_slot("another run", lambda line: None, name=name),
    ):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not waiting.is_set():
            found = server.api("/logs/filter", {"sort": "TIMESTAMP_DESC", "limit": 50})
            if any(f"waiting for this host's training slot {name}" in log["message"] for log in found):
                waiting.set()
            time.sleep(0.5)


@pytest.fixture(scope="module")
def pool_workers(prefect_server):
    """The README's pool of workers, on this machine: a process pool, the `sweep` deployment
    on it, and two workers that each take one flow run at a time."""
    import sys
    from pathlib import Path

    prefect = str(Path(sys.executable).parent / "prefect")
    with prefect_server.deployments():  # until the module is done: see Server.deployments
        for command in (
            ["work-pool", "create", "--overwrite", "--type", "process", "sweepers"],
            ["--no-prompt", "deploy", "--name", "sweep", "--pool", "sweepers"],
        ):
            done = prefect_server.run(prefect, *command)
            assert done.returncode == 0, done.stdout + done.stderr
        # Two workers of one host with one device: their runs take turns at the host's training
        # slot (prefect_server/slots.py), and train_parallel takes over train_single's version.
        one_device = f"{os.environ['XLA_FLAGS']} --xla_force_host_platform_device_count=1"
        env = {**prefect_server.env, "BARDFLOW_TRAINING_SLOT": SLOT_NAME, "XLA_FLAGS": one_device}
        workers = {
            name: prefect_server.start(
                name, prefect, "worker", "start", "--pool", "sweepers", "--name", name, "--limit", "1", env=env
            )
            for name in ("sweeper-a", "sweeper-b")
        }
        # Both polling before any run is scheduled: a worker still starting (seconds of imports
        # on a busy host) would leave both trials to the other.
        deadline = time.monotonic() + 180
        for name in workers:
            while f"Worker '{name}' started!" not in (prefect_server.home / f"{name}.log").read_text():
                assert workers[name].poll() is None and time.monotonic() < deadline, f"{name} did not start"
                time.sleep(0.2)
        try:
            yield workers
        finally:
            for worker in workers.values():
                prefect_server.stop_worker(worker)
            assert all(worker.poll() is not None for worker in workers.values()), "a worker was left running"


@pytest.mark.flow
def test_a_search_fans_out_over_the_workers_of_a_pool_which_train_one_at_a_time(
    swept, prefect_server, pool_workers, run_env
):
    """A search two trials at a time on two workers of one host: its trials train one at a time
    (the host's training slot), the proposed one finishes, and a trial that fails on its
    worker fails its row with the worker's error, not the search. (A grid on a pool is
    `python -m bench.pool`'s, in CI; a worker that finds every stage in the store, the
    `generate` deployment in tests/test_deployment.py.)"""
    store, local = swept
    # Another run trains on this host as the search starts (here, a slot held by this process
    # until a trial says it waits): the trials queue behind it, then take turns.
    waiting = threading.Event()
    holder = threading.Thread(target=hold_the_slot_until, args=(prefect_server, SLOT_NAME, waiting), daemon=True)
    holder.start()
    done = call(
        "sweep",
        *local["arguments"],
        "--pool",
        "sweepers",
        "--search",
        "2",
        "--parallel",
        "2",
        "--set",
        "train.learning_rate=1e-3..2e-2:log",
        "--list",
        '{"train.learning_rate": 1e30}',
        "--json",
        env=run_env,
    )
    holder.join(timeout=30)
    assert waiting.is_set(), "no trial waited for the host's training slot"
    result = json.loads(done.stdout)
    rows = result["rows"]  # ranked: the failed trial last
    assert [row["status"] for row in rows] == ["completed", "failed"]
    assert rows[1]["run"] == 1 and rows[1]["train.learning_rate"] == "1e+30"  # --list: tried first
    assert 1e-3 <= float(rows[0]["train.learning_rate"]) <= 2e-2 and rows[0]["val_loss"] > 0
    failed = next(run for run in result["runs"] if run["status"] == "failed")
    assert "loss became nan" in failed["error"]  # its row says why; the search went on
    assert all(
        run["stages"]["train_parallel"]["state"] == "ran" for run in result["runs"] if run["status"] == "completed"
    )

    # Each child is a deployment run linked to the parent, and both workers took some.
    children = [run["flow_run"] for run in result["runs"]]
    for child in children:
        run = prefect_server.api(f"/flow_runs/{child}")
        assert run["deployment_id"] and run["parameters"]["store"] == str(store)
        assert prefect_server.api(f"/task_runs/{run['parent_task_run_id']}")["flow_run_id"] == result["flow_run"]
    taken = {
        name: {child for child in children if child in (prefect_server.home / f"{name}.log").read_text()}
        for name in pool_workers
    }
    assert all(taken.values()) and set().union(*taken.values()) == set(children), taken

    # The host's slot: every training stage held it alone, and whoever found it taken waited.
    held, waited = [], 0
    for child in children:
        logs = prefect_server.api(
            "/logs/filter", {"logs": {"flow_run_id": {"any_": [child]}}, "sort": "TIMESTAMP_ASC", "limit": 200}
        )
        marks = [(log["timestamp"], log["message"]) for log in logs if "training slot" in log["message"]]
        waited += sum("waiting for this host's training slot" in message for _, message in marks)
        takes = [at for at, message in marks if "holds this host's training slot" in message]
        gives = [at for at, message in marks if "released this host's training slot" in message]
        assert len(takes) == len(gives) >= 1, marks
        held += zip(takes, gives, strict=True)
    held.sort()
    assert all(end <= start for (_, end), (start, _) in itertools.pairwise(held)), held  # no two at once
    assert waited >= 1

    elsewhere = call(
        "sweep",
        "--preset",
        "tiny",
        "--store",
        str(store),
        "--pool",
        "elsewhere",
        "--grid",
        "train.steps=1,2",
        env=run_env,
        check=False,
    )
    assert elsewhere.returncode == 1 and "Traceback" not in elsewhere.stderr
    assert (
        "bardflow: error: deployment bardflow-pipeline/sweep runs on work pool 'sweepers', not 'elsewhere'"
        in elsewhere.stderr
    )


def test_a_pool_without_a_server_is_refused_before_any_work(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env["BARDFLOW_SERVER_FILE"] = str(tmp_path / "no-server.json")
    done = bardflow(
        "sweep",
        "--preset",
        "tiny",
        "--store",
        str(tmp_path / "store"),
        "--pool",
        "gpu",
        "--grid",
        "train.steps=1,2",
        env=env,
        check=False,
    )
    assert done.returncode == 2 and "--pool gpu needs a Prefect server" in done.stderr
    assert not (tmp_path / "store").exists()


@pytest.mark.flow
def test_a_search_proposes_seeded_trials_keeps_its_study_in_the_store_and_resumes(tmp_path, run_env, prefect_server):
    """--search with Optuna: the same command proposes the same trials; the study lives in the
    store, so running it again with more trials continues it (the trial that was running when
    it stopped first); a diverging trial fails its row, not the search; the comparison ranks
    the trials and ends with the best as a --set line."""
    import optuna

    from tests.helpers import play_text

    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(play_text(64_000, seed=3))
    store = tmp_path / "store"
    settings = ["train.steps=10", "train.learning_rate=1e-3..3e-2:log"]
    command = ["sweep", *tiny(corpus, store, "--list", '{"train.learning_rate": 1e30}', "--json", settings=settings)]
    first = json.loads(call(*command, "--search", "2", env=run_env).stdout)
    trials = sorted((row["run"], row["train.learning_rate"], row["status"]) for row in first["rows"])
    assert [status for *_, status in trials] == ["failed", "completed"]  # --list first: it diverges
    assert "loss became nan" in next(run["error"] for run in first["runs"] if run["status"] == "failed")
    journal = store / ".searches" / f"{first['study']}.journal"
    assert journal.exists()

    # The same command on a fresh study: the same proposals (whose stages the store holds).
    journal.rename(tmp_path / "first.journal")
    again = json.loads(call(*command, "--search", "2", env=run_env).stdout)
    assert sorted((row["run"], row["train.learning_rate"], row["status"]) for row in again["rows"]) == trials
    assert {run["stages"]["train_parallel"]["state"] for run in again["runs"] if run["status"] == "completed"} == {
        "cached"
    }

    # Stopped while a trial ran: that trial is asked again first when the search goes on.
    (tmp_path / "first.journal").replace(journal)
    storage = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(str(journal)))
    study = optuna.load_study(study_name=first["study"], storage=storage)
    interrupted = study.ask({"train.learning_rate": optuna.distributions.FloatDistribution(1e-3, 3e-2, log=True)})
    resumed = json.loads(call(*command, "--search", "3", env=run_env).stdout)
    rows = resumed["rows"]
    assert sorted((row["run"], row["train.learning_rate"], row["status"]) for row in rows)[:2] == trials
    # Optuna's trial 3 was the one cut short, asked again as its trial 4: the table numbers the
    # finished runs 1, 2, 3 (it used to show 1, 2, 4).
    by_run = {row["run"]: row for row in rows}
    assert sorted(by_run) == [1, 2, 3]
    assert float(by_run[3]["train.learning_rate"]) == pytest.approx(interrupted.params["train.learning_rate"])
    assert next(run for run in resumed["runs"] if run["trial"] == 3)["optuna_trial"] == 3
    assert [row["status"] for row in rows] == ["completed", "completed", "failed"]  # ranked: failed last
    assert rows[0]["val_loss"] <= rows[1]["val_loss"]

    artifact = prefect_server.api(
        "/artifacts/filter",
        {"artifacts": {"key": {"any_": ["bardflow-sweep"]}, "flow_run_id": {"any_": [resumed["flow_run"]]}}},
    )[0]
    assert (
        artifact["data"]
        .rstrip()
        .endswith(
            f"validation loss {rows[0]['val_loss']:.4f}: `--set train.learning_rate={rows[0]['train.learning_rate']}`"
        )
    )

    for args, words in (
        (["--search", "2", "--parallel", "2"], "add --pool NAME"),
        (["--search", "0"], "--search takes 1 to 32 trials"),
    ):
        refused = call(*command, *args, env=run_env, check=False)
        assert refused.returncode == 2 and words in refused.stderr, refused.stderr
    bad_range = [arg.replace("1e-3..3e-2:log", "3e-2..1e-3") for arg in command]
    refused = call(*bad_range, "--search", "2", env=run_env, check=False)
    assert refused.returncode == 1 and "LOW < HIGH" in refused.stderr.strip().splitlines()[-1]
    no_search = call(*command, env=run_env, check=False)
    assert no_search.returncode == 2 and "is a range: search it with --search N" in no_search.stderr
