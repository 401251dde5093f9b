import pytest

from model.config import ConfigError, build_config, parse_assignment


def test_presets_validate_and_codelab_is_the_codelab():
    cfg = build_config("codelab")
    assert (cfg.model.d_model, cfg.model.num_heads, cfg.model.ffn_dim, cfg.model.num_layers) == (256, 4, 1024, 4)
    assert (cfg.train.steps, cfg.train.per_device_batch, cfg.train.learning_rate) == (500, 32, 3e-4)
    assert cfg.data.seq_len == 256 and cfg.data.md5 == "6fb458f1232090904fb40fe944165e91"
    assert [(p.text, p.temperature) for p in cfg.generate.prompts] == [("ROMEO:", 0.8), ("To be, or not", 0.6)]
    for name in ("cpu", "tiny"):
        assert build_config(name).data.seq_len <= build_config(name).model.max_seq_len


def test_overrides_are_typed():
    cfg = build_config("tiny", {"train.steps": "7", "train.learning_rate": 0.01})
    assert cfg.train.steps == 7 and cfg.train.learning_rate == 0.01


@pytest.mark.parametrize(
    "overrides, words",
    [
        ({"train.stepz": 1}, ["unknown setting", "train.stepz"]),
        ({"nosuch.steps": 1}, ["unknown setting"]),
        ({"train.steps": "many"}, ["train.steps", "integer"]),
        ({"train.steps": 0}, ["train.steps", "greater than 0"]),
        ({"model.d_model": 33}, ["not divisible", "num_heads"]),
        ({"data.seq_len": 64}, ["max_seq_len", "lower data.seq_len"]),
        ({"train.micro_batch": 3}, ["micro_batch=3", "does not divide per_device_batch=4", "divisor"]),
        ({"model.vocab_size": 128}, ["model.vocab_size=128", "smaller than the 256 byte values", "vocab_size=256"]),
        ({"model.attention": "flash"}, ["model.attention", "'auto', 'xla' or 'custom'"]),
    ],
)
def test_bad_settings_name_the_problem_and_the_fix(overrides, words):
    with pytest.raises(ConfigError) as error:
        build_config("tiny", overrides)
    for word in words:
        assert word in str(error.value)


def test_parse_assignment_reads_json_values():
    assert parse_assignment("train.steps=12") == ("train.steps", 12)
    assert parse_assignment("data.corpus=/x/y.txt") == ("data.corpus", "/x/y.txt")
    with pytest.raises(ConfigError, match="key=value"):
        parse_assignment("train.steps")
