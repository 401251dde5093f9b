"""The command line's own behaviour, without running the pipeline."""

import os
import subprocess
import sys

import pytest

from tests.helpers import REPO, bardflow, md5_bytes, play_text


@pytest.fixture
def common(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(play_text(4_000))
    return [
        "--preset",
        "tiny",
        "--corpus",
        str(corpus),
        "--store",
        str(tmp_path / "store"),
        "--set",
        f"data.md5={md5_bytes(corpus.read_bytes())}",
    ]


def test_cli_refuses_bad_input_before_any_work(common, tmp_path):
    done = bardflow("run", *common, "--refresh", "trian", check=False)
    assert done.returncode == 2 and "unknown stage 'trian'" in done.stderr and "train_single" in done.stderr
    done = bardflow("run", *common, "--set", "train.stepz=3", check=False)
    assert done.returncode == 1 and "unknown setting 'train.stepz'" in done.stderr
    assert "Traceback" not in done.stderr
    done = bardflow("--debug", "run", *common, "--set", "train.stepz=3", check=False)
    assert done.returncode == 1 and "Traceback" in done.stderr and "ConfigError" in done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith("bardflow: error: unknown setting 'train.stepz'")
    assert not (tmp_path / "store").exists()  # refused before any work


def test_servers_bind_to_this_machine_by_default():
    from bardflow.cli.arguments import parser

    assert parser().parse_args(["ui"]).host == "127.0.0.1"


@pytest.mark.parametrize("command", [[], ["run"], ["presets"], ["artifacts"], ["ui"]])
def test_every_command_has_help(command):
    done = bardflow(*command, "--help")
    assert done.stdout.startswith("usage: bardflow")


def test_a_cpu_host_emulates_a_device_per_core_unless_told(monkeypatch):
    """So that train_parallel really shards on a laptop (at least 2 devices), and
    --cpu-devices or a flag already set wins."""
    import os

    from bardflow.flows.environment import prepare_environment

    monkeypatch.setattr(os, "cpu_count", lambda: 1)
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/x")
    prepare_environment()
    assert os.environ["XLA_FLAGS"] == "--xla_dump_to=/tmp/x --xla_force_host_platform_device_count=2"
    monkeypatch.setattr(os, "cpu_count", lambda: 6)
    monkeypatch.delenv("XLA_FLAGS")
    prepare_environment()
    assert os.environ["XLA_FLAGS"] == "--xla_force_host_platform_device_count=6"
    prepare_environment()  # already set: left alone
    assert os.environ["XLA_FLAGS"] == "--xla_force_host_platform_device_count=6"
    prepare_environment(3)  # asked for: the last flag wins in XLA
    assert os.environ["XLA_FLAGS"].endswith("--xla_force_host_platform_device_count=3")


def test_compiled_programs_are_kept_in_the_machine_s_cache_unless_the_user_says_otherwise(tmp_path, monkeypatch):
    import os

    from bardflow.flows.environment import prepare_environment

    monkeypatch.setenv("BARDFLOW_CACHE_DIR", str(tmp_path))
    for name in ("JAX_COMPILATION_CACHE_DIR", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"):
        monkeypatch.delenv(name, raising=False)
    prepare_environment()  # the training processes inherit it
    assert os.environ["JAX_COMPILATION_CACHE_DIR"] == str(tmp_path / "jax")
    assert float(os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"]) < 1  # JAX's own 1 s skips the sampler
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", "")  # off
    prepare_environment()
    assert os.environ["JAX_COMPILATION_CACHE_DIR"] == ""


def test_server_status_and_stop_without_a_server(tmp_path, monkeypatch):
    from bardflow.prefect_server import process as server

    monkeypatch.setenv("BARDFLOW_SERVER_FILE", str(tmp_path / "server.json"))
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    assert server.running() is None and server.stop() is False and server.use_running_server() is None
    (tmp_path / "server.json").write_text('{"pid": 999999999, "url": "http://127.0.0.1:9"}')  # a stale record
    assert server.running() is None and server.use_running_server() is None
    import os

    assert "PREFECT_API_URL" not in os.environ


@pytest.mark.parametrize(
    "args, words",
    [
        (["--set", "generate.prompts=[]"], ["generate.prompts"]),
        (["--set", "generate.seed=100000000000000000000000"], ["generate.seed"]),
        (["--set", "data.shuffle_seed=-1"], ["data.shuffle_seed"]),
        (["--set", "model.vocab_size=300"], ["vocab_size=256"]),
        (["--set", 'generate.prompts=[{"text": "A", "temperature": Infinity}]'], ["finite number"]),
        (["--corpus", ""], ["--corpus is empty"]),
        (["--store", ""], ["--store is empty"]),
        (
            ["--set", "train.stepz=3"],
            ["unknown setting 'train.stepz'", "(see `bardflow presets --json`)"],
        ),  # it used to fall back to ./store silently
        (["--set", "data.corpus=/dev/zero"], ["corpus /dev/zero is a character device, not a regular file"]),
        (["--set", 'generate.prompts=[{"text": "A", "temperature": 1e308}]'], ["temperature", "less than or equal to"]),
        (["--processes", "0"], ["--processes must be at least 1"]),
        (["--track", "mlflow=file:///tmp/mlruns"], ["track.mlflow", "sqlite:///"]),
        (["--cpu-devices", "100000"], ["--cpu-devices must be 1 to 512"]),  # the device probe hung for minutes
        # One line, not argparse's usage block, and the preset meant.
        (["--preset", "cpuu"], ["--preset 'cpuu' is no preset (did you mean cpu?)", "auto, codelab, cpu"]),
        (["--set", "train.steps=2OO"], ["train.steps: Input should be a valid integer", "(given '2OO')"]),
    ],
)
def test_bad_values_are_refused_before_jax_or_prefect_is_imported(args, words, tmp_path):
    """Checked in the CLI before anything heavy: refused in well under a second of work."""
    code = (
        "import sys; from bardflow.cli.main import main; "
        "rc = main(['run', '--store', sys.argv[1], *sys.argv[2:]]); "
        "heavy = [m for m in ('jax', 'prefect') if m in sys.modules]; "
        "print('imported:', heavy); sys.exit(rc)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "store"), *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode in (1, 2) and "imported: []" in done.stdout, done.stdout + done.stderr
    line = done.stderr.strip()
    assert line.startswith("bardflow: error:") and "\n" not in line and all(w in line for w in words), line
    assert not (tmp_path / "store").exists()


def test_a_device_probe_that_does_not_answer_is_one_line_after_its_timeout():
    """JAX asked for far too many devices, or a driver that hangs: the probe is bounded."""
    code = (
        "import time; from bardflow.processes import distributed as d\n"
        "d._PROBE, d.PROBE_TIMEOUT_S = 'import time; time.sleep(60)', 1\n"
        "d.probe_devices(); started = time.monotonic()\n"
        "try:\n"
        "    d.hardware()\n"
        "except d.DistributedError as error:\n"
        "    print(round(time.monotonic() - started), error)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    seconds, _, line = done.stdout.strip().partition(" ")
    assert int(seconds) <= 3 and line.startswith("JAX did not list this host's devices within 1 s"), done


def test_the_summary_fits_80_columns_and_ends_with_the_samples(capsys, monkeypatch):
    from bardflow.cli.printing import print_summary

    monkeypatch.setenv("COLUMNS", "80")
    metrics = {
        "fetch": {"bytes": 1115394, "md5": "6fb458f1232090904fb40fe944165e91"},
        "train_parallel": {
            "devices": 2,
            "tokens_per_s": 21925.7,
            "ms_per_step": 186.813,
            "final_loss": 1.4895,
            "val_loss": 1.6869,
        },
    }
    summary = {
        "preset": "cpu",
        "store": "/srv/store",  # a short path: the hint after it reaches the 80th column
        "stages": {
            name: {"state": "ran", "key": "ddc481f338a28f94d7e5", "path": "", "metrics": m}
            for name, m in metrics.items()
        },
        "samples": [{"prompt": "ROMEO:", "temperature": 0.8, "seed": 42, "text": "ROMEO:\nIn must thou [warrant]"}],
    }
    print_summary(summary)
    out = capsys.readouterr().out
    assert max(len(line) for line in out.splitlines()) <= 80
    assert "ddc481f338a2" in out and "ddc481f338a28f94d7e5" not in out  # short keys
    for figure in ("1115394", "21925.7", "1.6869", "md5=6fb458f12320…"):
        assert figure in out  # numbers are never split across lines; a checksum is shown by its start
    assert out.rstrip().endswith("In must thou [warrant]") and "seed 42" in out
    assert "`bardflow artifacts`" in out  # a command to copy is never split across lines


def test_listing_a_store_that_does_not_exist_says_so(tmp_path):
    for command in (["artifacts"], ["runs"]):
        done = bardflow(*command, "--store", str(tmp_path / "nothing"), check=False)
        assert done.returncode == 1 and f"there is no store at {tmp_path / 'nothing'}" in done.stderr


def test_a_dead_prefect_server_is_one_line_before_any_work(tmp_path):
    import os

    env = {**os.environ, "PREFECT_API_URL": "http://127.0.0.1:9/api"}
    done = bardflow("run", "--preset", "tiny", "--store", str(tmp_path / "store"), env=env, check=False)
    assert done.returncode == 1 and not (tmp_path / "store").exists()
    line = done.stderr.strip()
    assert (
        line.startswith("bardflow: error: cannot reach the Prefect server at http://127.0.0.1:9/api")
        and "bardflow server start" in line
        and "\n" not in line
    ), line


def test_processes_that_do_not_share_the_devices_are_refused_before_the_run_s_server_starts(tmp_path):
    """The only refusal that needs JAX (to count the devices): still one line, before any server."""
    code = (
        "import sys; from bardflow.cli.main import main; "
        "rc = main(['run', '--store', sys.argv[1], '--preset', 'tiny', '--processes', '3']); "
        " import os; print('server:', os.environ.get('PREFECT_API_URL')); sys.exit(rc)"
    )
    alone = {name: value for name, value in os.environ.items() if name != "PREFECT_API_URL"}  # no server yet
    alone["BARDFLOW_SERVER_FILE"] = str(tmp_path / "server.json")  # and no background one
    done = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "store")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        env=alone,
    )
    assert done.returncode == 1 and "server: None" in done.stdout, done.stdout + done.stderr
    line = done.stderr.strip()
    assert line == (
        "bardflow: error: processes=3 cannot share out the 2 cpu device(s) of this host evenly; use a "
        "divisor of 2 (on a CPU, emulate devices with --cpu-devices)"
    ), line
    assert not (tmp_path / "store").exists()


def test_tables_leave_columns_out_rather_than_break_a_number_a_key_or_a_date(capsys, monkeypatch):
    """At 80 columns a sweep's table drops its versions and timings, a listing its sizes: every
    value shown is whole on one line, and a caption names what was left out."""
    from rich.console import Console

    from bardflow.cli.printing import print_sweep
    from bardflow.cli.tables import Column, fitted, short_time

    monkeypatch.setenv("COLUMNS", "80")
    rows = [
        {
            "run": n,
            "train.learning_rate": lr,
            "train.steps": 380,
            "status": "completed",
            "val_loss": 1.68691,
            "val_bpb": 2.43372,
            "tokens_per_s": 21925.7,
            "training_s": 62.4,
            "train_parallel": "ddc481f338a28f94d7e5",
            "generate": "0123456789abcdef0123",
        }
        for n, lr in ((1, "0.003"), (2, "0.01"))
    ]
    print_sweep({"rows": rows, "runs": [{}, {}], "preset": "cpu", "store": "/home/me/store"})
    out = capsys.readouterr().out
    assert max(len(line) for line in out.splitlines()) <= 80, out
    for value in ("0.003", "0.01", "1.6869", "completed", "train.learning_rate"):
        assert value in out, out
    assert "left out at this width" in out and "generate" in out.split("left out at this width")[1]
    cells = [
        [
            "train_parallel",
            "ddc481f338a28f94d7e5",
            short_time("2026-12-01T06:35:50.123456Z"),
            "0.52 MB",
            "devices=2\ntokens_per_s=21925.7\nval_loss=1.6869",
        ]
    ]
    columns = [
        Column("stage", 4),
        Column("key", 3),
        Column("created", 1),
        Column("size", 0),
        Column("key figures", 2, text=True),
    ]
    for width in (80, 120):
        console = Console(width=width, record=True)
        console.print(fitted("versions", columns, cells, width=width))
        text = console.export_text()
        assert max(len(line) for line in text.splitlines()) <= width
        for value in ("ddc481f338a28f94d7e5", "tokens_per_s=21925.7", "val_loss=1.6869"):
            assert value in text, text
        assert ("2026-12-01 06:35" in text) == (width == 120), text  # whole, or left out


def test_the_runs_table_shows_its_figures_first_and_abbreviates_the_settings():
    """`bardflow runs` at 80 and 120 columns: every figure of every version, whole; the
    settings that differ by their last names, at most four and how many more; a corpus by its
    name (no escaped characters); the creation date is what goes first."""
    from rich.console import Console

    from bardflow.cli.runs import listing_table

    differs = {f"train.setting_{n}": n for n in range(18)}
    differs.update({"model.d_model": 64, "corpus": "play.txt (20,000 bytes, md5 6fb458f12320\u2026)"})
    rows = [
        {
            "stage": stage,
            "key": key,
            "created": "2026-12-01T06:35:50Z",
            "differs": differs,
            "val_loss": 1.68691,
            "tokens_per_s": 21925.7,
            "elapsed_s": 62.4,
        }
        for stage, key in (("train_single", "ddc481f338a2"), ("train_parallel", "0123456789ab"))
    ]
    for width in (80, 120):
        console = Console(width=width, record=True)
        console.print(listing_table(rows, "trained versions", width=width))
        text = console.export_text()
        assert max(len(line) for line in text.splitlines()) <= width, text
        for value in ("ddc481f3", "01234567", "1.6869", "21,926", "62.4", "single", "parallel", "differs in"):
            assert value in text, text
        assert "\\u2026" not in text and "+16 more" in text and "setting_0=0" in text, text
        assert "train.setting_0" not in text and "20,000 bytes" not in text, text
    assert "2026-12-01 06:35" in text  # at 120 columns; the first left out at 80


def test_a_sweep_table_keeps_the_setting_its_runs_differ_in(capsys, monkeypatch):
    """At 80 columns, settings that every run shares go before the one the runs differ in
    (which, being rightmost, used to be the first setting left out)."""
    from bardflow.cli.printing import print_sweep

    monkeypatch.setenv("COLUMNS", "80")
    rows = [
        {
            "run": n,
            "model.d_model": 64,
            "train.warmup_steps": 10,
            "generate.max_new_bytes": 300,
            "train.learning_rate": lr,
            "status": "completed",
            "val_loss": 1.68691,
            "val_bpb": 2.43372,
            "tokens_per_s": 21925.7,
            "training_s": 62.4,
            "train_parallel": "ddc481f338a28f94d7e5",
            "generate": "0123456789abcdef0123",
        }
        for n, lr in ((1, "0.003"), (2, "0.01"))
    ]
    best = {
        "run": 2,
        "val_loss": 1.68691,
        "set": "--set train.learning_rate=0.0026938830192854116",
        "line": "run 2, validation loss 1.6869: --set train.learning_rate=0.0026938830192854116",
    }
    rows[1]["train.learning_rate"] = "0.0026938830192854116"
    print_sweep({"rows": rows, "runs": [{}, {}], "preset": "cpu", "store": "/home/me/store", "best": best})
    out = capsys.readouterr().out
    # The best run's line comes last, whole (the exact value); the table shows 4 digits.
    assert out.rstrip("\n").splitlines()[-1] == f"best: {best['line']}", out
    assert "0.002694" in out.split("best:")[0] and "0.0026938830192854116" not in out.split("best:")[0], out
    shown = out.split("left out at this width")[0]
    assert "train.learning_rate" in shown and "0.003" in shown and "1.6869" in shown, out

    assert "generate.max_new_bytes" in out.split("left out at this width")[1], out


def test_a_virtual_memory_limit_a_run_cannot_live_under_is_refused_in_one_line(tmp_path):
    """Under ``ulimit -v 3000000`` a run ended in native code (``std::system_error``, exit 134)
    or hung once a thread could not start."""
    # The limit set by a shell, as a user's is: a preexec_fn would fork this process, whose
    # JAX threads make os.fork unsafe.
    done = subprocess.run(
        [
            "bash",
            "-c",
            'ulimit -v 3000000 && exec "$0" "$@"',
            sys.executable,
            "-m",
            "bardflow",
            "run",
            "--preset",
            "tiny",
            "--store",
            str(tmp_path / "store"),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    line = done.stderr.strip()
    assert done.returncode == 1 and "\n" not in line, done.stderr
    assert line.startswith("bardflow: error: this shell limits virtual memory to 2.9 GiB (ulimit -v 3000000)"), line
    assert "ulimit -v unlimited" in line and not (tmp_path / "store").exists()


@pytest.mark.parametrize(
    "args, words",
    [
        (["--set", "train.learning_rate=3e-2..1e-3", "--search", "2"], "LOW < HIGH"),
        (["--search", "2"], "--search needs a range to search"),
    ],
)
def test_a_sweep_is_refused_before_its_temporary_server_starts(tmp_path, args, words):
    """An inverted search range used to print `starting a temporary Prefect server…` first."""
    import os

    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env["BARDFLOW_SERVER_FILE"] = str(tmp_path / "no-server.json")
    done = subprocess.run(
        [sys.executable, "-m", "bardflow", "sweep", "--preset", "tiny", "--store", str(tmp_path / "store"), *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode in (1, 2) and words in done.stderr, done.stderr
    assert "temporary Prefect server" not in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr


def healthy_server():
    """An HTTP server on 127.0.0.1 whose every answer is Prefect's health check's: ``true``."""
    import http.server
    import threading

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"true")

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def test_the_ui_command_with_a_server_already_there_says_where_it_is(tmp_path):
    """It printed the URLs, then `Port 4200 is already in use`, exit 1."""
    server = healthy_server()
    try:
        done = subprocess.run(
            [sys.executable, "-m", "bardflow", "ui", "--port", str(server.server_port)],
            cwd=REPO,
            env={**os.environ, "BARDFLOW_SERVER_FILE": str(tmp_path / "none.json")},
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    finally:
        server.shutdown()
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"Prefect UI:  http://127.0.0.1:{server.server_port} (a server already there)")


def test_the_command_and_the_flow_load_no_jax_and_devices_are_counted_in_a_process_of_their_own():
    """A fully cached run needs no JAX in the command's process (a second of a cached run's
    four): the flow's modules load without it, and the device count comes from a process that
    started while Prefect loaded."""
    code = (
        "import sys; import bardflow.cli.main, bardflow.flows.pipeline; loaded = 'jax' in sys.modules; "
        "from bardflow.processes.distributed import hardware, probe_devices; probe_devices(); "
        "print(loaded, hardware(), hardware(), 'jax' in sys.modules)"
    )
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=3", "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, check=True)
    assert done.stdout.split("\n")[0] == "False (3, 'cpu') (3, 'cpu') False", done.stdout + done.stderr


def test_presets_and_their_memory_table_load_no_jax():
    """A GPU host's kit carries no JAX of its own and is checked without one: the presets and
    their memory per device (which resolves the step settings) are read without importing it."""
    code = (
        "import sys; from bardflow.cli.main import main; rc = main(['presets', 'gpt2']); "
        "print('imported:', [m for m in ('jax', 'flax', 'optax') if m in sys.modules]); sys.exit(rc)"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "imported: []" in done.stdout, done.stdout[-2000:] + done.stderr
    assert "gpt2: memory per device (GiB), estimated" in done.stdout, done.stdout


BARS_AND_LOG_LINES = """
import logging, sys, time
from prefect.logging.handlers import PrefectConsoleHandler
plain = logging.StreamHandler(sys.stderr)  # a handler that writes to its stream
through_rich = PrefectConsoleHandler(stream=sys.stderr)  # Prefect's: prints through a rich console of its own
for name, handler in (("plain", plain), ("rich", through_rich)):
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%H:%M:%S"))
    logging.getLogger(name).addHandler(handler)
    logging.getLogger(name).setLevel(logging.INFO)
from bardflow.flows import ui
with ui.Progress("sweep", 2, "sweep of 2 runs, preset tiny") as sweep:
    for run in range(2):
        logging.getLogger("rich").info("preset tiny on 2 cpu device(s), run %d", run)
        with ui.Progress("train_single", 30, "train_single (1 cpu device, 30 of 460 steps)") as bar:
            for step in range(30):
                bar(step + 1)
                if step == 10:
                    logging.getLogger("plain").info("measuring 4 training step settings, run %d", run)
                if step == 20:
                    logging.getLogger("rich").info("measured 4 of 4, run %d", run)
                time.sleep(0.01)
        sweep(run + 1)
"""


def test_log_lines_during_live_bars_print_above_them_on_lines_of_their_own():
    """At a terminal (a pseudo-terminal here, 80 columns) a log line written while bars are
    drawn (a sweep's, and a stage's of one of its runs), by a handler on the stream or by
    Prefect's, which prints through a rich console of its own, clears the bars' lines and
    prints there; the bars are drawn again below it, and a nested bar's row goes when it ends."""
    import pty
    import re

    leader, follower = pty.openpty()
    env = {**os.environ, "COLUMNS": "80", "TERM": "xterm", "DO_NOT_TRACK": "1"}
    process = subprocess.Popen(
        [sys.executable, "-c", BARS_AND_LOG_LINES], stdin=follower, stdout=follower, stderr=follower, env=env, cwd=REPO
    )
    os.close(follower)
    out = b""
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # the other end closed: the process is done
            break
        if not chunk:
            break
        out += chunk
    os.close(leader)
    assert process.wait(timeout=60) == 0, out.decode(errors="replace")[-2000:]
    text = out.decode(errors="replace")
    assert re.search(r"\d+/30\b", text) and "2/2" in text, text[-2000:]  # both bars were drawn
    for run in (0, 1):
        for line in (
            f"preset tiny on 2 cpu device\\(s\\), run {run}",
            f"measuring 4 training step settings, run {run}",
            f"measured 4 of 4, run {run}",
        ):
            assert re.search(rf"(\x1b\[2K|\n)\d\d:\d\d:\d\d {line}\r?\n", text), (line, text[-3000:])
    # Once the runs are done one row is drawn: the sweep's, finished, and no stage's below it.
    last = text[text.rindex("sweep of 2 runs") :]
    assert "2/2" in last and "train_single" not in last, last


def test_a_failed_sweep_run_is_named_by_its_place_or_its_trial(capsys):
    """A sweep's runs as --json has them (flows/records.py, Trial): ``trial`` is None but for a
    search's, and the failure line names the run's place then."""
    from bardflow.cli.printing import print_sweep
    from bardflow.flows.records import Trial

    failed = Trial({"train.learning_rate": 10.0}, number=2)
    failed.failed("loss became nan at step 3")
    searched = Trial({"train.learning_rate": 9.0}, trial=5)
    searched.failed("loss became nan at step 4")
    rows = [{"run": n, "status": "failed", "val_loss": None} for n in (1, 2)]
    print_sweep(
        {
            "rows": rows,
            "runs": [Trial({}).to_json() | {"status": "completed"}, failed.to_json(), searched.to_json()],
            "preset": "tiny",
            "store": "s",
        }
    )
    err = capsys.readouterr().err
    assert "run 2 failed: loss became nan at step 3" in err and "run 5 failed: loss became nan at step 4" in err


def test_server_start_on_another_port_than_the_running_one_says_its_port_was_not_used(tmp_path):
    """A background server runs (here: its record, and a health check that answers); asked for
    another port, `server start` names the running one and that the port was not used, exit
    1; asked for the same port, it says the server is already running."""
    import json

    server = healthy_server()
    url = f"http://127.0.0.1:{server.server_port}"
    from bardflow.prefect_server.keeper import process_identity

    # The kept server's process as its record names it: the leader of its own process group,
    # with the start time recorded for it (a pid of another program is not taken).
    keeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
    record = tmp_path / "server.json"
    record.write_text(
        json.dumps(
            {"pid": keeper.pid, "process": process_identity(keeper.pid), "url": url, "log": str(tmp_path / "x.log")}
        )
    )
    env = {**os.environ, "BARDFLOW_SERVER_FILE": str(record)}
    try:
        other, same = (
            subprocess.run(
                [sys.executable, "-m", "bardflow", "server", "start", "--port", str(port)],
                cwd=REPO,
                env=env,
                capture_output=True,
                text=True,
                timeout=60,
                check=False,
            )
            for port in (server.server_port + 1, server.server_port)
        )
    finally:
        server.shutdown()
        keeper.kill()
    assert other.returncode == 1 and other.stderr.strip().splitlines() == [
        f"bardflow: error: a background Prefect server already runs at {url} (pid {keeper.pid}), so --port "
        f"{server.server_port + 1} was not used; `bardflow server stop`, then start again to move it to port "
        f"{server.server_port + 1}"
    ], other.stderr
    assert same.returncode == 0 and same.stdout.startswith(f"already running: Prefect server: {url}"), same.stderr


def test_prefect_s_drain_notice_after_a_failed_run_stays_off_the_terminal(caplog):
    """A run that fails at once ends with logs and events still queued: Prefect's services
    sent them all the same, but said "Still processing items: 5 items remaining..." after the
    run's own last line."""
    import logging

    from bardflow.flows.terminal import quiet_explained_errors

    quiet_explained_errors()
    with caplog.at_level(logging.WARNING):
        for service in ("EventsWorker", "APILogWorker"):
            logging.getLogger(service).warning("Still processing items: 5 items remaining...")
            logging.getLogger(service).warning("Failed to send events")  # anything else still shows
    assert [record.getMessage() for record in caplog.records] == ["Failed to send events"] * 2


def test_server_embedded_typed_wins_over_a_server_already_there(monkeypatch, capsys):
    """It used to be ignored while a kept server ran: the run reported there."""
    from argparse import Namespace

    from bardflow.cli.main import _server_there

    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:9/api")
    monkeypatch.delenv("BARDFLOW_SERVER", raising=False)
    assert _server_there(Namespace(server="embedded")) is None
    assert "reports to a server of its own, not to PREFECT_API_URL (http://127.0.0.1:9/api)" in capsys.readouterr().err
    chosen = _server_there(Namespace(server=None))
    assert chosen is not None and chosen.api_url == "http://127.0.0.1:9/api"
    monkeypatch.setenv("BARDFLOW_SERVER", "embedded")  # a standing default yields to a server that is there
    assert _server_there(Namespace(server=None)) is not None


def test_lines_break_at_words_on_an_80_column_terminal():
    """A terminal breaks a long line wherever its width ends ("karpathy/c" / "har-rnn"): on a
    terminal, bardflow's lines break at spaces, and a link longer than what is left of a line
    moves whole to the next; elsewhere one line stays one line."""
    import io
    import os
    import pty

    from bardflow.config.line_width import fit

    link = "http://127.0.0.1:4200/runs/flow-run/0193b5f1-2c4e-7a3b-9f00-1234567890ab"
    text = f"This run in the Prefect UI: {link} (its server was this run's own: `bardflow ui` serves it there)"
    assert fit(text, io.StringIO()) == text  # not a terminal
    leader, follower = pty.openpty()
    with os.fdopen(follower, "w", closefd=False) as terminal:
        os.environ["COLUMNS"] = "80"
        try:
            lines = fit(text, terminal).split("\n")
        finally:
            del os.environ["COLUMNS"]
    assert any(line.startswith(link) for line in lines) and all(len(line) <= 80 for line in lines)
    assert " ".join(lines) == text
    # A refusal, as the command prints it on a terminal.
    done = subprocess.run(
        [sys.executable, "-m", "bardflow", "run", "--corpus", ""],
        cwd=REPO,
        env={**os.environ, "COLUMNS": "80"},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=follower,
        timeout=60,
    )
    os.close(follower)
    said = os.read(leader, 65536).decode().replace("\r\n", "\n").strip().split("\n")
    os.close(leader)
    assert done.returncode == 2 and len(said) > 1 and all(len(line) <= 80 for line in said), said
    assert " ".join(said).startswith("bardflow: error: --corpus is empty; give an https URL, a file:// URL")
