"""Training state split over the devices (``train.sharding = fsdp``), blocks recomputed in
the backward pass (``train.remat``), checkpoints that restore on any device count, and the
memory estimate that refuses a run that cannot fit. The checks that need four devices run
in one process of their own (``tests/four_devices.py``); the session has two."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from bardflow.config.settings import ConfigError, build_config
from bardflow.model.network.parameters import parameters
from bardflow.model.training.memory import estimate
from bardflow.model.training.sharding import DATA_AXIS, MIN_SPLIT_ELEMENTS, mesh_axes
from tests.helpers import REPO


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    out = tmp_path_factory.mktemp("four") / "found.json"
    done = subprocess.run(
        [sys.executable, "-m", "tests.four_devices", str(out)], cwd=REPO, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text())


def test_the_fsdp_rule_splits_each_large_array_along_its_largest_dimension_the_devices_divide():
    def split_dim(shape, devices, layout="fsdp", axes=("embed", "mlp")):
        chosen = mesh_axes(axes[: len(shape)], shape, layout, {DATA_AXIS: devices})
        assert set(chosen) <= {None, DATA_AXIS} and chosen.count(DATA_AXIS) <= 1
        return chosen.index(DATA_AXIS) if DATA_AXIS in chosen else None

    assert split_dim((256, 768), 4) == 1 and split_dim((768, 256), 4) == 0
    assert split_dim((384, 384), 4) == 0  # the first of equal ones
    assert split_dim((4096, 6), 4) == 0 and split_dim((6, 4099), 4) is None  # none divides: whole
    assert split_dim((768,), 4) is None and split_dim((MIN_SPLIT_ELEMENTS,), 4) == 0  # small ones stay whole
    assert split_dim((256, 768), 1) is None
    assert split_dim((256, 768), 4, "replicated") is None  # the rule table's other layouts split nothing
    # A parameter's moments have its shape: under fsdp the codelab's state is a quarter per device,
    # but for its small vectors.
    cfg = build_config("codelab")
    whole = estimate(cfg.model, cfg.train, 4, 256, 32, "float32", sharding="replicated").state_bytes
    split = estimate(cfg.model, cfg.train, 4, 256, 32, "float32", sharding="fsdp").state_bytes
    assert whole / 4 < split <= 1.1 * whole / 4
    assert sum(parameter.size for parameter in parameters(build_config("gpt2").model).values()) == 85_449_216


@pytest.mark.parametrize("preset", ["codelab", "cpu"])
def test_the_model_is_built_with_the_parameters_declared_once_and_placement_splits_them_by_their_axes(preset):
    """The network's state holds exactly the declared parameters, shapes and all (learned and
    rotary positions), and placement splits each one, and each optimizer moment of it, as the
    rule table says; the step counts stay whole."""
    import jax
    from jax.sharding import PartitionSpec as P

    from bardflow.model.training.placement import _names, state_spec
    from bardflow.model.training.step import init_state

    cfg = build_config(preset, {"model.num_layers": 2})
    declared = parameters(cfg.model)
    _, state = jax.eval_shape(lambda: init_state(cfg.model, cfg.train))
    params, optimizer = state[0], state[1]
    built = {".".join(_names(path)): leaf.shape for path, leaf in jax.tree_util.tree_leaves_with_path(params)}
    assert built == {name: parameter.shape for name, parameter in declared.items()}
    mesh = {DATA_AXIS: 4}
    specs = {
        ".".join(_names(path)): state_spec(path, leaf.shape, "fsdp", mesh)
        for path, leaf in jax.tree_util.tree_leaves_with_path(params)
    }
    assert specs["blocks.1.mlp.up.kernel"] == P(None, DATA_AXIS) and specs["blocks.1.mlp.up.bias"] == P()
    moments = 0
    for path, leaf in jax.tree_util.tree_leaves_with_path(optimizer):
        name = ".".join(_names(path))
        owner = next((parameter for parameter in declared if name.endswith("." + parameter)), None)
        assert state_spec(path, leaf.shape, "fsdp", mesh) == (P() if owner is None else specs[owner]), name
        moments += owner is not None
    assert moments >= len(declared)  # every parameter's moments were matched to it


@pytest.mark.slow  # four emulated devices, in a process of their own
def test_fsdp_and_remat_train_to_the_same_losses_as_replicated_at_every_step(four):
    losses = four["losses"]
    for shape, optimizer, variants in (("cpu", "muon", ("fsdp", "fsdp remat")), ("codelab", "adamw", ("fsdp",))):
        reference = losses[f"{shape} {optimizer} replicated"]
        for variant in variants:
            np.testing.assert_allclose(
                losses[f"{shape} {optimizer} {variant}"], reference, rtol=1e-5, err_msg=f"{shape} {optimizer} {variant}"
            )
    assert (
        len(losses["cpu muon replicated"]) == 8
        and losses["cpu muon replicated"][-1] < 0.5 * losses["cpu muon replicated"][0]
    )  # it learned


@pytest.mark.slow  # four emulated devices, in a process of their own
def test_xla_measures_a_quarter_of_the_state_per_device_and_remat_cuts_the_temporaries(four):
    memory = four["memory"]
    replicated, fsdp = memory["replicated"], memory["fsdp"]
    assert fsdp["state_bytes"] <= (0.25 + 0.10) * replicated["state_bytes"]
    assert fsdp["argument_bytes"] <= (0.25 + 0.10) * replicated["argument_bytes"]
    assert four["fsdp_metrics"]["layout"] == "fsdp" and four["fsdp_metrics"]["step_memory"]["temp_bytes"] > 0
    kept, recomputed = memory["batch 32"], memory["batch 32 remat"]
    assert recomputed["temp_bytes"] <= 0.6 * kept["temp_bytes"]
    gathered = [memory["gpt2 fsdp passes 1"], memory["gpt2 fsdp passes 4"]]
    for figures in (kept, recomputed, *gathered):  # the estimate that refuses runs, against XLA's own figures
        measured = figures["argument_bytes"] + figures["temp_bytes"]
        assert 0.75 <= figures["estimate_bytes"] / measured <= 1.25, figures
        assert figures["estimate_state_bytes"] == pytest.approx(figures["state_bytes"], rel=1e-3)  # but step counts
    for figures in gathered:  # fsdp's whole-parameter gather is counted: without it the estimate falls short
        measured = figures["argument_bytes"] + figures["temp_bytes"]
        assert 0.9 <= figures["estimate_bytes"] / measured <= 1.1, figures
        assert (figures["estimate_bytes"] - figures["estimate_gathered_bytes"]) / measured < 0.9, figures


def test_a_checkpoint_written_with_fsdp_on_four_devices_resumes_on_four_two_and_one(four):
    uninterrupted = four["losses"]["cpu muon fsdp"]
    assert set(four["resumed"]) == {"4", "2", "1"}
    for devices, resumed in four["resumed"].items():
        metrics = resumed["metrics"]
        assert metrics["resumed_from_step"] == 4 and metrics["resumed_layout"] == {"devices": 4, "layout": "fsdp"}
        assert metrics["layout"] == ("single" if devices == "1" else "fsdp")
        np.testing.assert_allclose(resumed["losses"][4:], uninterrupted[4:], rtol=1e-5)
    assert four["resumed"]["4"]["losses"] == uninterrupted  # the same layout: bit for bit
    assert four["restored_devices"] == ["cpu:0"]  # a state split over four devices, whole on one


def test_a_run_that_cannot_fit_is_refused_with_the_figure_and_the_fix():
    from bardflow.model.training.memory import GIB, check_fits
    from bardflow.tasks.stage import RunPlan

    huge = build_config("gpt2", {"train.per_device_batch": 64, "train.micro_batch": 64})
    with pytest.raises(
        ConfigError,
        match=r"training needs about [\d.]+ GiB per device \(2 cpu devices, fsdp: "
        r"state .* GiB free: set train.remat=true, or lower train.per_device_batch",
    ):
        RunPlan(huge, devices=2, platform="cpu").parallel_training()
    small = build_config("gpt2", {"train.per_device_batch": 1, "train.sharding": "replicated"})
    fits = check_fits(small.model, small.train, 2, "gpu", 1024, 40 * GIB)
    assert fits.layout == "replicated" and fits.total_bytes < 40 * GIB
    room = fits.state_bytes + fits.gradient_bytes + fits.activation_bytes // 2  # the state fits, not the batch
    with pytest.raises(
        ConfigError,
        match=r"GiB free: set train.sharding=fsdp or train.remat=true, or lower "
        r"train.per_device_batch$",
    ):
        check_fits(small.model, small.train, 2, "gpu", 1024, room)
    # The state and gradients alone do not fit: no batch or remat helps, so neither is named.
    with pytest.raises(
        ConfigError,
        match=r"the model's state \([\d.]+ GiB\) and gradients \([\d.]+ GiB\) alone take "
        r"[\d.]+ GiB, more than the 1.4 GiB free whatever the batch; use "
        r"train.sharding=fsdp or a smaller model \(lower model.d_model or "
        r"model.num_layers\)$",
    ):  # fsdp's half of the state, the gradients and the gathered parameters fit in 1.4 GiB
        check_fits(small.model, small.train, 2, "gpu", 1024, int(1.4 * GIB))
    wide = build_config("cpu", {"model.d_model": 65536})  # 576 GiB of state: no device count helps here
    with pytest.raises(
        ConfigError,
        match=r"whatever the batch; use a smaller model \(lower model.d_model or "
        r"model.num_layers\)$",
    ):
        check_fits(wide.model, wide.train, 1, "cpu", wide.data.seq_len, 24 * GIB)


def test_mfu_counts_nanogpt_s_flops_against_a_known_peak_and_none_for_an_unknown_one():
    from bardflow.model.training.utilization import flops_per_token, peak_flops, utilization

    gpt2 = build_config("gpt2").model
    assert flops_per_token(gpt2, 1024) == 6 * 85_449_216 + 12 * 12 * 768 * 1024  # 625.9 MFLOP a token
    assert peak_flops("NVIDIA H200", "bfloat16") == 989e12 and peak_flops("NVIDIA H200", "float64") is None
    found = utilization(gpt2, 1024, 700_000.0, 1, "NVIDIA H200", "bfloat16")
    assert found["mfu"] == round(700_000 * flops_per_token(gpt2, 1024) / 989e12, 4) and found["peak_tflops"] == 989
    unknown = utilization(gpt2, 1024, 700_000.0, 1, "cpu", "float32")
    assert unknown["mfu"] is None and unknown.get("mfu_note") == "no float32 peak known for 'cpu'"
    learned = build_config("codelab").model  # a learned position table is not counted
    declared = parameters(learned)
    counted = sum(p.size for p in declared.values()) - declared["pos_embed.embedding"].size
    assert flops_per_token(learned, 256) == 6 * counted + 12 * learned.num_layers * learned.d_model * 256


def test_the_compiled_step_is_held_against_the_free_memory_before_its_first_step():
    """XLA's own figure for the executable that will run (as ``train`` records it): a step that
    does not fit ends in one line naming what to lower."""
    import jax

    from bardflow.model.data.splits import Batches
    from bardflow.model.training.loop import TrainingSetup, train
    from bardflow.model.training.memory import check_compiled_fits, compiled_needs, free_bytes
    from bardflow.model.training.placement import Placement
    from bardflow.model.training.step import init_state

    tiny = build_config("tiny")
    rows = np.random.default_rng(0).integers(0, 256, (64, 32), dtype=np.int32)
    graphdef, state = init_state(tiny.model, tiny.train)
    result = train(
        TrainingSetup(
            graphdef, state, Batches(rows, 4), [], Placement.single(jax.devices()[0]), tiny.train, stop_after=2
        )
    )
    needed = compiled_needs(result.memory or {})
    assert needed and needed >= result.memory["temp_bytes"] > 0  # pyright: ignore[reportOptionalSubscript]
    assert (free_bytes(jax.devices()[0]) or 0) > needed  # this host's available memory
    check_compiled_fits(result.memory or {}, needed, "cpu device 0", "single", False, 1)  # exactly fits
    with pytest.raises(ConfigError, match=r"^the compiled training step needs [\d.]+ GiB on cpu device 0 .* is free: "
                       r"set train.remat=true or train.sharding=fsdp, or lower train.per_device_batch or "
                       r"train.micro_batch$"):  # fmt: skip
        check_compiled_fits(result.memory or {}, needed - 1, "cpu device 0", "replicated", False, 1)
    with pytest.raises(ConfigError, match=r"needs [\d.]+ GiB .* free: lower train.per_device_batch$"):
        check_compiled_fits(result.memory or {}, needed, "cpu device 0", "fsdp", True, 4, sharing=2)
