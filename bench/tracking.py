"""``python -m bench.tracking [--records N] [--server URL]``: what tracking costs a training
step. Training writes one record (loss, val_loss, val_bpb, tokens/s) every ``train.log_every``
steps, through the same hook as a run (``model/training/trackers.py``): this times that write for
each destination (MLflow on a local SQLite database, MLflow over HTTP when ``--server`` names
one, TensorBoard event files) and divides by each preset's ``log_every``; then it runs the
``cpu`` preset's training loop (the production step and ``run_steps``) with and without the
tracking hook, in alternating rounds, for ms/step both ways. A record's evaluation is the
run's own cost, not tracking's: the loop appends records without evaluating.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from bench.report import RESULTS, machine, write_report


def record_ms(target, records: int) -> list[float]:
    import numpy as np

    from bardflow.model.training.hooks import CallLosses, RunRecord, StepInfo
    from bardflow.model.training.trackers import history_hook

    hook, record, times = history_hook(target), RunRecord([]), []
    for n in range(records):
        record.history.append(
            {"step": 10 * n, "loss": 2.0, "val_loss": 2.1, "val_bpb": 3.0, "tokens": 1000 * n, "seconds": 0.1 * n}
        )
        info = StepInfo(10 * n, 10 * records, CallLosses(np.full(1, 2.0)), 0, None, 1000 * n, record)
        started = time.perf_counter()
        hook.run(info)
        times.append(1e3 * (time.perf_counter() - started))
    return times[1:]  # the first opens the destination


def loop_ms_per_step(target, steps: int, rounds: int) -> dict:
    """ms/step of the ``cpu`` preset's loop without and with the tracking hook."""
    import jax
    import numpy as np

    from bardflow.config.settings import build_config
    from bardflow.model.training.hooks import Hook, RunRecord, every
    from bardflow.model.training.loop import StepCalls, run_steps
    from bardflow.model.training.step import init_state, make_train_step
    from bardflow.model.training.step_settings import resolve
    from bardflow.model.training.trackers import history_hook
    from bench.report import alternating

    cfg = build_config("cpu")
    batch, seq_len, log_every = cfg.train.per_device_batch, cfg.data.seq_len, cfg.train.log_every
    stream = np.random.default_rng(0).integers(0, 256, (16, batch, seq_len), dtype=np.int32)
    step = resolve(cfg.model, cfg.train, seq_len, jax.default_backend())
    graphdef, state = init_state(step.model(cfg.model), cfg.train)
    compiled = (
        make_train_step(graphdef, dtype=jax.numpy.dtype(step.precision), passes=step.passes(batch))
        .lower(state, stream[0])
        .compile(compiler_options=step.xla_options)
    )
    box = {"state": state}

    def records(info) -> None:
        info.record.history.append(
            {
                "step": info.step,
                "loss": float(info.loss),
                "val_loss": 2.0,
                "val_bpb": 2.9,
                "tokens": info.tokens,
                "seconds": info.record.trained_s(),
            }
        )

    def timed(tracked: bool):
        def run() -> float:
            hooks = [Hook(records, every(log_every, and_last=True))] + ([history_hook(target)] if tracked else [])
            record = RunRecord([])
            started = record.started = time.perf_counter()
            box["state"] = run_steps(
                StepCalls(compiled),
                box["state"],
                lambda s: stream[s % len(stream)],
                lambda steps: np.stack([stream[s % len(stream)] for s in steps]),
                range(steps),
                batch * (seq_len - 1),
                hooks,
                record,
            )
            jax.block_until_ready(box["state"])
            return 1e3 * (time.perf_counter() - started) / steps

        return run

    without, with_tracker = alternating([timed(False), timed(True)], rounds)
    return {
        "steps": steps,
        "rounds": rounds,
        "log_every": log_every,
        "without_ms_per_step": without,
        "with_ms_per_step": with_tracker,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.tracking", description=__doc__)
    parser.add_argument("--records", type=int, default=50, help="records written per destination (default 50)")
    parser.add_argument("--server", help="an MLflow server's URL to time as well (http://127.0.0.1:5000)")
    parser.add_argument("--loop-steps", type=int, default=190, help="steps per timed loop, cpu preset (default 190)")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds without and with (default 3)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    from bardflow.config.settings import PRESETS, TrackingTarget, build_config
    from bardflow.model.training.trackers import MlflowRun

    with tempfile.TemporaryDirectory() as tmp:
        destinations = {"mlflow_sqlite": f"sqlite:///{tmp}/mlflow.db"}
        if args.server:
            destinations["mlflow_http"] = args.server
        measured = {}
        for name, uri in destinations.items():
            run = MlflowRun.create(uri, "bench-tracking", name, {}, print)
            measured[name] = record_ms(
                TrackingTarget(stage="train_single", mlflow=uri, mlflow_run=run.run_id), args.records
            )
            run.end("FINISHED")
        measured["tensorboard"] = record_ms(TrackingTarget(stage="train_single", tensorboard=f"{tmp}/tb"), args.records)
        loop_uri = destinations.get("mlflow_http", destinations["mlflow_sqlite"])
        run = MlflowRun.create(loop_uri, "bench-tracking", "loop", {}, print)
        loop = loop_ms_per_step(
            TrackingTarget(stage="train_single", mlflow=loop_uri, mlflow_run=run.run_id, tensorboard=f"{tmp}/tb-loop"),
            args.loop_steps,
            args.rounds,
        )
        loop["destinations"] = [loop_uri.split(":")[0], "tensorboard"]
    log_every = {preset: build_config(preset).train.log_every for preset in PRESETS}
    flat = {}
    for name, times in measured.items():
        median = statistics.median(times)
        flat[f"{name}_ms_per_record"] = round(median, 3)
        for preset, every in log_every.items():
            flat[f"{name}_ms_per_step_{preset}"] = round(median / every, 4)
    flat["cpu_loop_ms_per_step_without"] = round(statistics.median(loop["without_ms_per_step"]), 2)
    flat["cpu_loop_ms_per_step_with"] = round(statistics.median(loop["with_ms_per_step"]), 2)
    report = {
        "machine": machine(),
        "records": args.records,
        "log_every": log_every,
        "ms_per_record": {name: times for name, times in measured.items()},
        "cpu_loop": loop,
    }
    write_report(report, flat, args.out, "tracking")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
