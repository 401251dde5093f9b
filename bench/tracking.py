"""``python -m bench.tracking [--records N] [--server URL]``: what tracking costs a training
step. Training writes one record (loss, val_loss, val_bpb, tokens/s) every ``train.log_every``
steps, through the same hook as a run (``runtime/tracking.py``): this times that write for
each destination (MLflow on a local SQLite database, MLflow over HTTP when ``--server`` names
one, TensorBoard event files) and divides by each preset's ``log_every``. The record's
evaluation is the run's own cost, not tracking's, and is not timed here.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from bench.run import RESULTS, machine, write_report


def record_ms(target, records: int) -> list[float]:
    from bardflow.model.train import RunRecord, StepInfo
    from bardflow.runtime.tracking import history_hook

    hook, record, times = history_hook(target), RunRecord([]), []
    for n in range(records):
        record.history.append({"step": 10 * n, "loss": 2.0, "val_loss": 2.1, "val_bpb": 3.0, "tokens": 1000 * n,
                               "seconds": 0.1 * n})
        info = StepInfo(10 * n, 10 * records, None, None, 1000 * n, record)
        started = time.perf_counter()
        hook.run(info)
        times.append(1e3 * (time.perf_counter() - started))
    return times[1:]  # the first opens the destination


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.tracking", description=__doc__)
    parser.add_argument("--records", type=int, default=50, help="records written per destination (default 50)")
    parser.add_argument("--server", help="an MLflow server's URL to time as well (http://127.0.0.1:5000)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    from bardflow.model.config import PRESETS, TrackingTarget, build_config
    from bardflow.runtime.tracking import MlflowRun

    with tempfile.TemporaryDirectory() as tmp:
        destinations = {"mlflow_sqlite": f"sqlite:///{tmp}/mlflow.db"}
        if args.server:
            destinations["mlflow_http"] = args.server
        measured = {}
        for name, uri in destinations.items():
            run = MlflowRun.create(uri, "bench-tracking", name, {}, print)
            measured[name] = record_ms(TrackingTarget(stage="train_single", mlflow=uri, mlflow_run=run.run_id),
                                       args.records)
            run.end("FINISHED")
        measured["tensorboard"] = record_ms(TrackingTarget(stage="train_single", tensorboard=f"{tmp}/tb"),
                                            args.records)
    log_every = {preset: build_config(preset).train.log_every for preset in PRESETS}
    flat = {}
    for name, times in measured.items():
        median = statistics.median(times)
        flat[f"{name}_ms_per_record"] = round(median, 3)
        for preset, every in log_every.items():
            flat[f"{name}_ms_per_step_{preset}"] = round(median / every, 4)
    report = {"machine": machine(), "records": args.records, "log_every": log_every,
              "ms_per_record": {name: times for name, times in measured.items()}}
    write_report(report, flat, args.out, "tracking")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
