"""The CPU step's settings chosen by measurement (``model/training/cpu_tuning.py``): the defaults and
each single change are timed once per CPU and shape, cached, skipped where the user fixed a
setting, and the chosen step computes the one-pass XLA step's result within float tolerance."""

import json

import jax
import pytest

from bardflow.config.settings import build_config
from bardflow.model.training.cpu_tuning import candidates, choose, compiled_step
from bardflow.model.training.placement import Placement
from bardflow.model.training.step_settings import resolve


@pytest.fixture
def measuring(tmp_path, monkeypatch):
    from bardflow.model.training import cpu_tuning

    monkeypatch.setenv("BARDFLOW_CPU_TUNING", "on")
    monkeypatch.setenv("BARDFLOW_CACHE_DIR", str(tmp_path))
    # Every candidate is measured here, however busy the machine (beside the suite's other
    # worker the defaults alone may take longer than the tuner's budget for the rest).
    monkeypatch.setattr(cpu_tuning, "MAX_CANDIDATE_S", 600.0)
    return tmp_path


def test_the_fastest_measured_setting_is_chosen_once_and_kept(measuring):
    cfg = build_config("tiny", {"train.per_device_batch": 32})
    placement = Placement.data_parallel(jax.devices()[:1])
    said: list[str] = []
    first = choose(cfg.model, cfg.train, placement, cfg.data.seq_len, say=said.append)
    assert first["source"] == "measured now" and len(first["measured"]) == 4
    # The user is told before the seconds of measuring and what was kept after, once: a later
    # run finds the choice kept.
    assert len(said) == 2 and said[0].startswith("measuring 4 training step settings on this CPU")
    assert said[1].startswith("measured 4 of 4 step settings on one batch: kept kernels "), said
    default, fastest = first["measured"][0], min(first["measured"], key=lambda m: m["ms_per_step"])
    winner = fastest if fastest["ms_per_step"] <= 0.95 * default["ms_per_step"] else default  # a clear win only
    assert first["chosen"] == {k: v for k, v in winner.items() if k != "ms_per_step"}
    again = choose(cfg.model, cfg.train, placement, cfg.data.seq_len, say=said.append)
    assert again["source"].startswith("measured before on this CPU") and again["chosen"] == first["chosen"]
    assert len(said) == 2

    # Two devices share the cores: the same shape is measured again for them, its kernels
    # and passes as on one device, only XLA's options tried both ways.
    two = choose(cfg.model, cfg.train, Placement.data_parallel(jax.devices()[:2]), cfg.data.seq_len)
    assert two["source"] == "measured now" and len(two["measured"]) == 2
    assert {(m["kernels"], m["rows_per_pass"]) for m in two["measured"]} == {
        (first["chosen"]["kernels"], first["chosen"]["rows_per_pass"])
    }
    assert {m["xla"] for m in two["measured"]} == {"tuned", "default"}
    assert sorted(json.loads(key)["devices"] for key in json.loads((measuring / "cpu-step.json").read_text())) == [1, 2]


def test_settings_the_user_fixed_are_not_measured():
    cfg = build_config("tiny", {"model.attention": "xla", "train.micro_batch": 2, "train.per_device_batch": 8})
    tried = candidates(cfg.model, cfg.train, cfg.data.seq_len)
    assert [c["rows_per_pass"] for c in tried] == [2, 2] and {c["kernels"] for c in tried} == {"custom"}
    step = resolve(cfg.model, cfg.train, cfg.data.seq_len, "cpu", tried[0])
    assert step.attention == "xla" and step.dense == "custom"  # only what was left to auto


def test_every_candidate_computes_the_one_pass_xla_step():
    """Each candidate compiled as the tuner compiles it (the programs it times; the session's
    compilation cache has them once the test above has run) computes the losses of the
    one-pass step with XLA's own kernels and options."""
    cfg = build_config("tiny", {"train.per_device_batch": 32})
    placement = Placement.data_parallel(jax.devices()[:1])

    def losses(choice) -> list[float]:
        step, state, batch = compiled_step(cfg.model, cfg.train, placement, cfg.data.seq_len, choice)
        found = []
        for _ in range(3):
            state, loss = step(state, batch)
            found.append(float(loss))
        return found

    reference = losses({"kernels": "xla", "rows_per_pass": cfg.train.per_device_batch, "xla": "default"})
    tried = candidates(cfg.model, cfg.train, cfg.data.seq_len)
    assert len(tried) == 4
    for choice in tried:
        # Losses, not parameters: Adam's first updates are about ±learning rate per weight, so
        # a gradient of ~0 may flip sign with rounding; the losses that follow show any change.
        assert losses(choice) == pytest.approx(reference, rel=1e-4), choice
