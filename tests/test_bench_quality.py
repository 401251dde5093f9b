"""``python -m bench.quality``: the time-to-quality benchmark, and the ``quality`` preset,
run on this CPU for two steps with one layer (its figures come from a GPU)."""

import json

from bench.quality import first_reaching, main
from tests.helpers import play_text


def test_first_reaching_finds_the_first_record_at_or_below_the_target():
    history = [{"val_loss": 3.0}, {"val_loss": None}, {"val_loss": 1.5, "step": 9}, {"val_loss": 1.4}]
    assert first_reaching(history, 1.5)["step"] == 9 and first_reaching(history, 1.0) is None


def test_the_quality_preset_runs_and_the_benchmark_reports_its_curve(tmp_path, capsys):
    corpus = tmp_path / "play.txt"
    corpus.write_bytes(play_text(40_000))
    # Its widths, window and schedule, one layer of six: compiling six costs this test 30 s.
    settings = [
        "train.steps=2",
        "train.warmup_steps=0",
        "train.single_device_steps=0",
        "train.per_device_batch=1",
        "train.log_every=1",
        "model.num_layers=1",
    ]
    code = main(
        [
            "--preset",
            "quality",
            "--target",
            "100",
            "--corpus",
            str(corpus),
            "--out",
            str(tmp_path / "out"),
            *[arg for item in settings for arg in ("--set", item)],
        ]
    )
    assert code == 0
    report = json.loads(next((tmp_path / "out").glob("*-quality-quality.json")).read_text())
    quality = report["quality"]
    assert quality["preset"] == "quality" and quality["devices"] == 2  # the data-parallel placement
    assert [point["step"] for point in quality["curve"]] == [0, 1]
    assert quality["tokens_to_target"] == quality["curve"][0]["tokens"]  # any loss is below 100
    assert quality["seconds_to_target"] >= quality["compile_s"] > 0
    assert quality["nanogpt"]["gpu"]["val_loss"] == 1.4697 and report["machine"]["cpu"]
    assert "nanoGPT shakespeare_char" in capsys.readouterr().out


def test_a_missing_corpus_is_one_clear_error(tmp_path, capsys):
    assert main(["--corpus", str(tmp_path / "nothing.txt")]) == 2
    assert "no corpus at" in capsys.readouterr().err
