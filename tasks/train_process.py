"""``train_parallel`` as N cooperating processes: the body each process runs, and the
local launcher that starts them on one host (several GPUs, or the tests).

    python -m tasks.train_process SPEC.json   # process 0: SPEC describes the run
    python -m tasks.train_process --follow    # any other process: process 0 sends it

Who is who comes from the environment (``model.distributed``). Every process trains
the same replicated model on its own rows of each global batch; Orbax saves and
restores checkpoints collectively (every process calls it, each writes what it holds);
only process 0 writes a file of its own (the result summary). The launcher stops all
processes as soon as one fails, and reports that one's log.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[1]
PROGRESS = "bardflow-progress"  # process 0's progress lines in its log: "bardflow-progress 40 200"
RESULT = "result.json"


def run_process(spec_path: Path | None, join_timeout_s: int) -> None:
    from model.distributed import DistributedError, ProcessGroup, broadcast_json, initialize

    group = ProcessGroup.from_env()
    if group is None:
        raise DistributedError("no process group: set BARDFLOW_COORDINATOR, BARDFLOW_NUM_PROCESSES and "
                               "BARDFLOW_PROCESS_ID (or start the processes with srun)")
    if group.leader and spec_path is None:
        raise DistributedError("process 0 describes the run: pass the spec file it was launched with")
    spec = json.loads(spec_path.read_text()) if group.leader else None
    initialize(group, timeout_s=join_timeout_s)
    spec = broadcast_json(spec)
    _train(spec, group.leader)


def _train(spec: dict[str, Any], leader: bool) -> None:
    import jax

    from model.checkpoint import TrainingCheckpoints, params_digest, save_train_state
    from model.data import Batches, read_sequences
    from model.train import Placement, TrainingError, init_state, model_from_state, train, val_batches
    from tasks.train import STATE, TrainingRequest, run_metrics

    request = TrainingRequest.model_validate(spec["request"])
    devices = jax.devices()
    if len(devices) != request.devices:
        raise TrainingError(f"the {jax.process_count()} processes have {len(devices)} devices in all but the run "
                            f"asked for {request.devices}; give each process the same share of the devices")
    placement = Placement.data_parallel(devices)
    global_batch = request.train.per_device_batch * len(devices)
    train_rows, _ = read_sequences(Path(spec["train_file"]))
    val_rows, _ = read_sequences(Path(spec["val_file"]))
    # Only this process's rows of every batch are read (memory-mapped) and placed.
    local_val = []
    for batch in val_batches(val_rows, global_batch, multiple=len(devices)):
        start, stop = placement.rows(len(batch))
        local_val.append(batch[start:stop])

    def report(done: int, total: int) -> None:
        if leader:
            print(f"{PROGRESS} {done} {total}", flush=True)

    rows = placement.rows(global_batch)
    print(f"process {jax.process_index()} of {jax.process_count()}: rows [{rows[0]}, {rows[1]}) of every "
          f"global batch of {global_batch}, on {jax.local_device_count()} local device(s)", flush=True)
    graphdef, state = init_state(request.model, request.train)
    checkpoints = TrainingCheckpoints(Path(spec["resume_dir"]), request.train.keep_checkpoints)
    try:
        result = train(graphdef, state, Batches(train_rows, global_batch, rows), local_val,
                       placement, request.train, on_step=report, checkpoints=checkpoints)
    finally:
        checkpoints.close()
    save_train_state(Path(spec["out_dir"]) / STATE, result.state)  # collective: every process calls it
    if leader:  # the flow process makes the version's other files and its manifest from this
        summary = {"metrics": run_metrics(result, request), "history": result.history,
                   "params_digest": params_digest(model_from_state(graphdef, result.state)),
                   "devices": [str(d) for d in devices]}
        Path(spec["result_file"]).write_text(json.dumps(summary))


class ProcessFailure(RuntimeError):
    pass


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _process_env(index: int, processes: int, port: int, devices_per_process: int, platform: str) -> dict[str, str]:
    from model.distributed import ProcessGroup

    env = {**os.environ, **ProcessGroup(processes, index, f"127.0.0.1:{port}").env(), "PYTHONUNBUFFERED": "1"}
    if platform == "cpu":
        flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", env.get("XLA_FLAGS", ""))
        env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={devices_per_process}".strip()
        env["JAX_PLATFORMS"] = "cpu"
    elif platform == "gpu":
        visible = env.get("CUDA_VISIBLE_DEVICES")
        ids = visible.split(",") if visible else [str(i) for i in range(devices_per_process * processes)]
        env["CUDA_VISIBLE_DEVICES"] = ",".join(ids[index * devices_per_process : (index + 1) * devices_per_process])
    return env


def _tail(path: Path, lines: int = 15) -> str:
    text = path.read_text(errors="replace") if path.exists() else ""
    kept = [line for line in text.splitlines() if not line.startswith(PROGRESS)]
    return "\n".join(kept[-lines:])


def _how(code: int) -> str:
    if code < 0:
        return f"was killed by signal {-code} ({signal.Signals(-code).name})"
    return f"exited with status {code}"


def launch_local(spec_path: Path, processes: int, devices_per_process: int, platform: str,
                 on_step: Callable[[int, int], None] | None = None) -> None:
    """Runs the spec as ``processes`` processes on this host, on 127.0.0.1, each with
    its share of the devices, and waits for all of them (see ``_supervise``)."""
    port = _free_port()
    envs = [_process_env(i, processes, port, devices_per_process, platform) for i in range(processes)]
    _supervise(spec_path, envs, on_step)


def launch_leader(spec_path: Path, on_step: Callable[[int, int], None] | None = None) -> None:
    """Runs process 0 of a group that a cluster scheduler started: the others are
    ``bardflow run`` on the other hosts, following it."""
    _supervise(spec_path, [{**os.environ, "PYTHONUNBUFFERED": "1"}], on_step)


def _supervise(spec_path: Path, envs: list[dict[str, str]], on_step, poll_s: float = 0.2) -> None:
    """Starts one process per environment (the first is process 0, which gets the spec)
    and waits for all. The first to fail stops the others (they would otherwise wait
    in a collective for its data) and raises ``ProcessFailure`` with its log's last
    lines. Logs: ``process-<i>.log`` beside the spec."""
    processes = int(envs[0].get("BARDFLOW_NUM_PROCESSES", len(envs)))
    logs = [spec_path.parent / f"process-{i}.log" for i in range(len(envs))]
    running = []
    for index, (env, log) in enumerate(zip(envs, logs)):
        command = [sys.executable, "-m", "tasks.train_process"] + ([str(spec_path)] if index == 0 else ["--follow"])
        with log.open("w") as sink:
            running.append(subprocess.Popen(command, cwd=REPO, stdout=sink, stderr=subprocess.STDOUT, env=env,
                                            start_new_session=True))
    seen = 0
    try:
        while True:
            codes = [p.poll() for p in running]
            if on_step is not None:
                seen = _follow_progress(logs[0], seen, on_step)
            failed = next((i for i, code in enumerate(codes) if code not in (None, 0)), None)
            if failed is not None:
                raise ProcessFailure(
                    f"process {failed} of {processes} {_how(codes[failed])}; the others were stopped. "
                    f"Last lines of {logs[failed]}:\n{_tail(logs[failed])}"
                )
            if all(code == 0 for code in codes):
                return
            time.sleep(poll_s)
    finally:
        _stop(running)


def _follow_progress(log: Path, seen: int, on_step: Callable[[int, int], None]) -> int:
    try:
        with log.open("rb") as source:
            source.seek(seen)
            chunk = source.read()
    except FileNotFoundError:
        return seen
    complete = chunk[: chunk.rfind(b"\n") + 1]
    for line in complete.decode(errors="replace").splitlines():
        if line.startswith(PROGRESS):
            done, total = map(int, line.split()[1:3])
            on_step(done, total)
    return seen + len(complete)


def _stop(running: list[subprocess.Popen], grace_s: float = 5.0) -> None:
    for process in running:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for process in running:
        try:
            process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tasks.train_process", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("spec", nargs="?", type=Path, help="the run's description (process 0 only)")
    parser.add_argument("--follow", action="store_true", help="take the description from process 0")
    parser.add_argument("--join-timeout", type=int, default=300, metavar="S",
                        help="seconds to wait for every process to join (default 300)")
    args = parser.parse_args(argv)
    try:
        run_process(None if args.follow else args.spec, args.join_timeout)
    except (RuntimeError, ValueError) as error:
        print(f"bardflow: error: {error}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
