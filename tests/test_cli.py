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
