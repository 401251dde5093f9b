import contextlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding

from bardflow.config.settings import build_config
from bardflow.model.data.splits import Batches, encode
from bardflow.model.training.evaluation import val_batches
from bardflow.model.training.loop import TrainingSetup, train
from bardflow.model.training.placement import Placement
from bardflow.model.training.step import TrainingError, init_state, make_train_step, model_from_state, target_losses

TINY = build_config("tiny")


@pytest.fixture(scope="module")
def split():
    from tests.helpers import play_text

    return encode(play_text(64_000), TINY.data.seq_len, 0.9, 0)


def test_loss_falls_on_tiny(split):
    cfg = TINY.train.model_copy(update={"steps": 60, "log_every": 10, "eval_every": 20})
    graphdef, state = init_state(TINY.model, cfg)
    result = train(
        TrainingSetup(
            graphdef, state, Batches(split.train, 8), val_batches(split.val, 6), Placement.single(jax.devices()[0]), cfg
        )
    )
    first, last = result.history[0]["loss"], result.history[-1]["loss"]
    assert first > 5.0  # about ln(256) at initialisation
    assert last < first - 1.5
    assert np.isfinite(result.val_loss) and result.val_loss < first
    assert [h["step"] for h in result.history] == [0, 10, 20, 30, 40, 50, 59]
    # Evaluated every eval_every steps and after the last, on the whole validation split
    # (here 6 does not divide it); the records between have the training loss alone.
    assert [h["step"] for h in result.history if h["val_loss"] is not None] == [0, 20, 40, 59]
    assert all(h["val_bpb"] is None for h in result.history if h["val_loss"] is None)
    assert len(split.val) % 6 and [h["val_loss"] for h in result.history][-1] == result.val_loss
    trained = model_from_state(graphdef, result.state)
    whole = float(nnx.jit(target_losses)(trained, jnp.asarray(split.val, jnp.int32)).mean())
    assert result.val_loss == pytest.approx(whole, rel=1e-5)
    assert result.history[0]["val_loss"] > result.val_loss and result.history[-1]["val_bpb"] == pytest.approx(
        result.val_loss / np.log(2)
    )
    seconds = [h["seconds"] for h in result.history]
    assert seconds == sorted(seconds) and seconds[-1] <= result.elapsed_s + 1e-3  # rounded to ms
    assert result.tokens_per_s > 0 and result.compile_s > 0


def test_data_parallel_step_really_shards_and_matches_one_device(split):
    devices = jax.devices()
    assert len(devices) == 2, "conftest asks for 2 emulated CPU devices"
    batch = split.train[:8].astype(np.int32)

    graphdef, state = init_state(TINY.model, TINY.train)
    one = Placement.single(devices[0])
    _, loss_one = make_train_step(graphdef)(one.put_state(state), one.put_batch(batch))

    graphdef, state = init_state(TINY.model, TINY.train)
    dp = Placement.data_parallel(devices)
    tokens = dp.put_batch(batch)
    assert isinstance(tokens.sharding, NamedSharding) and tuple(tokens.sharding.spec) == ("data",)
    assert {shard.data.shape for shard in tokens.addressable_shards} == {(4, batch.shape[1])}
    step = make_train_step(graphdef, dp.state_sharding, dp.batch_sharding)
    new_state, loss_dp = step(dp.put_state(state), tokens)
    for leaf in jax.tree.leaves(new_state):
        assert leaf.sharding.is_fully_replicated and len(leaf.sharding.device_set) == 2
    np.testing.assert_allclose(float(loss_dp), float(loss_one), rtol=1e-6)


def passes(micro_batch: int, per_device_batch: int, seq_len: int, platform: str) -> int:
    from bardflow.model.training.step_settings import resolve

    train_cfg = TINY.train.model_copy(update={"micro_batch": micro_batch, "per_device_batch": per_device_batch})
    return resolve(TINY.model, train_cfg, seq_len, platform).passes(per_device_batch)


def test_passes_per_step_keeps_cpu_passes_cache_sized():
    assert passes(0, 32, 256, "cpu") == 16  # codelab: 2 rows of 256 per pass
    assert passes(0, 16, 128, "cpu") == 4  # cpu preset: 4 rows of 128
    assert passes(0, 4, 32, "cpu") == 1  # already small
    assert passes(0, 12, 100, "cpu") == 3  # 5 rows would fit; 4 divides 12
    assert passes(0, 32, 256, "gpu") == 1
    assert passes(8, 32, 256, "gpu") == 4  # an explicit micro_batch wins


def _moments(state):
    """AdamW's first moment after one step: 0.1 x the gradient, leaf by leaf."""
    return [np.asarray(leaf) for leaf in jax.tree.leaves(state[1]["opt_state"]["inner_state"][0]["mu"])]


def test_a_step_in_several_passes_is_the_one_pass_step(split):
    import re

    devices = jax.devices()
    batch = split.train[:8].astype(np.int32)
    steps = {}
    for name, placement, passes in [
        ("one pass", Placement.single(devices[0]), 1),
        ("4 passes", Placement.single(devices[0]), 4),
        ("2 devices, 1 pass", Placement.data_parallel(devices), 1),
        ("2 devices, 2 passes", Placement.data_parallel(devices), 2),
    ]:
        graphdef, state = init_state(TINY.model, TINY.train)
        step = make_train_step(graphdef, placement.state_sharding, placement.batch_sharding, passes=passes)
        state, tokens = placement.put_state(state), placement.put_batch(batch)
        hlo = step.lower(state, tokens).compile().as_text()
        steps[name] = (*step(state, tokens), len(re.findall(r"\ball-reduce(?:-start)?\(", hlo)))
    reference_state, reference_loss, _ = steps["one pass"]
    for name, (state, loss, _) in steps.items():
        np.testing.assert_allclose(float(loss), float(reference_loss), rtol=1e-6, err_msg=name)
        for ours, theirs in zip(_moments(state), _moments(reference_state), strict=True):
            np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-8, err_msg=name)
    # The passes' gradients are summed on each device and averaged across devices once.
    assert steps["2 devices, 2 passes"][2] == steps["2 devices, 1 pass"][2] >= 1


def test_a_diverging_loss_stops_with_the_step(split):
    cfg = TINY.train.model_copy(update={"steps": 5, "log_every": 1, "learning_rate": 1e30})
    graphdef, state = init_state(TINY.model, cfg)
    with pytest.raises(TrainingError, match=r"at step \d+; lower train.learning_rate"):
        train(TrainingSetup(graphdef, state, Batches(split.train, 8), [], Placement.single(jax.devices()[0]), cfg))


def test_val_batches_shard_evenly():
    val = np.zeros((7, 4), np.uint8)
    batches = val_batches(val, 4, multiple=2)
    assert [(rows.shape, weights.tolist()) for rows, weights in batches] == [
        ((4, 4), [1, 1, 1, 1]),
        ((4, 4), [1, 1, 1, 0]),
    ]
    # Every row once, whatever the sizes: the weights count each real row, the padding none.
    val = (np.arange(40).reshape(10, 4) + 1).astype(np.uint8)
    for size, multiple, count in [(4, 2, 3), (5, 2, 9), (8, 4, 1), (3, 1, 10)]:
        batches = val_batches(val[:count], size, multiple)
        assert all(len(rows) % multiple == 0 for rows, _ in batches)
        assert sum(w.sum() for _, w in batches) == count
        kept = np.concatenate([rows[w > 0] for rows, w in batches])
        np.testing.assert_array_equal(kept, val[:count])


def test_bfloat16_computes_in_bfloat16_keeps_float32_state_and_tracks_float32_loss(split):
    cfg = TINY.train.model_copy(update={"steps": 60, "log_every": 59})
    runs = {}
    for precision in ("float32", "bfloat16"):
        graphdef, state = init_state(TINY.model, cfg)
        runs[precision] = train(
            TrainingSetup(
                graphdef,
                state,
                Batches(split.train, 8),
                [],
                Placement.single(jax.devices()[0]),
                cfg.model_copy(update={"precision": precision}),
            )
        )
    half, full = runs["bfloat16"], runs["float32"]
    assert half.precision == "bfloat16" and full.precision == "float32"
    floats = {leaf.dtype for leaf in jax.tree.leaves(half.state) if jnp.issubdtype(leaf.dtype, jnp.floating)}
    assert floats == {jnp.dtype("float32")}
    # Another rounding, the same learning: the final losses differ, but only a little.
    first, last_half, last_full = full.history[0]["loss"], half.history[-1]["loss"], full.history[-1]["loss"]
    assert last_half != last_full
    assert abs(last_half - last_full) < 0.05 * (first - last_full)


def test_a_bfloat16_step_multiplies_in_bfloat16_over_float32_parameters():
    """No float32 matrix product where bfloat16 was meant: every product of the compiled step
    takes bfloat16 operands, but for the two that XLA's attention gradient
    (``jax.nn.dot_product_attention``) takes with its float32 probabilities (batch, heads,
    queries, 1, keys: five axes). The state it updates stays float32."""
    import re

    tokens = jnp.zeros((4, TINY.data.seq_len), jnp.int32)
    for kernel, allowed in (("custom", 0), ("xla", 2)):
        model = TINY.model.model_copy(update={"attention": kernel, "dense": kernel})
        graphdef, state = init_state(model, TINY.train)
        text = make_train_step(graphdef, dtype=jnp.dtype("bfloat16")).lower(state, tokens).as_text()
        products = re.findall(r"stablehlo\.dot_general .*?: \((tensor<[^>]*>), (tensor<[^>]*>)\)", text)
        in_float32 = [operands for operands in products if any("xf32>" in t for t in operands)]
        assert len(products) > 10 and len(in_float32) == allowed
        assert all(t.count("x") == 5 for operands in in_float32 for t in operands if "xf32>" in t)  # 5 axes
        assert {leaf.dtype for leaf in jax.tree.leaves(state) if jnp.issubdtype(leaf.dtype, jnp.floating)} == {
            jnp.dtype("float32")
        }


def test_auto_is_resolved_once_for_the_platform_and_what_the_user_set_wins():
    from bardflow.model.training.step_settings import XLA_CPU_TUNED, resolve

    cpu = resolve(TINY.model, TINY.train, TINY.data.seq_len, "cpu")
    gpu = resolve(TINY.model, TINY.train, TINY.data.seq_len, "gpu")
    assert (cpu.attention, cpu.dense, cpu.precision, cpu.xla_options) == ("custom", "custom", "float32", XLA_CPU_TUNED)
    assert (gpu.attention, gpu.dense, gpu.precision, gpu.xla_options) == ("cudnn", "xla", "bfloat16", {})
    assert gpu.attention_note is None and cpu.attention_note is None
    fixed = resolve(
        TINY.model.model_copy(update={"attention": "xla"}),
        TINY.train.model_copy(update={"precision": "float32"}),
        TINY.data.seq_len,
        "gpu",
    )
    assert (fixed.attention, fixed.precision, fixed.attention_note) == ("xla", "float32", None)
    measured = resolve(
        TINY.model, TINY.train, TINY.data.seq_len, "cpu", {"kernels": "xla", "rows_per_pass": 2, "xla": "default"}
    )
    assert (measured.attention, measured.dense, measured.rows_per_pass, measured.xla_options) == ("xla", "xla", 2, {})
    assert cpu.model(TINY.model).attention == "custom"  # the model is built from concrete kernels
    assert jnp.dtype(gpu.precision) == jnp.bfloat16


def test_the_schedule_warms_up_decays_to_its_floor_and_clipping_bounds_the_step():
    import optax

    from bardflow.model.training.optimizer import learning_rate, make_optimizer

    cfg = build_config("tiny").train.model_copy(
        update={
            "steps": 100,
            "learning_rate": 1e-2,
            "schedule": "cosine",
            "warmup_steps": 10,
            "min_learning_rate_fraction": 0.1,
        }
    )
    rate = learning_rate(cfg)
    assert float(rate(0)) == 0.0 and float(rate(10)) == pytest.approx(1e-2)
    assert float(rate(55)) == pytest.approx(0.55e-2, rel=1e-3)  # halfway down the cosine
    assert float(rate(100)) == pytest.approx(1e-3)  # the floor at the last step
    assert learning_rate(cfg.model_copy(update={"schedule": "constant", "warmup_steps": 0})) == 1e-2
    warm = learning_rate(cfg.model_copy(update={"schedule": "constant"}))
    assert float(warm(5)) == pytest.approx(0.5e-2) and float(warm(90)) == pytest.approx(1e-2)

    params, huge = {"w": jnp.ones(4)}, {"w": jnp.asarray([3e6, -4e6, 0.0, 0.0])}
    clip_cfg = cfg.model_copy(update={"grad_clip": 1.0, "warmup_steps": 0})  # a step that moves
    clipped = make_optimizer(clip_cfg)
    ours, _ = clipped.update(huge, clipped.init(params), params)
    by_hand = optax.adamw(learning_rate(clip_cfg), weight_decay=clip_cfg.weight_decay)
    scaled = {"w": huge["w"] / 5e6}  # the same gradient, at global norm 1
    theirs, _ = by_hand.update(scaled, by_hand.init(params), params)
    np.testing.assert_allclose(np.asarray(ours["w"]), np.asarray(theirs["w"]), rtol=1e-6)
    assert np.abs(np.asarray(ours["w"])).max() > 1e-4


def test_muon_orthogonalises_with_the_configured_number_of_newton_schulz_iterations():
    from functools import partial

    from bardflow.model.training.optimizer import make_optimizer

    params = {"w": jnp.eye(4) + 0.1}
    grads = {"w": jax.random.normal(jax.random.key(0), (4, 4))}

    @partial(jax.jit, static_argnums=2)
    def update(params, grads, count):
        optimizer = make_optimizer(TINY.train.model_copy(update={"optimizer": "muon", "muon_ns_steps": count}))
        return optimizer.update(grads, optimizer.init(params), params)[0]["w"]

    one, five = np.asarray(update(params, grads, 1)), np.asarray(update(params, grads, 5))
    assert np.abs(one - five).max() > 1e-4
    # Five iterations bring the update's singular values close together: it is nearly orthogonal.
    assert np.ptp(np.linalg.svd(five, compute_uv=False)) < np.ptp(np.linalg.svd(one, compute_uv=False))


@pytest.mark.parametrize("optimizer, schedule", [("adamw", "constant"), ("muon", "cosine")])
def test_runs_that_differ_only_in_learning_rate_compile_one_step(optimizer, schedule):
    """The peak rates live in the optimizer's state: the step a sweep's runs compile is one
    program (the same lowered text), and each run's state carries its own rates."""
    cfg = build_config("tiny", {"train.optimizer": optimizer, "train.schedule": schedule, "train.warmup_steps": 2})
    tokens = np.zeros((8, cfg.data.seq_len + 1), np.int32)
    programs, states = [], []
    for rate in (3e-3, 2e-2):
        train_cfg = cfg.train.model_copy(update={"learning_rate": rate, "muon_learning_rate": 10 * rate})
        graphdef, state = init_state(cfg.model, train_cfg)
        programs.append(make_train_step(graphdef).lower(state, tokens).as_text())
        states.append(state)
    assert programs[0] == programs[1]

    def peak(state) -> float:
        (found,) = [
            leaf
            for path, leaf in jax.tree_util.tree_leaves_with_path(state[1]["opt_state"])
            if all(part in jax.tree_util.keystr(path) for part in ("'hyperparams'", "'learning_rate'"))
        ]
        return float(found)

    assert [peak(state) for state in states] == [
        np.float32(rate * (10 if optimizer == "muon" else 1)) for rate in (3e-3, 2e-2)
    ]


def test_with_every_position_the_last_position_learns_too():
    """Rows of seq_len + 1 bytes: the loss has a target at each of the model's positions,
    so the last position's embedding gets a gradient; the codelab's rows leave it at zero."""
    from flax import nnx

    from bardflow.model.network.transformer import build_model
    from bardflow.model.training.step import next_byte_loss
    from tests.helpers import play_text

    cfg = build_config("tiny")
    seq_len = cfg.model.max_seq_len
    codelab = encode(play_text(8_000), seq_len, 0.9, 0)
    every = encode(play_text(8_000), seq_len, 0.9, 0, every_position=True)
    assert codelab.train.shape[1] == seq_len and every.train.shape[1] == seq_len + 1
    np.testing.assert_array_equal(every.val[:-1, seq_len], every.val[1:, 0])  # the extra byte: the next window's first
    model = build_model(cfg.model, 0)

    gradient = nnx.jit(nnx.grad(next_byte_loss))  # compiled whole: op by op, each operation compiles alone

    def last_position_gradient(rows):
        grads = gradient(model, jnp.asarray(rows[:8], jnp.int32))
        return float(jnp.abs(grads.pos_embed.embedding[...][seq_len - 1]).max())

    assert last_position_gradient(codelab.train) == 0.0
    assert last_position_gradient(every.train) > 0.0


def test_stop_after_runs_the_first_steps_of_the_same_schedule(split):
    """train_single's short run: the first steps of the full run's schedule, step for step."""
    # tests/test_resume.py's scheduled configuration: one compiled step serves both.
    cfg = TINY.train.model_copy(
        update={"steps": 30, "log_every": 1, "schedule": "cosine", "warmup_steps": 6, "grad_clip": 0.5}
    )
    graphdef, state = init_state(TINY.model, cfg)
    place = Placement.single(jax.devices()[0])
    full = train(TrainingSetup(graphdef, state, Batches(split.train, 8), [], place, cfg))
    graphdef, state = init_state(TINY.model, cfg)
    short = train(TrainingSetup(graphdef, state, Batches(split.train, 8), [], place, cfg, stop_after=5))
    assert short.steps == 5 and [h["step"] for h in short.history] == [0, 1, 2, 3, 4]
    assert [h["loss"] for h in short.history] == [h["loss"] for h in full.history[:5]]
    assert full.history[5]["loss"] != full.history[4]["loss"]  # the full run went on


def test_muon_takes_the_blocks_matrices_and_leaves_tables_head_and_vectors_to_adamw(split):
    from flax import nnx

    from bardflow.model.network.transformer import build_model
    from bardflow.model.training.optimizer import muon_labels

    model = build_model(TINY.model, 0)
    chosen = muon_labels(nnx.state(model, nnx.Param))
    muon = sorted(
        jax.tree_util.keystr(path) for path, leaf in jax.tree_util.tree_flatten_with_path(chosen)[0] if leaf == "muon"
    )
    assert len(muon) == 4 * TINY.model.num_layers and all(".kernel" in p or "['kernel']" in p for p in muon)
    assert not any(name in p for p in muon for name in ("embed", "lm_head"))

    # tests/test_resume.py's Muon configuration: one compiled step serves both.
    cfg = TINY.train.model_copy(
        update={
            "steps": 30,
            "log_every": 29,
            "optimizer": "muon",
            "schedule": "cosine",
            "warmup_steps": 6,
            "grad_clip": 0.5,
            "beta2": 0.99,
        }
    )
    graphdef, state = init_state(TINY.model, cfg)
    result = train(TrainingSetup(graphdef, state, Batches(split.train, 8), [], Placement.single(jax.devices()[0]), cfg))
    assert result.history[-1]["loss"] < result.history[0]["loss"] - 1.0


def test_muon_is_optax_s_own_and_on_a_mesh_each_device_orthogonalises_its_share():
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P
    from optax.contrib import MuonDimensionNumbers
    from optax.contrib import muon as optax_muon

    from bardflow.model.network.transformer import build_model
    from bardflow.model.training.optimizer import muon, muon_labels, share_out

    params = nnx.state(build_model(TINY.model.model_copy(update={"num_layers": 2}), 0), nnx.Param)
    leaves, tree = jax.tree.flatten(params)  # a gradient of its own for each, equal shapes too
    grads = tree.unflatten([jax.random.normal(jax.random.key(i), p.shape) for i, p in enumerate(leaves)])
    ours = muon(0.03, 2e-2, 5, 0.99, 1e-4)
    theirs = optax_muon(
        0.03,
        weight_decay=1e-4,
        adam_learning_rate=2e-2,
        adam_b2=0.99,
        adam_weight_decay=1e-4,
        muon_weight_dimension_numbers=lambda p: jax.tree.map(
            lambda label: MuonDimensionNumbers(0, 1) if label == "muon" else None, muon_labels(p)
        ),
    )

    def two_steps(tx, mesh=None):
        def run(grads, params):
            with jax.sharding.use_abstract_mesh(mesh.abstract_mesh) if mesh else contextlib.nullcontext():
                _, state = tx.update(grads, tx.init(params), params)
                return tx.update(jax.tree.map(lambda g: 0.5 * g + 0.1, grads), state, params)

        return jax.jit(run)

    state = ours.init(params)
    assert jax.tree.structure(state) == jax.tree.structure(theirs.init(params))  # checkpoints stay compatible
    expected, got = two_steps(theirs)(grads, params), two_steps(ours)(grads, params)
    # One device: optax's computation, the matrices of one shape batched, float rounding apart:
    # two programs written differently may round an ulp apart (and did, after an unrelated edit
    # moved this test's source lines, which the compiled programs carry).
    for a, b in zip(jax.tree.leaves(expected), jax.tree.leaves(got), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)

    # Each shape's Newton-Schulz iterations a loop: XLA compiles its three products once, not
    # once an iteration (optax writes them out: five times as many, each compiled apart).
    compiled = jax.jit(lambda g, p: ours.update(g, state, p)).lower(grads, params).compile().as_text()
    labels = jax.tree.leaves(muon_labels(params))
    shapes = {leaf.shape for leaf, label in zip(leaves, labels, strict=True) if label == "muon"}
    assert len(re.findall(r"= \S+ dot\(", compiled)) == 3 * len(shapes)

    mesh = Mesh(np.array(jax.devices()), ("data",))
    shared = two_steps(ours, mesh).lower(*jax.device_put((grads, params), NamedSharding(mesh, P())))
    assert "stablehlo.case" in shared.as_text()  # each device takes its own branch of matrices
    for a, b in zip(jax.tree.leaves(expected), jax.tree.leaves(shared.compile()(grads, params)), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)

    # The costliest matrices first, each to the least loaded device: the loads come out level.
    owners = share_out([19, 15, 6, 19, 19, 15, 6, 19], 2)
    costs = [19, 15, 6, 19, 19, 15, 6, 19]
    assert [sum(c for c, o in zip(costs, owners, strict=True) if o == d) for d in (0, 1)] == [59, 59]
    assert share_out([5, 1], 4) == [0, 1]


def test_training_reads_shards_as_one_split_and_a_bounded_evaluation_streams_a_fixed_choice(split, tmp_path):
    from bardflow.model.data.splits import read_split, write_split
    from bardflow.model.training.evaluation import Evaluation, eval_choice, eval_limit

    cfg = TINY.train.model_copy(update={"steps": 12, "log_every": 4})
    placement = Placement.data_parallel(jax.devices())
    write_split(tmp_path / "train", split.train, {}, shard_bytes=3_000)  # batches straddle the shards
    sharded = read_split(tmp_path / "train")
    assert len(list((tmp_path / "train").iterdir())) > 10
    runs = []
    for rows in (split.train, sharded):
        graphdef, state = init_state(TINY.model, cfg)
        runs.append(
            train(TrainingSetup(graphdef, state, Batches(rows, 8), val_batches(split.val, 6, 2), placement, cfg))
        )
    assert [h["loss"] for h in runs[0].history] == [h["loss"] for h in runs[1].history]  # bitwise

    # A fixed, seeded choice of rows, the same every time; all of a split within the limit.
    assert eval_choice(len(split.val), len(split.val)) is None
    chosen = eval_choice(len(split.val), 50)
    assert len(chosen) == 50 and np.all(np.diff(chosen) > 0) and np.array_equal(chosen, eval_choice(len(split.val), 50))
    assert eval_limit(0, 16, 256) == 4096 and eval_limit(0, 1024, 256) == 30 * 1024 and eval_limit(7, 16, 256) == 7
    # Placed a group at a time, the loss is the one of the rows placed at once.
    subset = split.val[chosen].astype(np.int32)
    batches = val_batches(subset, 6, 2)
    at_once = Evaluation(graphdef, batches, placement)(runs[1].state)
    in_groups = Evaluation(graphdef, batches, placement, group_tokens=2 * batches[0][0].size)(runs[1].state)
    assert len(batches) > 4 and in_groups == pytest.approx(at_once, rel=1e-6)
    trained = model_from_state(graphdef, runs[1].state)
    assert at_once == pytest.approx(float(nnx.jit(target_losses)(trained, jnp.asarray(subset)).mean()), rel=1e-5)


def test_several_steps_per_call_take_the_same_steps_and_hooks_land_where_they_did(split, tmp_path):
    """``train.steps_per_call``: the history, the evaluations, the checkpoints and the trained
    parameters of one step a call, the calls ending where a hook needs the state; resumed from
    a checkpoint too. Bitwise where XLA compiles the loop's body as the step: with XLA:CPU's
    fusion emitters (its default, which this test asks for; the older emitters that the tests
    compile with round a loss in the loop an ulp apart, 4.8e-7, and AdamW turns that into
    visible differences of near-zero parameters)."""
    import dataclasses

    from bardflow.model.training.checkpoint import TrainingCheckpoints
    from bardflow.model.training.hooks import Hook
    from bardflow.model.training.step_settings import resolve

    cfg = TINY.train.model_copy(
        update={"steps": 23, "log_every": 5, "eval_every": 10, "checkpoint_every": 10, "schedule": "cosine"}
    )
    # Two devices under fsdp: the stacked batches and the scan's carry sharded as a run shards
    # them (one device's case is the same program without the collectives).
    devices = 2
    place = Placement.data_parallel(jax.devices()[:devices], fsdp=True)
    batches, val = Batches(split.train, 4 * devices), val_batches(split.val, 6 * devices, devices)
    runs = {}
    for per_call in (1, 4):
        chosen = cfg.model_copy(update={"steps_per_call": per_call})
        step = resolve(TINY.model, chosen, TINY.data.seq_len, "cpu")
        assert step.steps_per_call == per_call and not step.unroll
        step = dataclasses.replace(step, xla_options={**step.xla_options, "xla_cpu_use_fusion_emitters": True})
        seen: list[tuple[int, bool]] = []
        hook = Hook(lambda info, seen=seen: seen.append((info.step, info.state is not None)))
        graphdef, state = init_state(step.model(TINY.model), chosen)
        checkpoints = TrainingCheckpoints(tmp_path / str(per_call), 5)
        result = train(
            TrainingSetup(
                graphdef, state, batches, val, place, chosen, checkpoints=checkpoints, step=step, hooks=[hook]
            )
        )
        checkpoints.close()
        runs[per_call] = (result, seen, TrainingCheckpoints.steps(tmp_path / str(per_call)))
    (one, one_seen, one_saved), (four, four_seen, four_saved) = runs[1], runs[4]
    assert four.history == [{**h, "seconds": g["seconds"]} for h, g in zip(one.history, four.history, strict=True)]
    assert [h["step"] for h in four.history if h["val_loss"] is not None] == [0, 10, 20, 22]
    assert one_saved == four_saved == [10, 20]
    for a, b in zip(jax.tree.leaves(one.state), jax.tree.leaves(four.state), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # Every step is seen by the hooks, in order; the state only where a call ended: after step
    # 0 (evaluated), 4 steps a call, and sooner before an evaluation, a checkpoint or the end
    # (the loop takes a call cut short as it takes a whole one: the last two steps are one call).
    assert [s for s, _ in four_seen] == [s for s, _ in one_seen] == list(range(23))
    assert [s for s, has in four_seen if has] == [0, 4, 8, 9, 10, 14, 18, 19, 20, 22]
    # A rerun resumes from the newest checkpoint (step 20) and takes the last steps in one call.
    graphdef, state = init_state(TINY.model, cfg.model_copy(update={"steps_per_call": 4}))
    checkpoints = TrainingCheckpoints(tmp_path / "4", 5)
    again = train(TrainingSetup(graphdef, state, batches, val, place, cfg, checkpoints=checkpoints, step=step))
    checkpoints.close()
    assert again.resumed_from == 20 and again.history[-1]["loss"] == one.history[-1]["loss"]


def test_a_gpu_takes_cudnn_s_fused_attention_where_it_can_and_says_why_not_where_it_cannot():
    from bardflow.config.settings import ConfigError
    from bardflow.model.network.kernels import fused_attention_problem
    from bardflow.model.training.step_settings import resolve

    seq_len = TINY.data.seq_len
    in_float32 = resolve(TINY.model, TINY.train.model_copy(update={"precision": "float32"}), seq_len, "gpu")
    assert in_float32.attention == "xla" and "bfloat16" in (in_float32.attention_note or "")
    wide = TINY.model.model_copy(update={"d_model": 36, "num_heads": 2})  # heads 18 wide
    assert "multiple of 8" in (resolve(wide, TINY.train, seq_len, "gpu").attention_note or "")
    # The run on the device: a kernel that fails there leaves XLA's attention and the reason.
    # Run here, on a CPU, cuDNN's kernel fails, and the probe says so in one line.
    reason = fused_attention_problem(seq_len, 2, 16, "bfloat16")
    assert reason and "\n" not in reason and reason.startswith("cuDNN's fused attention failed on")
    probed = resolve(TINY.model, TINY.train, seq_len, "gpu", probe=fused_attention_problem)
    assert (probed.attention, probed.attention_note) == ("xla", reason)
    ok = resolve(TINY.model, TINY.train, seq_len, "gpu", probe=lambda *shape: None)
    assert (ok.attention, ok.attention_note) == ("cudnn", None)
    asked = TINY.model.model_copy(update={"attention": "cudnn"})
    with pytest.raises(ConfigError, match="model.attention=cudnn.*set model.attention=auto"):
        resolve(asked, TINY.train, seq_len, "cpu")
    with pytest.raises(ConfigError, match="model.attention=cudnn cannot serve: .*bfloat16"):
        resolve(asked, TINY.train.model_copy(update={"precision": "float32"}), seq_len, "gpu")


def test_steps_per_call_auto_is_one_on_a_cpu_and_fills_the_hook_intervals_elsewhere():
    from bardflow.config.settings import ConfigError
    from bardflow.model.training.step_settings import resolve

    codelab, quality, gpt2 = (build_config(name) for name in ("codelab", "quality", "gpt2"))
    assert [resolve(c.model, c.train, c.data.seq_len, "cpu").steps_per_call for c in (codelab, gpt2)] == [1, 1]
    found = {
        name: resolve(c.model, c.train, c.data.seq_len, "gpu")
        for name, c in (("codelab", codelab), ("quality", quality), ("gpt2", gpt2))
    }
    # codelab: ~0.17 TFLOP a step, 16 wanted, 10 divides its intervals of 100; gpt2 fills a call alone.
    assert {name: (s.steps_per_call, s.unroll) for name, s in found.items()} == {
        "codelab": (10, True),
        "quality": (5, True),
        "gpt2": (1, False),
    }
    # A TPU takes the same steps a call as a loop: written out, they compiled several times slower.
    on_tpu = resolve(quality.model, quality.train, quality.data.seq_len, "tpu")
    assert (on_tpu.steps_per_call, on_tpu.unroll) == (5, False)
    two = resolve(codelab.model, codelab.train, 256, "gpu", processes=2)
    assert two.steps_per_call == 1
    with pytest.raises(ConfigError, match="steps_per_call=4 runs in one process"):
        resolve(codelab.model, codelab.train.model_copy(update={"steps_per_call": 4}), 256, "gpu", processes=2)


def test_a_tpu_takes_pallas_attention_where_it_can_and_says_why_not_where_it_cannot():
    from bardflow.config.settings import ConfigError
    from bardflow.model.training.step_settings import TPU_ATTENTION, resolve

    gpt2 = build_config("gpt2")
    chosen = resolve(gpt2.model, gpt2.train, gpt2.data.seq_len, "tpu")
    assert (chosen.attention, chosen.attention_note, chosen.precision) == (TPU_ATTENTION, None, "bfloat16")
    short = resolve(TINY.model, TINY.train, TINY.data.seq_len, "tpu")  # a 32-byte context
    assert short.attention == "xla" and "multiple of 128" in (short.attention_note or "")
    quality = build_config("quality")  # 256 bytes: XLA's attention was measured as fast there
    under = resolve(quality.model, quality.train, quality.data.seq_len, "tpu")
    assert under.attention == "xla" and "under 1024" in (under.attention_note or "")
    several = resolve(gpt2.model, gpt2.train, gpt2.data.seq_len, "tpu", devices=4)
    assert several.attention == "xla" and "on 4" in (several.attention_note or "")
    flash = gpt2.model.model_copy(update={"attention": "flash"})
    assert resolve(flash, gpt2.train, gpt2.data.seq_len, "tpu").attention == "flash"
    with pytest.raises(ConfigError, match="model.attention=flash is Pallas's attention for TPUs.*on gpu"):
        resolve(flash, gpt2.train, gpt2.data.seq_len, "gpu")
    with pytest.raises(ConfigError, match="model.attention=splash cannot serve: .*multiple of 128"):
        resolve(TINY.model.model_copy(update={"attention": "splash"}), TINY.train, TINY.data.seq_len, "tpu")
    # Neither CPU nor GPU choices move.
    assert resolve(gpt2.model, gpt2.train, gpt2.data.seq_len, "cpu").attention == "custom"
    assert resolve(gpt2.model, gpt2.train, gpt2.data.seq_len, "gpu", probe=lambda *shape: None).attention == "cudnn"


def test_a_training_process_s_failure_names_the_fix_that_fits_it(tmp_path):
    """Only an abort between emulated devices is helped by --cpu-devices 1; a full disk in
    the training process used to be told to pass it too."""
    from bardflow.processes.launch import _failure
    from bardflow.tasks.train import parallel_failure

    log = tmp_path / "process-0.log"
    log.write_text("Traceback …\nbardflow.errors.DiskFullError: no room for the checkpoint of step 20\n")
    full = parallel_failure(_failure(0, 1, 1, log, (20, 40)), [10], "cpu", 1)
    assert "no room for the checkpoint of step 20" in str(full) and "--cpu-devices" not in str(full)
    assert "resume from the checkpoint of step 10" in str(full)
    aborted = parallel_failure(_failure(0, 1, -6, log, (20, 40)), [], "cpu", 1)
    assert "killed by signal 6" in str(aborted) and "pass --cpu-devices 1" in str(aborted)
    assert "rerun starts from step 0" in str(aborted)


def test_the_blocks_scanned_compute_what_they_compute_unrolled_with_the_same_dropout():
    """``train.layers=scanned``: one loop over the blocks' stacked parameters, the same loss,
    gradients and dropout masks as the blocks one after another (float rounding apart)."""
    from bardflow.model.network.transformer import build_model
    from bardflow.model.training.step import next_byte_loss

    cfg = TINY.model.model_copy(update={"num_layers": 3, "dropout": 0.1, "attention": "xla", "dense": "xla"})
    model = build_model(cfg, seed=0)
    tokens = jax.random.randint(jax.random.key(5), (4, cfg.max_seq_len), 0, 256)
    found = {}
    for scanned in (False, True):
        for key in (None, jax.random.key(7, impl="rbg")):
            blocks = "scanned" if scanned else "unrolled"
            loss_fn = lambda m, t, key=key, blocks=blocks: next_byte_loss(m, t, blocks, key)  # noqa: E731
            found[scanned, key is None] = nnx.jit(nnx.value_and_grad(loss_fn))(model, tokens)
    for plain in (True, False):
        (loss_unrolled, grads_unrolled), (loss_scanned, grads_scanned) = found[False, plain], found[True, plain]
        assert float(loss_scanned) == pytest.approx(float(loss_unrolled), rel=1e-6)
        for a, b in zip(jax.tree.leaves(grads_unrolled), jax.tree.leaves(grads_scanned), strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)
    assert abs(float(found[False, True][0]) - float(found[False, False][0])) > 1e-4  # dropout did drop


def test_dropout_draws_a_byte_a_value_from_xla_s_generators_and_threefry_s_bernoulli_otherwise():
    """From an rbg key each value's fate is one byte (the rate in 256ths, the kept values
    scaled so the mean stays), the same bits for the same key; a threefry key keeps the
    Bernoulli masks every CPU and GPU loss was made with."""
    from bardflow.model.network.transformer import dropped

    x = jnp.ones((256, 1024), jnp.float32)
    for impl in ("rbg", "unsafe_rbg"):
        key = jax.random.key(3, impl=impl)
        out = np.asarray(dropped(x, 0.2, key))
        kept = out != 0
        assert set(np.unique(out)) == {0.0, np.float32(256 / 205)}  # 51 of 256 dropped
        assert abs(1 - kept.mean() - 51 / 256) < 0.005 and abs(out.mean() - 1) < 0.01
        bytes_ = np.asarray(jax.random.bits(key, x.shape, jnp.uint8))
        np.testing.assert_array_equal(kept, bytes_ >= 51)
        np.testing.assert_array_equal(out, np.asarray(dropped(x, 0.2, jax.random.key(3, impl=impl))))
    threefry = jax.random.key(3)
    np.testing.assert_array_equal(
        np.asarray(dropped(x, 0.2, threefry)),
        np.where(np.asarray(jax.random.bernoulli(threefry, 0.8, x.shape)), np.float32(1 / 0.8), 0.0),
    )


def test_layers_and_dropout_s_generator_resolve_per_platform_and_say_why():
    from bardflow.config.settings import build_config
    from bardflow.model.training.step_settings import resolve

    quality = build_config("quality")
    found = {p: resolve(quality.model, quality.train, quality.data.seq_len, p) for p in ("cpu", "gpu", "tpu")}
    assert {p: (s.layers, s.generator) for p, s in found.items()} == {
        "cpu": ("unrolled", "threefry2x32"),
        "gpu": ("unrolled", "threefry2x32"),
        "tpu": ("unrolled", "rbg"),
    }
    assert all(s.layers_note.startswith("auto: ") for s in found.values())
    recorded = found["tpu"].as_json()  # what the training manifest's step_settings hold
    assert (recorded["layers"], recorded["generator"]) == ("unrolled", "rbg") and "TPU" in recorded["layers_note"]
    asked = resolve(quality.model, quality.train.model_copy(update={"layers": "scanned"}), 256, "tpu")
    assert (asked.layers, asked.layers_note, asked.scanned) == ("scanned", "train.layers=scanned", True)
    remat = resolve(quality.model, quality.train.model_copy(update={"remat": True, "layers": "unrolled"}), 256, "cpu")
    assert remat.scanned and "remat" in remat.layers_note
    threefry = quality.train.model_copy(update={"dropout_generator": "threefry2x32"})
    assert resolve(quality.model, threefry, 256, "tpu").generator == "threefry2x32"


def test_a_run_compiles_its_programs_ahead_once_each_and_says_how_long(split):
    """The step (up to four a call, as a loop: no program of one step besides), the
    evaluation, compiled side by side before training, each once: the evaluation's jitted
    call finds its program compiled."""
    model = TINY.model.model_copy(update={"d_model": 40, "num_heads": 2, "ffn_dim": 72})  # programs of its own
    cfg = TINY.train.model_copy(update={"steps": 9, "log_every": 4, "steps_per_call": 4})
    graphdef, state = init_state(model, cfg)
    said: list[str] = []
    result = train(
        TrainingSetup(
            graphdef,
            state,
            Batches(split.train, 4),
            val_batches(split.val[:24], 8),
            Placement.single(jax.devices()[0]),
            cfg,
            note=said.append,
        )
    )
    compiled = result.metrics()["compiled"]
    assert compiled["programs"] + compiled["from_cache"] == 2, compiled
    assert [h["step"] for h in result.history if h["val_loss"] is not None] == [0, 4, 8]
    assert len(said) == 1 and said[0].startswith("compiled the step (unrolled blocks, 4 a call)")
    assert f"{result.compile_s:.1f} s" in said[0] and result.compile_s > 0
    # Each program's own time, the looped step's and the evaluation's, none longer than the whole.
    each = result.metrics()["compile_each_s"]
    assert list(each) == ["4 steps", "evaluation"] and all(0 < s <= result.compile_s + 0.01 for s in each.values())
    assert all(f"{name} {seconds:.1f} s" in said[0] for name, seconds in each.items())
