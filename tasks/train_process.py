"""One process of a multi-process ``train_parallel``, or the one supervised process that
trains on a CPU host's emulated devices (a native abort in it is then the stage's one-line
failure, not the end of the run):

    python -m bardflow.tasks.train_process SPEC.json   # process 0 (or the only one): SPEC describes the run
    python -m bardflow.tasks.train_process --follow    # any other process: process 0 sends it

Process 0 runs beside the stage that launched it and finds every file where the spec says.
The data comes through the store: on a local store at the spec's paths (every host sees that
folder); on an object store each process, process 0 too, reads it through its own mirror
(``BARDFLOW_WORKDIR``), which fetches a split's shard when a row of it is first read, so
hosts share no filesystem and a worker holds only the shards it reads. No Prefect is
imported here.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from ..artifacts.objects import RemoteResumeFolder, is_remote, open_store
from ..artifacts.resume import ResumeFolder
from ..errors import BardflowError, StoreError
from .registry import ENCODE

if TYPE_CHECKING:
    from ..model.training.training_run import RunFiles

TRAIN, VAL = ENCODE.builds


def files_of(spec: dict, leader: bool) -> RunFiles:
    """Where this process finds the run's files (see the module doc)."""
    from ..model.training.training_run import RunFiles  # JAX only now: the group joins first

    local = {name: Path(spec[name]) for name in ("train", "val", "resume", "state")}
    saved = RemoteResumeFolder(local["resume"], spec["resume_url"]).push if spec.get("resume_url") else None
    if not is_remote(spec.get("store", "")):
        return RunFiles(local["train"], local["val"], local["resume"], local["state"], saved=saved)
    # Every process, process 0 too, reads the splits through its mirror, which fetches a
    # shard when a row of it is first read.
    encode = open_store(spec["store"]).lookup(ENCODE.name, spec["encode"])
    if encode is None:
        raise StoreError(
            f"the encode version {spec['encode']} is missing or damaged in {spec['store']}; rerun with --refresh encode"
        )
    return RunFiles(
        train=encode.file(TRAIN),
        val=encode.file(VAL),
        resume=local["resume"],
        state=local["state"],
        saved=saved if leader else None,
        shards=encode.manifest.get("shards"),
        bring=encode.bring,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog=f"python -m {__spec__.name}", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("spec", nargs="?", type=Path, help="the run's description (process 0 only)")
    parser.add_argument("--follow", action="store_true", help="take the description from process 0")
    parser.add_argument(
        "--join-timeout",
        type=int,
        default=300,
        metavar="S",
        help="seconds to wait for every process to join (default 300)",
    )
    args = parser.parse_args(argv)
    from ..model.training.multiprocess import run_process
    from ..processes import stopping
    from ..processes.launch import follow_launcher

    stopping.install()  # SIGTERM from the launcher: stop at a step all processes agree on, checkpointed
    stopping.at("in a train_parallel process")
    follow_launcher()  # and the same stop should the launcher die without a word (kill -9 of its run)
    try:
        # Process 0 writes the checkpoints: the resume folder's one writer for as long as it runs.
        writer = (
            ResumeFolder(Path(json.loads(args.spec.read_text())["resume"])).writing(wait_s=10.0)
            if args.spec is not None
            else contextlib.nullcontext()
        )
        with writer:
            run_process(None if args.follow else args.spec, args.join_timeout, files_of)
    except stopping.Stopped as stop:
        why = stopping.failure()  # not a signal: the launcher gone (follow_launcher)
        print(f"bardflow: {why + ': ' if why else ''}{stop}", file=sys.stderr, flush=True)
        return stop.exit_code
    except BardflowError as error:
        print(f"bardflow: error: {error}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
