"""One process of a multi-process ``train_parallel``:

    python -m model.multiprocess SPEC.json   # process 0: SPEC describes the run
    python -m model.multiprocess --follow    # any other process: process 0 sends it

Who is who comes from the environment (``model.distributed``). Every process trains the
same replicated model on its own rows of each global batch (``model.trainer``); Orbax
saves and restores checkpoints collectively; only process 0 writes a file of its own (the
run's summary, from which the stage writes the version).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from model.config import TrainingRequest
from model.distributed import DistributedError, ProcessGroup, broadcast_json, initialize
from model.errors import BardflowError
from model.launch import PROGRESS


def run_process(spec_path: Path | None, join_timeout_s: int) -> None:
    group = ProcessGroup.from_env()
    if group is None:
        raise DistributedError("no process group: set BARDFLOW_COORDINATOR, BARDFLOW_NUM_PROCESSES and "
                               "BARDFLOW_PROCESS_ID (or start the processes with srun)")
    if group.leader and spec_path is None:
        raise DistributedError("process 0 describes the run: pass the spec file it was launched with")
    spec = json.loads(spec_path.read_text()) if group.leader else None
    initialize(group, timeout_s=join_timeout_s)
    spec = broadcast_json(spec)

    import jax

    from model.train import TrainingError
    from model.trainer import RunFiles, run_training

    request = TrainingRequest.model_validate(spec["request"])
    devices = jax.devices()
    if len(devices) != request.devices:
        raise TrainingError(f"the {jax.process_count()} processes have {len(devices)} devices in all but the run "
                            f"asked for {request.devices}; give each process the same share of the devices")

    def report(done: int, total: int) -> None:
        if group.leader:
            print(f"{PROGRESS} {done} {total}", flush=True)

    files = RunFiles(**{name: Path(spec[name]) for name in ("train", "val", "resume", "state")})
    summary = run_training(request, files, devices, parallel=True, on_step=report)
    if group.leader:  # the stage makes the version's other files and its manifest from this
        Path(spec["result"]).write_text(json.dumps(summary))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m model.multiprocess", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("spec", nargs="?", type=Path, help="the run's description (process 0 only)")
    parser.add_argument("--follow", action="store_true", help="take the description from process 0")
    parser.add_argument("--join-timeout", type=int, default=300, metavar="S",
                        help="seconds to wait for every process to join (default 300)")
    args = parser.parse_args(argv)
    try:
        run_process(None if args.follow else args.spec, args.join_timeout)
    except BardflowError as error:
        print(f"bardflow: error: {error}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
