"""The command line's own behaviour, without running the pipeline."""

import pytest

from tests.conftest import md5_bytes, play_text
from tests.test_flow import bardflow


@pytest.fixture
def common(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(play_text(4_000))
    return ["--preset", "tiny", "--corpus", str(corpus), "--store", str(tmp_path / "store"),
            "--set", f"data.md5={md5_bytes(corpus.read_bytes())}"]


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
    from flows.cli import _parser

    assert _parser().parse_args(["ui"]).host == "127.0.0.1"


@pytest.mark.parametrize("command", [[], ["run"], ["presets"], ["artifacts"], ["ui"]])
def test_every_command_has_help(command):
    done = bardflow(*command, "--help")
    assert done.stdout.startswith("usage: bardflow")


def test_a_cpu_host_emulates_a_device_per_core_unless_told(monkeypatch):
    """So that train_parallel really shards on a laptop (at least 2 devices), and
    --cpu-devices or a flag already set wins."""
    import os

    from flows.settings import prepare_environment

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


def test_server_status_and_stop_without_a_server(tmp_path, monkeypatch):
    from flows import server

    monkeypatch.setenv("BARDFLOW_SERVER_FILE", str(tmp_path / "server.json"))
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    assert server.running() is None and server.stop() is False and server.use_running_server() is None
    (tmp_path / "server.json").write_text('{"pid": 999999999, "url": "http://127.0.0.1:9"}')  # a stale record
    assert server.running() is None and server.use_running_server() is None
    import os

    assert "PREFECT_API_URL" not in os.environ
