"""A run's configuration (``flows/run_config.py``): what wins between a config file, ``--set``,
``--track`` and the preset, which presets ``auto`` may become, and the flow's own corpus and
tracking parameters on top."""

import hashlib

import pytest

from bardflow.config.settings import ConfigError, PipelineConfig
from bardflow.flows.run_config import (
    AUTO_CHOICES,
    candidate_configs,
    command_line_overrides,
    pick_preset,
    resolve_run_config,
)


def test_set_wins_over_the_config_file_and_preset_over_the_file_s_own(tmp_path):
    file = tmp_path / "run.yaml"
    file.write_text("preset: tiny\ntrain:\n  steps: 7\n  log_every: 3\n")
    board = tmp_path / "tb"
    preset, overrides = command_line_overrides(None, str(file), ["train.steps=9"], [f"tensorboard={board}"])
    assert preset == "tiny"
    assert overrides == {"train.steps": 9, "train.log_every": 3, "track.tensorboard": str(board)}
    assert command_line_overrides("cpu", str(file), [], None)[0] == "cpu"
    assert command_line_overrides(None, None, [], None) == ("auto", {})


def test_auto_checks_every_preset_it_may_become_and_refuses_only_what_none_accepts():
    configs = candidate_configs("auto", {"train.steps": 40}, None)
    assert set(configs) == set(AUTO_CHOICES)
    assert all(isinstance(found, PipelineConfig) and found.train.steps == 40 for found in configs.values())
    assert set(candidate_configs("tiny", {}, None)) == {"tiny"}
    with pytest.raises(ConfigError, match="train.steps"):
        candidate_configs("auto", {"train.steps": -1}, None)
    # Fewer steps than one candidate's warmup: that one's refusal is kept, to be raised if chosen.
    some = candidate_configs("auto", {"train.steps": 12}, None)
    assert isinstance(some["codelab"], PipelineConfig)
    assert isinstance(some["cpu"], ConfigError) and "use fewer warmup steps" in str(some["cpu"])


def test_a_named_preset_stays_and_auto_becomes_the_cpu_preset_without_a_gpu():
    assert pick_preset("tiny") == "tiny"
    assert pick_preset("auto") == "cpu"  # the test session has CPU devices only


def test_the_flow_s_parameters_resolve_by_the_same_rules(tmp_path, monkeypatch):
    corpus = tmp_path / "play.txt"
    corpus.write_bytes(b"ROMEO:\nHo.\n" * 100)
    monkeypatch.setenv("BARDFLOW_CORPUS", str(corpus))
    board = str(tmp_path / "tb")
    chosen, config = resolve_run_config(
        "cpu", {"train.steps": 5}, settings={"preset": "tiny", "train": {"steps": 3}}, track=[f"tensorboard={board}"]
    )
    assert chosen == "tiny" and config.train.steps == 5  # the file's preset; the overrides over its settings
    assert config.track.tensorboard == board
    assert config.data.corpus == str(corpus)  # BARDFLOW_CORPUS where no corpus is given
    assert config.data.md5 == hashlib.md5(corpus.read_bytes()).hexdigest()  # pinned: it keys the versions
    with pytest.raises(ConfigError, match="either config .* or settings"):
        resolve_run_config("tiny", config=config, settings={"train": {"steps": 3}})
    with pytest.raises(ConfigError, match="corpus is empty"):
        resolve_run_config("tiny", corpus=" ")
