"""``python -m bench.fsdp``: training state replicated against split over the devices (FSDP),
with and without remat, on this host's devices (``--cpu-devices N`` emulates them on a CPU).

For each layout: XLA's figures of the compiled step per device (``memory_analysis``: the
state, arguments, temporaries) beside the estimate that ``bardflow run`` refuses runs with
(``model/training/memory.py``), then tokens/s, ms/step and MFU over timed steps of random tokens.
``--equality`` instead trains the cpu and codelab shapes for 50 steps on TinyShakespeare in
each layout, AdamW and Muon, and reports the largest relative loss difference against
replicated at any record (what ``tests/test_fsdp.py`` checks in a few steps).

    python -m bench.fsdp --preset gpt2                 # a GPU host (bench/gpu_check.sh runs it)
    python -m bench.fsdp --cpu-devices 4 --equality    # on a CPU
    python -m bench.fsdp --cpu-devices 4 --preset cpu --muon   # Muon's share-out under fsdp, or not
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

LAYOUTS = (("replicated", False), ("fsdp", False), ("fsdp", True))


def _config(preset: str, settings: dict):
    from bardflow.config.settings import build_config

    return build_config(preset, settings)


def measure(preset: str, settings: dict, sharding: str, remat: bool, steps: int) -> dict:
    import jax
    import numpy as np

    from bardflow.model.training.memory import estimate, step_memory
    from bardflow.model.training.placement import Placement
    from bardflow.model.training.step import init_state, make_train_step
    from bardflow.model.training.step_settings import resolve
    from bench.run import utilisation

    cfg = _config(preset, {**settings, "train.sharding": sharding, "train.remat": remat})
    devices = jax.devices()
    platform = devices[0].platform
    step = resolve(cfg.model, cfg.train, cfg.data.seq_len, platform)
    placement = (
        Placement.data_parallel(devices, fsdp=sharding == "fsdp") if len(devices) > 1 else Placement.single(devices[0])
    )
    graphdef, state = init_state(step.model(cfg.model), cfg.train)
    state = placement.put_state(state)
    rows = cfg.train.per_device_batch * len(devices)
    width = cfg.data.seq_len + int(cfg.data.every_position)
    tokens = np.random.default_rng(0).integers(0, 256, (rows, width), dtype=np.int32)
    batch = placement.put_batch(tokens)
    started = time.perf_counter()
    compiled = (
        make_train_step(
            graphdef,
            placement.shardings(state),
            placement.batch_sharding,
            jax.numpy.dtype(step.precision),
            step.passes(cfg.train.per_device_batch),
            remat,
        )
        .lower(state, batch)
        .compile(compiler_options=step.xla_options)
    )
    compile_s = time.perf_counter() - started
    memory = step_memory(compiled, state)
    cost = compiled.cost_analysis()
    cost = (cost[0] if isinstance(cost, list) else cost) or {}
    found = estimate(
        cfg.model,
        cfg.train,
        len(devices),
        cfg.data.seq_len,
        step.rows_per_pass,
        step.precision,
        attention=step.attention,
        platform=devices[0].platform,
    )
    state, loss = compiled(state, batch)  # warm
    float(loss)
    started = time.perf_counter()
    for _ in range(steps):
        state, loss = compiled(state, batch)
    float(loss)
    seconds = time.perf_counter() - started
    tokens_per_s = steps * rows * cfg.data.seq_len / seconds
    used = utilisation(cfg, tokens_per_s / len(devices), step.precision)
    measured = memory.get("argument_bytes", 0) + memory.get("temp_bytes", 0)
    return {
        "layout": sharding,
        "remat": remat,
        "devices": len(devices),
        "precision": step.precision,
        "rows_per_pass": step.rows_per_pass,
        "compile_s": round(compile_s, 1),
        "ms_per_step": round(1e3 * seconds / steps, 2),
        "tokens_per_s": round(tokens_per_s, 1),
        "mfu": None if used["mfu"] is None else round(used["mfu"], 4),
        "gflops_per_device_step": round(cost.get("flops", 0) / 1e9, 3),
        "state_mib": round(memory["state_bytes"] / 2**20, 1),
        "xla_argument_plus_temp_mib": round(measured / 2**20, 1),
        "estimate_mib": round(found.total_bytes / 2**20, 1),
        "estimate_vs_xla": round(found.total_bytes / measured, 3) if measured else None,
    }


def muon_share_out(preset: str, settings: dict, steps: int) -> dict:
    """Muon under fsdp two ways: today's share-out (its matrices gathered whole, each device
    orthogonalising its share, the results summed) against no share-out (XLA partitions each
    orthogonalisation over the split matrices as it sees fit)."""
    import functools

    from bardflow.model.training import optimizer, sharding
    from bardflow.model.training import step as step_module

    original, found = optimizer.split_among_devices, {}
    try:
        for name, axis in (("share-out", sharding.DATA_AXIS), ("no share-out", "none")):
            optimizer.split_among_devices = functools.partial(original, axis=axis)
            for cached in (optimizer.make_optimizer, step_module._creator, step_module.make_train_step):
                cached.cache_clear()
            found[name] = measure(preset, {**settings, "train.optimizer": "muon"}, "fsdp", False, steps)
    finally:
        optimizer.split_among_devices = original
    return found


def equality(steps: int, codelab_batch: int) -> dict:
    import jax
    import numpy as np

    from bardflow.model.data.splits import Batches, encode
    from bardflow.model.training.loop import TrainingSetup, train
    from bardflow.model.training.placement import Placement
    from bardflow.model.training.step import init_state
    from bench.report import SHARED_CORPUS

    text = SHARED_CORPUS.read_bytes()
    devices = jax.devices()
    found = {}
    for preset in ("cpu", "codelab"):
        base = _config(preset, {})
        rows = encode(text, base.data.seq_len, 0.9, 0, base.data.every_position).train
        for optimizer in ("adamw", "muon"):
            histories = {}
            for sharding, remat in LAYOUTS:
                batch = {"train.per_device_batch": codelab_batch} if preset == "codelab" else {}
                cfg = _config(
                    preset,
                    {
                        **batch,
                        "train.steps": steps,
                        "train.single_device_steps": 0,
                        "train.warmup_steps": min(steps // 5, base.train.warmup_steps),
                        "train.log_every": 1,
                        "train.optimizer": optimizer,
                        "train.sharding": sharding,
                        "train.remat": remat,
                    },
                )
                graphdef, state = init_state(cfg.model, cfg.train)
                placement = Placement.data_parallel(devices, fsdp=sharding == "fsdp")
                started = time.perf_counter()
                result = train(
                    TrainingSetup(
                        graphdef,
                        state,
                        Batches(rows, cfg.train.per_device_batch * len(devices)),
                        [],
                        placement,
                        cfg.train,
                    )
                )
                histories[(sharding, remat)] = np.array([h["loss"] for h in result.history])
                print(
                    f"{preset} {optimizer} {sharding}{' remat' if remat else ''}: {steps} steps in "
                    f"{time.perf_counter() - started:.0f} s, last loss {histories[(sharding, remat)][-1]:.4f}",
                    flush=True,
                )
            reference = histories[("replicated", False)]
            for (sharding, remat), losses in histories.items():
                if sharding != "replicated":
                    found[f"{preset} {optimizer} {sharding}{' remat' if remat else ''}"] = float(
                        np.max(np.abs(losses - reference) / np.abs(reference))
                    )
    return {f"max_rel_loss_diff {k}": v for k, v in found.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.fsdp", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--preset", default="gpt2")
    parser.add_argument(
        "--set",
        dest="settings",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a setting of the preset, e.g. train.per_device_batch=8",
    )
    parser.add_argument("--steps", type=int, default=20, help="timed steps per layout (default 20)")
    parser.add_argument("--cpu-devices", type=int, default=0, help="emulated CPU devices (a CPU host)")
    parser.add_argument("--equality", action="store_true", help="losses of each layout against replicated")
    parser.add_argument("--muon", action="store_true", help="Muon under fsdp with and without its share-out")
    parser.add_argument(
        "--codelab-batch",
        type=int,
        default=32,
        help="--equality: the codelab shape's batch per "
        "device (default 32, the codelab's; a CPU takes minutes a run at 32)",
    )
    parser.add_argument("--out", type=Path, default=None, help="folder for the JSON report (default bench/results)")
    args = parser.parse_args(argv)
    if args.cpu_devices:
        os.environ["XLA_FLAGS"] = (
            os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={args.cpu_devices}"
        )
        os.environ["JAX_PLATFORMS"] = "cpu"
    from bench.report import RESULTS, machine, write_report

    settings = dict(item.split("=", 1) for item in args.settings)
    report: dict = {
        "machine": machine(),
        "preset": args.preset,
        "settings": settings,
        **({"codelab_batch": args.codelab_batch} if args.equality else {}),
    }
    flat: dict = {}
    if args.equality:
        flat.update(equality(50 if args.steps == 20 else args.steps, args.codelab_batch))
    elif args.muon:
        report["muon"] = muon_share_out(args.preset, settings, args.steps)
        for name, row in report["muon"].items():
            for key in ("ms_per_step", "tokens_per_s", "gflops_per_device_step", "xla_argument_plus_temp_mib"):
                flat[f"{name} {key}"] = row[key]
    else:
        import jax

        # One device: fsdp splits nothing, remat still saves.
        layouts = LAYOUTS if len(jax.devices()) > 1 else (("replicated", False), ("replicated", True))
        report["layouts"] = [measure(args.preset, settings, sharding, remat, args.steps) for sharding, remat in layouts]
        for row in report["layouts"]:
            name = f"{row['layout'] if row['devices'] > 1 else 'single'}{' remat' if row['remat'] else ''}"
            for key in (
                "tokens_per_s",
                "ms_per_step",
                "mfu",
                "state_mib",
                "xla_argument_plus_temp_mib",
                "estimate_mib",
                "estimate_vs_xla",
            ):
                flat[f"{name} {key}"] = row[key]
    kind = "equality" if args.equality else f"muon-{args.preset}" if args.muon else args.preset
    write_report(report, flat, args.out or RESULTS, f"fsdp-{kind}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
