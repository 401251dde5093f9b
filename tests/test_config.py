import os
import re

import pytest

from bardflow.config.config_file import parse_assignment
from bardflow.config.settings import ConfigError, build_config


def test_presets_validate_and_codelab_is_the_codelab():
    cfg = build_config("codelab")
    assert (cfg.model.d_model, cfg.model.num_heads, cfg.model.ffn_dim, cfg.model.num_layers) == (256, 4, 1024, 4)
    assert (cfg.train.steps, cfg.train.per_device_batch, cfg.train.learning_rate) == (500, 32, 3e-4)
    assert cfg.data.seq_len == 256 and cfg.data.corpus.endswith("/tinyshakespeare/input.txt")
    assert [(p.text, p.temperature) for p in cfg.generate.prompts] == [("ROMEO:", 0.8), ("To be, or not", 0.6)]
    for name in ("cpu", "tiny", "quality"):
        assert build_config(name).data.seq_len <= build_config(name).model.max_seq_len
    assert cfg.train.single_device_steps == 0 and cfg.model.positions == "learned" and not cfg.data.every_position


def test_train_single_keys_its_short_run_and_train_parallel_ignores_it():
    """The length of train_single's throughput run decides train_single's version, not
    train_parallel's; a full-length train_single keys as it always did."""
    from bardflow.tasks.registry import TRAIN_PARALLEL, TRAIN_SINGLE
    from bardflow.tasks.stage import RunPlan

    def keys(**train):
        plan = RunPlan(build_config("cpu", {f"train.{k}": v for k, v in train.items()}), devices=2, platform="cpu")
        single, parallel = TRAIN_SINGLE.settings(plan), TRAIN_PARALLEL.settings(plan)
        return TRAIN_SINGLE.key(single, {}), TRAIN_PARALLEL.key(parallel, {}), single, parallel

    short_single, parallel, single, request = keys(single_device_steps=50)
    long_single, same_parallel, full, _ = keys(single_device_steps=0)
    assert (single.steps, request.steps, full.steps) == (50, request.train.steps, request.train.steps)
    assert parallel == same_parallel and short_single != long_single
    assert "stop_after" not in full.recipe() and single.recipe()["stop_after"] == 50
    assert "single_device_steps" not in request.recipe()["train"]


def test_settings_added_later_key_a_run_only_away_from_their_defaults():
    """Keys from before a setting stay: Muon's 5 Newton-Schulz iterations (optax's default) and
    an evaluation at every record add nothing to the recipe."""
    from bardflow.tasks.registry import TRAIN_PARALLEL
    from bardflow.tasks.stage import RunPlan

    def key(**train):
        plan = RunPlan(build_config("cpu", {f"train.{k}": v for k, v in train.items()}), devices=2, platform="cpu")
        return TRAIN_PARALLEL.key(TRAIN_PARALLEL.settings(plan), {}), TRAIN_PARALLEL.settings(plan).recipe()["train"]

    (default, recipe), (five, _), (three, fewer) = key(), key(muon_ns_steps=5), key(muon_ns_steps=3)
    assert default == five and "muon_ns_steps" not in recipe
    assert three != default and fewer["muon_ns_steps"] == 3
    (every_record, without), (rarer, with_it) = key(eval_every=0), key(eval_every=115)
    assert "eval_every" not in without and with_it["eval_every"] == 115
    assert len({default, every_record, rarer}) == 3  # the cpu preset evaluates every 230 steps


def test_overrides_are_typed():
    cfg = build_config("tiny", {"train.steps": "7", "train.learning_rate": 0.01})
    assert cfg.train.steps == 7 and cfg.train.learning_rate == 0.01


@pytest.mark.parametrize(
    "overrides, words",
    [
        ({"train.stepz": 1}, ["unknown setting", "train.stepz", "(did you mean train.steps?)"]),
        ({"nosuch.steps": 1}, ["unknown setting"]),
        ({"train.steps": "many"}, ["train.steps", "integer"]),
        ({"train.steps": 0}, ["train.steps", "greater than 0"]),
        ({"model.d_model": 33}, ["not divisible", "num_heads"]),
        ({"data.seq_len": 64}, ["max_seq_len", "lower data.seq_len"]),
        ({"train.micro_batch": 3}, ["micro_batch=3", "does not divide per_device_batch=4", "divisor"]),
        ({"model.vocab_size": 128}, ["model.vocab_size=128", "smaller than the 256 byte values", "vocab_size=256"]),
        ({"model.attention": "pallas"}, ["model.attention", "'auto', 'xla', 'custom', 'cudnn', 'splash' or 'flash'"]),
        ({"train.single_device_steps": 21}, ["single_device_steps=21", "more than steps=20", "0 for all"]),
        ({"train.beta2": 1.0}, ["train.beta2", "less than 1"]),
        ({"generate.prompts": []}, ["generate.prompts", "at least 1 item"]),
        ({"generate.seed": 10**23}, ["generate.seed", "less than 4294967296"]),
        ({"train.init_seed": -1}, ["train.init_seed", "greater than or equal to 0"]),
        ({"data.shuffle_seed": -1}, ["data.shuffle_seed", "greater than or equal to 0"]),
        ({"verify.init_seed": 2**40}, ["verify.init_seed", "less than 4294967296"]),
        ({"model.vocab_size": 300}, ["model.vocab_size=300", "larger than the 256 byte values", "vocab_size=256"]),
        ({"generate.prompts": [{"text": "ROMEO:", "temperature": float("inf")}]}, ["temperature", "finite number"]),
        ({"train.learning_rate": float("nan")}, ["train.learning_rate", "finite number"]),
        ({"data.corpus": ""}, ["data.corpus", "at least 1 character"]),
        ({"train.steps": 2**70}, ["train.steps", "less than or equal to 10000000"]),
        ({"train.checkpoint_every": 2**40}, ["train.checkpoint_every", "less than or equal to 10000000"]),
        ({"generate.max_new_bytes": 10**9}, ["generate.max_new_bytes", "less than or equal to 1000000"]),
    ],
)
def test_bad_settings_name_the_problem_and_the_fix(overrides, words):
    with pytest.raises(ConfigError) as error:
        build_config("tiny", overrides)
    for word in words:
        assert word in str(error.value)


@pytest.mark.parametrize(
    "prompt, clause",
    [({"text": "ROMEO:", "temperature": float("nan")}, "finite number"), ({"text": ""}, "at least 1 character")],
)
def test_a_refused_prompt_is_one_clause_not_an_empty_list_too(prompt, clause):
    with pytest.raises(ConfigError) as error:
        build_config("tiny", {"generate.prompts": [prompt]})
    assert str(error.value).count(";") == 0 and clause in str(error.value), str(error.value)
    assert "at least 1 item" not in str(error.value)


def test_parse_assignment_reads_json_values():
    assert parse_assignment("train.steps=12") == ("train.steps", 12)
    assert parse_assignment("data.corpus=/x/y.txt") == ("data.corpus", "/x/y.txt")
    with pytest.raises(ConfigError, match="key=value"):
        parse_assignment("train.steps")


def test_the_readme_presets_table_is_what_bardflow_presets_prints():
    import json
    import subprocess
    import sys

    from tests.helpers import REPO

    printed = json.loads(
        subprocess.run(
            [sys.executable, "-m", "bardflow", "presets", "--json"],
            cwd=REPO,
            check=True,
            capture_output=True,
            text=True,
        ).stdout
    )
    # Without --json, the same columns as a table, a row per preset.
    table = subprocess.run(
        [sys.executable, "-m", "bardflow", "presets"],
        cwd=REPO,
        env={**os.environ, "COLUMNS": "200"},
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    lines = (REPO / "README.md").read_text().split("\n")
    header = next(i for i, line in enumerate(lines) if line.startswith("| preset | seq_len |"))
    columns = [c.strip() for c in lines[header].strip("|").split("|")]
    rows = {}
    for line in lines[header + 2 :]:
        if not line.startswith("| `"):
            break
        cells = dict(zip(columns, (c.strip() for c in line.strip("|").split("|")), strict=True))
        rows[cells["preset"].strip("`")] = cells
    assert set(rows) == set(printed)
    for name, cfg in printed.items():
        data, model, train = cfg["data"], cfg["model"], cfg["train"]
        expected = {
            "seq_len": data["seq_len"],
            "layers": model["num_layers"],
            "d_model": model["d_model"],
            "heads": model["num_heads"],
            "positions": model["positions"],
            "steps": train["steps"],
            "single-device steps": train["single_device_steps"] or train["steps"],
            "batch per device": train["per_device_batch"],
            "optimizer": train["optimizer"],
            "sharding": train["sharding"],
        }
        assert {k: rows[name][k] for k in expected} == {k: str(v) for k, v in expected.items()}, name
        row = next(line for line in table.splitlines() if line.startswith(f"│ {name} "))
        assert [c.strip() for c in row.strip("│").split("│")][1:-1] == [str(v) for v in expected.values()], row


def test_a_config_file_holds_any_sections_and_a_preset_and_refuses_in_one_line(tmp_path):
    """YAML or JSON; what it holds is validated by the same models, and a bad key or value is
    named with the file it is in."""
    import json

    from bardflow.config import config_file

    run_yaml = tmp_path / "run.yaml"
    run_yaml.write_text("preset: tiny\ntrain:\n  steps: 7\n  learning_rate: 1.0e-2\ngenerate:\n  seed: 3\n")
    preset, overrides = config_file.read(run_yaml)
    assert preset == "tiny" and overrides == {"train.steps": 7, "train.learning_rate": 0.01, "generate.seed": 3}
    as_json = tmp_path / "run.json"
    as_json.write_text(json.dumps({"train": {"steps": 7}}))
    assert config_file.read(as_json) == (None, {"train.steps": 7})
    # `bardflow presets --yaml NAME` is a complete file: read back, it is the preset itself.
    whole = tmp_path / "cpu.yaml"
    whole.write_text(config_file.as_yaml("cpu"))
    assert build_config(*config_file.read(whole)) == build_config("cpu")
    assert "https://" not in whole.read_text().split("\npreset:")[1]  # no download URL to edit away offline

    for text, words in [
        ("trian:\n  steps: 3\n", [str(run_yaml), "unknown key 'trian'", "preset, data, model"]),
        ("train:\n  stepz: 3\n", [str(run_yaml), "train.stepz = 3", "unknown setting 'train.stepz'"]),
        ("train:\n  steps: 0\n", [str(run_yaml), "train.steps = 0", "greater than 0"]),
        ("preset: huge\n", [str(run_yaml), "'huge' is not a preset"]),
        ("train: [1, 2]\n", [str(run_yaml), "train: expected a mapping"]),
        ("train:\n  steps: 3\n bad indent: [\n", [str(run_yaml), "not valid YAML or JSON at line"]),
        ("- 1\n", [str(run_yaml), "expected a mapping of sections"]),
    ]:
        run_yaml.write_text(text)
        with pytest.raises(ConfigError) as error:
            config_file.read(run_yaml)
        message = str(error.value)
        assert "\n" not in message and all(w in message for w in words), (text, message)
    with pytest.raises(ConfigError, match="does not exist; check --config"):
        config_file.read(tmp_path / "gone.yaml")
    # Naming no preset, a setting is refused only if no preset would accept it.
    run_yaml.write_text("data:\n  seq_len: 256\n")
    assert config_file.read(run_yaml) == (None, {"data.seq_len": 256})


def test_a_config_file_is_read_only_from_a_regular_file_and_no_further_than_its_limit(tmp_path):
    """``/dev/zero`` reports 0 bytes and used to be read until the kernel killed the run; a
    FIFO blocked its reader for good: each is one line at once, as for a corpus."""
    import os

    from bardflow.config import config_file

    fifo = tmp_path / "settings.fifo"
    os.mkfifo(fifo)
    for path, words in [
        ("/dev/zero", "is a character device, not a regular file"),
        (fifo, "is a FIFO (named pipe), not a regular file"),
        (tmp_path, "is a folder, not a regular file"),
    ]:
        with pytest.raises(ConfigError, match=re.escape(f"config file {path} {words}; write the settings to a file")):
            config_file.read(path)
    big = tmp_path / "big.yaml"
    big.write_text("# " + "x" * config_file.MAX_BYTES + "\n")
    with pytest.raises(ConfigError, match="has 1,048,579 bytes; a config file holds at most 1,048,576"):
        config_file.read(big)


def test_a_json_config_file_is_read_as_json(tmp_path):
    """YAML 1.1 reads ``1e1`` as a string, so a JSON file's number was refused as one."""
    from bardflow.config import config_file

    as_json = tmp_path / "run.json"
    as_json.write_text('{"preset": "tiny", "train": {"steps": 1e1, "learning_rate": 3E-3}}')
    preset, overrides = config_file.read(as_json)
    assert build_config(preset, overrides).train.steps == 10
    assert build_config(preset, overrides).train.learning_rate == 0.003
    for text, words in [
        ('{"train": {"steps": 1, "steps": 2}}', "the key 'steps' is given twice; keep one"),
        ('{"train": {"steps": 1,}}', "is not valid JSON at line 1"),
        ("[" * 40 + "]" * 40, "nests deeper than 32 levels"),
        ('{"train": {"steps": 1.5}}', "train.steps"),
    ]:
        as_json.write_text(text)
        with pytest.raises(ConfigError, match=words):
            build_config(*config_file.read(as_json))


def _laughs(levels: int = 9, under: str = "data:\n  corpus") -> str:
    """The "billion laughs": each alias a list of nine of the one before."""
    lines = ["anchors:", '  a0: &a0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    lines += [f"  a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, levels + 1)]
    return "\n".join(lines) + f"\n{under}: *a{levels}\n"


@pytest.mark.parametrize(
    "text, words",
    [
        (_laughs(), "expands to more than 100,000 values"),
        (_laughs(under="generate:\n  prompts"), "expands to more than 100,000 values"),
        ("x: " + "[" * 5000 + "]" * 5000 + "\n", "not valid YAML or JSON"),
        ("train: &r\n  x: *r\n", "refers to itself (a recursive alias)"),
        (
            "train:\n  steps: 5\n  warmup_steps: 1\n  steps: 7\n",
            "the key 'steps' is given twice (lines 2 and 4); keep one",
        ),
        ("preset: tiny\npreset: cpu\n", "the key 'preset' is given twice (lines 1 and 2)"),
        (None, "holds at most 1,048,576"),
        ('{"generate": {"prompts": [' + ", ".join(['{"text": "x"}'] * 1001) + "]}}", "at most 1000 items"),
        ('{"generate": {"prompts": [{"text": "' + "x" * 10_001 + '"}]}}', "at most 10000 characters"),
    ],
)
def test_a_hostile_config_file_is_refused_in_one_line_at_once(tmp_path, text, words):
    """516 bytes of nested aliases took 46 s and 3.15 GB before a 28-line MemoryError (or hung,
    under generate.prompts); 50 MB of prompts passed and then hung; a duplicate key was taken,
    the last one winning."""
    import time

    from bardflow.config import config_file

    path = tmp_path / "run.yaml"
    if text is None:  # 450,000 prompts, as a file of 27 MB
        text = '{"generate": {"prompts": [' + ", ".join(['{"text": "To be, or not to be"}'] * 450_000) + "]}}"
    path.write_text(text)
    started = time.monotonic()
    with pytest.raises(ConfigError) as error:
        config_file.read(path)
    assert time.monotonic() - started < 5  # not the 46 s (or the hang) of before; a loaded host takes ~1 s
    message = str(error.value)
    assert "\n" not in message and len(message) < 400 and words in message and str(path) in message, message
    # A merge key is no duplicate: `<<: *defaults` is overridden by the keys after it, as YAML says.
    path.write_text("defaults: &d\n  steps: 3\ntrain:\n  <<: *d\n  steps: 5\n")
    assert config_file.parse(path.read_text(), str(path))["train"] == {"steps": 5}


def test_the_command_takes_a_config_file_under_set_and_refuses_a_bad_one_before_any_work(tmp_path):
    import subprocess
    import sys

    from tests.helpers import REPO

    bad = tmp_path / "run.yaml"
    bad.write_text("preset: tiny\ntrain:\n  steps: -2\n")
    code = (
        "import sys; from bardflow.cli.main import main; rc = main(['run', '--store', sys.argv[1], '--config', "
        "sys.argv[2]]); print('imported:', [m for m in ('jax', 'prefect') if m in sys.modules]); sys.exit(rc)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "store"), str(bad)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    line = done.stderr.strip()
    assert done.returncode == 1 and "imported: []" in done.stdout, done.stdout + done.stderr
    assert line.startswith(f"bardflow: error: {bad}: train.steps = -2:") and "\n" not in line, line
    assert not (tmp_path / "store").exists()
    printed = subprocess.run(
        [sys.executable, "-m", "bardflow", "presets", "--yaml", "tiny"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    assert printed.startswith("# bardflow run --config FILE") and "\npreset: tiny\n" in printed


def test_the_flows_typed_parameters_offer_exactly_the_stages_and_the_presets():
    from typing import get_args

    from bardflow.flows.environment import PRESET_NAMES
    from bardflow.flows.pipeline import Preset, StageName
    from bardflow.tasks.registry import NAMES

    assert get_args(StageName) == NAMES and get_args(Preset) == PRESET_NAMES
