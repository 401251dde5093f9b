"""``bardflow``: the command line. A thin layer that builds typed parameters and
calls the flow; heavy imports (Prefect, JAX) wait until the environment is set."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from bardflow.flows.server import EmbeddedServer, check_chosen_server, start_embedded, use_running_server
from bardflow.flows.settings import (
    AUTO_CHOICES,
    DEBUG,
    PRESET_NAMES,
    debugging,
    empty_corpus,
    pick_preset,
    prepare_environment,
    store_location,
)
from bardflow.model.errors import BardflowError
from bardflow.runtime import stopping
from bardflow.tasks.registry import BY_NAME, NAMES

_embedded: EmbeddedServer | None = None  # this command's own Prefect server, when it needs one
STORE_HELP = "store: a folder or s3://bucket/prefix, gs://… (default: $BARDFLOW_STORE or ./store)"


def _pipeline_options(parser: argparse.ArgumentParser) -> None:
    """What `run` and `sweep` share."""
    parser.add_argument("--preset", choices=PRESET_NAMES, default="auto",
                        help="codelab (the codelab exactly), cpu (minutes on a laptop), quality (time to quality "
                             "on a GPU), tiny (seconds); auto picks codelab on a GPU, else cpu")
    parser.add_argument("--corpus", help="https URL, file:// URL or path of the corpus (default: $BARDFLOW_CORPUS "
                                         "or the public TinyShakespeare URL)")
    parser.add_argument("--store", help=STORE_HELP)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="settings",
                        help="override a setting, e.g. --set train.steps=100 (see `bardflow presets`)")
    parser.add_argument("--cpu-devices", type=int, metavar="N",
                        help="emulate N CPU devices so train_parallel shards on a machine without accelerators")
    parser.add_argument("--processes", type=int, default=1, metavar="N",
                        help="run train_parallel as N processes of this host sharing its devices (default 1). "
                             "On a cluster, start `bardflow run` once per host with BARDFLOW_COORDINATOR, "
                             "BARDFLOW_NUM_PROCESSES and BARDFLOW_PROCESS_ID set (or under srun): process 0 "
                             "runs the pipeline, the others join its train_parallel")
    parser.add_argument("--json", action="store_true", help="print the summary as one JSON object")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="bardflow",
        description="Train a byte-level transformer on TinyShakespeare as a Prefect flow of cached, versioned stages.",
    )
    parser.add_argument("--debug", action="store_true",
                        help=f"show the full traceback of explained errors too (or {DEBUG}=1)")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    run = commands.add_parser("run", help="run the pipeline (stages already in the store come back cached)",
                              description="Run the whole pipeline on Prefect's embedded server "
                                          "(or the server PREFECT_API_URL points at).")
    _pipeline_options(run)
    run.add_argument("--refresh", action="append", default=[], metavar="STAGE",
                     help=f"rerun this stage even if cached; repeatable; one of {', '.join(NAMES)}")
    run.add_argument("--join-timeout", type=int, default=3600, metavar="S",
                     help="cluster processes other than 0: seconds to wait for process 0 to reach "
                          "train_parallel (default 3600)")

    sweep = commands.add_parser(
        "sweep", help="run the pipeline once per configuration of a grid, and compare the runs",
        description="Run one pipeline per configuration (child flow runs of one parent flow, on one store, so "
                    "stages the configurations share are built once) and compare them in one table.")
    sweep.add_argument("--grid", action="append", default=[], metavar="KEY=V1,V2,…",
                       help="a setting and its values; several --grid make every combination")
    sweep.add_argument("--list", action="append", default=[], metavar="JSON", dest="listed",
                       help="one more configuration as a JSON object, e.g. '{\"train.steps\": 100}'; repeatable")
    sweep.add_argument("--max-runs", type=int, default=None, metavar="N",
                       help="refuse sweeps of more than N runs (default 32)")
    sweep.add_argument("--pool", metavar="NAME",
                       help="run each configuration as a run of the `bardflow-pipeline/sweep` deployment on this work pool, "
                            "all at once: every worker of the pool trains one (needs a running server)")
    _pipeline_options(sweep)

    runs = commands.add_parser("runs", help="list trained versions and how they differ (no server needed)",
                               description="List the trained versions in the store with the settings in which "
                                           "they differ; --diff A B compares two of them in full.")
    runs.add_argument("--store", help=STORE_HELP)
    runs.add_argument("--diff", nargs=2, metavar=("A", "B"), help="two version keys (or unique key prefixes)")
    runs.add_argument("--json", action="store_true", help="print JSON instead of a table")

    presets = commands.add_parser("presets", help="show each preset's full configuration",
                                  description="Print the configuration of each preset (or one) as JSON.")
    presets.add_argument("name", nargs="?", choices=PRESET_NAMES[1:])

    listing = commands.add_parser("artifacts", help="list the versions in the store (no server needed)",
                                  description="List the stage versions in the store, newest first.")
    listing.add_argument("stage", nargs="?", choices=NAMES)
    listing.add_argument("--store", help=STORE_HELP)
    listing.add_argument("--json", action="store_true", help="print JSON instead of a table")
    ui = commands.add_parser("ui", help="start the Prefect server and UI on 127.0.0.1 and print its URL",
                             description="Start `prefect server start` with bardflow's settings "
                                         "(bound to 127.0.0.1, no telemetry) in the foreground.")
    ui.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    ui.add_argument("--port", type=int, default=4200)
    server = commands.add_parser(
        "server", help="keep a Prefect server running in the background (127.0.0.1) for faster runs",
        description="start: a Prefect server in the background, bound to 127.0.0.1, which `run` and `sweep` "
                    "use while it runs (unless PREFECT_API_URL names another); stop: stop it; status: say "
                    "whether it runs (exit 3 if not).")
    server.add_argument("action", choices=("start", "stop", "status"))
    server.add_argument("--port", type=int, default=4200)
    return parser


def _ui(args: argparse.Namespace) -> None:
    prepare_environment()
    url = f"http://{args.host}:{args.port}"
    # The UI's browser code asks the server where its API is; tell it this port, not 4200.
    os.environ.setdefault("PREFECT_UI_API_URL", f"{url}/api")
    os.environ.setdefault("PREFECT_SERVER_API_HOST", args.host)
    os.environ.setdefault("PREFECT_SERVER_API_PORT", str(args.port))
    print(f"Prefect UI:  {url}\nArtifacts:   {url}/artifacts\n"
          f"Runs use it with: export PREFECT_API_URL={url}/api", flush=True)
    command = [sys.executable, "-m", "prefect", "server", "start", "--host", args.host, "--port", str(args.port)]
    os.execv(sys.executable, command)


class UsageError(BardflowError, ValueError):
    """The command line asks for something that does not exist."""


def headline(stage: str, metrics: dict[str, Any]) -> str:
    """The figures worth a glance in a summary row, one to a line; the manifest has them all
    (a checksum is shown by its first 12 digits, like a key)."""
    known = BY_NAME.get(stage)
    names = known.headline if known else list(metrics)[:4]
    return "\n".join(f"{name}={_glance(metrics[name])}" for name in names if name in metrics)


def _glance(value: Any) -> str:
    text = str(value)
    hexadecimal = len(text) >= 32 and all(c in "0123456789abcdef" for c in text)
    return text[:SHORT_KEY] + "…" if hexadecimal else text


def _prepare(args: argparse.Namespace) -> tuple[str, dict[str, Any]]:
    """What `run` and `sweep` check and set before anything heavy: the store's location and
    the --set overrides; the environment (devices, a background server) for Prefect and JAX."""
    if args.cpu_devices is not None and args.cpu_devices < 1:
        raise UsageError("--cpu-devices must be at least 1")
    if args.processes < 1:
        raise UsageError("--processes must be at least 1")
    if args.corpus is not None and not args.corpus.strip():
        raise UsageError(empty_corpus("--corpus"))
    root = store_location(args.store)
    prepare_environment(args.cpu_devices)
    use_running_server()
    check_chosen_server()
    if getattr(args, "pool", None) and not os.environ.get("PREFECT_API_URL"):
        raise UsageError(f"--pool {args.pool} needs a Prefect server that its workers share: start one "
                         "(`bardflow server start`) or set PREFECT_API_URL")
    global _embedded
    from bardflow.model.config import ConfigError, build_config, parse_assignment

    overrides = dict(parse_assignment(text) for text in args.settings)
    # A bad value is refused before JAX starts (picking `auto` asks JAX for a GPU): refused
    # here when no preset `auto` may become accepts it, checked again once it is chosen.
    candidates = AUTO_CHOICES if args.preset == "auto" else (args.preset,)
    errors, accepted = [], []
    for candidate in candidates:
        try:
            accepted.append(build_config(candidate, overrides))
        except ConfigError as error:
            errors.append(error)
    if not accepted:
        raise errors[0]
    if args.processes > 1:
        # Whether the devices share out evenly needs JAX's count of them: asked now, before
        # the run's server starts, so that the refusal comes first, like every other one.
        from bardflow.runtime.distributed import hardware
        from bardflow.tasks.stage import RunPlan

        RunPlan(accepted[0], *hardware(), args.processes).parallel_training()
    _embedded = start_embedded()  # comes up while Prefect and JAX load
    return root, overrides


def _terminal_run():
    """Prefect settings for a flow run in this terminal. No run heartbeats unless the user
    asks (PREFECT_FLOWS_HEARTBEAT_FREQUENCY): this process reports its own end, heartbeats
    only feed automations a user would have to create, and the heartbeat thread, which
    sleeps in whole seconds, holds up the end of every run by up to a second (a third of a
    fully cached run). Deployment runs on workers keep Prefect's default."""
    from contextlib import nullcontext

    from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings

    if _embedded is not None:
        _embedded.wait(float(os.environ["PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"]))
        _embedded.watch()
    elif os.environ.get("PREFECT_API_URL", "").startswith(("http://", "https://")):
        from bardflow.flows.server import watch_chosen

        watch_chosen(os.environ["PREFECT_API_URL"].rstrip("/"))
    if any(name in os.environ for name in ("PREFECT_FLOWS_HEARTBEAT_FREQUENCY", "PREFECT_RUNNER_HEARTBEAT_FREQUENCY")):
        return nullcontext()
    return temporary_settings(updates={PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None})


def _run(args: argparse.Namespace) -> dict[str, Any]:
    unknown = [s for s in args.refresh if s not in NAMES]
    if unknown:
        raise UsageError(f"unknown stage {unknown[0]!r} in --refresh; stages are {', '.join(NAMES)}")
    root, overrides = _prepare(args)
    from bardflow.artifacts.objects import checked_store
    from bardflow.model.config import build_config

    config = build_config(pick_preset(args.preset), overrides)  # refused here, before Prefect starts
    checked_store(root)  # so is a store that cannot be reached (the flow finds it checked)
    from bardflow.flows.pipeline import pipeline

    with _terminal_run():
        return pipeline(preset=args.preset, config=config, corpus=args.corpus, store=root, refresh=args.refresh,
                        processes=args.processes)


def _sweep(args: argparse.Namespace) -> dict[str, Any]:
    root, base = _prepare(args)
    from bardflow.artifacts.objects import checked_store
    from bardflow.model.config import MAX_SWEEP_RUNS, sweep_configurations

    preset = pick_preset(args.preset)
    configurations = sweep_configurations(preset, base, args.grid, args.listed, args.max_runs or MAX_SWEEP_RUNS)
    checked_store(root)
    from bardflow.flows.sweep import sweep

    with _terminal_run():
        return sweep(configurations=configurations, preset=preset, settings=base, corpus=args.corpus, store=root,
                     processes=args.processes, pool=args.pool)


def _print_sweep(result: dict[str, Any]) -> None:
    from rich.console import Console

    from bardflow.flows.tables import Column, fitted

    rows = result["rows"]
    where = f", work pool {result['pool']}" if result.get("pool") else ""
    # What tells the runs apart stays longest; versions and timings go first at a narrow width.
    ranks = {"run": 5, "status": 4, "val_loss": 4, "tokens_per_s": 2, "val_bpb": 1, "training_s": 1,
             "train_parallel": 0, "generate": 0}
    columns = [Column(name, ranks.get(name, 3)) for name in rows[0]]
    cells = []
    for row in rows:
        shown = [f"{v:.4f}" if isinstance(v, float) and k.startswith("val") else
                 f"{v:,.0f}" if isinstance(v, float) and k == "tokens_per_s" else
                 f"{v:.1f}" if isinstance(v, float) else "—" if v is None else
                 str(v)[:SHORT_KEY] if k in ("train_parallel", "generate") else str(v) for k, v in row.items()]
        if row["status"] != "completed":
            shown[list(row).index("status")] = f"[red]{row['status']}"
        cells.append(shown)
    title = f"bardflow sweep: {len(rows)} runs, preset {result['preset']}{where}, store {result['store']}"
    Console().print(fitted(title, columns, cells))
    for number, run in enumerate(result["runs"], 1):
        if run.get("error"):
            print(f"run {number} failed: {run['error']}", file=sys.stderr)


def _follow(group, join_timeout: int, cpu_devices: int | None) -> None:
    """A cluster process other than 0: no flow of its own; it joins process 0's
    train_parallel, which tells it what to train, and ends with it."""
    import subprocess

    prepare_environment(cpu_devices)
    print(f"bardflow: process {group.process_id} of {group.num_processes}: joining the train_parallel run of "
          f"process 0 at {group.coordinator or 'the coordinator the cluster names'}", file=sys.stderr, flush=True)
    from bardflow.runtime.launch import process_command
    from bardflow.tasks import train_process

    code = subprocess.call(process_command(train_process, None, join_timeout))
    if code:
        raise FollowerError(f"process {group.process_id} of {group.num_processes} failed (exit status {code}); "
                            "see its output above")


class FollowerError(BardflowError, RuntimeError):
    """A cluster process other than 0 failed; its own output says why."""


def _cluster_follower():
    """This process's group when it is a cluster process other than process 0."""
    from bardflow.runtime.distributed import ProcessGroup

    group = ProcessGroup.from_env()
    return group if group is not None and not group.leader else None


def _print_summary(summary: dict[str, Any]) -> None:
    """The stages (readable at 80 columns: short keys, one figure a line) and the samples."""
    from rich.console import Console
    from rich.markup import escape

    from bardflow.flows.tables import Column, fitted

    columns = [Column("stage", 3), Column("state", 1), Column("version", 2), Column("key figures", 0, text=True)]
    rows = [[name, f"[{'green' if stage['state'] == 'ran' else 'cyan'}]{stage['state']}", stage["key"][:SHORT_KEY],
             headline(name, stage["metrics"])] for name, stage in summary["stages"].items()]
    console = Console()
    console.print(fitted(f"bardflow run: preset {summary['preset']}, store {summary['store']}", columns, rows))
    console.print(f"Versions live under {summary['store']}/<stage>/<key>/ (full keys: --json or `bardflow artifacts`)")
    for sample in summary.get("samples", []):
        prompt, text = sample["prompt"], sample["text"]
        rest = text[len(prompt):] if text.startswith(prompt) else text
        console.print(f"\n[dim]sample, temperature {sample['temperature']}, seed {sample['seed']}:[/dim]")
        console.print(f"[bold yellow]{escape(prompt)}[/bold yellow]{escape(rest)}", highlight=False)


SHORT_KEY = 12  # enough to tell versions apart; `bardflow runs --diff` takes prefixes


def _artifacts(args: argparse.Namespace) -> None:
    from bardflow.flows.runs import readable_store

    versions = readable_store(store_location(args.store)).versions(args.stage)
    rows = []
    for v in versions:
        size = sum(f["bytes"] for f in v.manifest.get("files", {}).values())
        rows.append({"stage": v.stage, "key": v.key, "created": v.manifest.get("created"),
                     "bytes": size, "metrics": v.metrics, "path": v.location})
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    from rich.console import Console

    from bardflow.flows.tables import Column, fitted, short_time

    columns = [Column("stage", 4), Column("key", 3), Column("created", 1), Column("size", 0),
               Column("key figures", 2, text=True)]
    cells = [[row["stage"], row["key"], short_time(row["created"]), f"{row['bytes'] / 1e6:.2f} MB",
              headline(row["stage"], row["metrics"])] for row in rows]
    Console().print(fitted(f"versions in {store_location(args.store)}", columns, cells))


def _show(result: dict[str, Any], as_json: bool, table) -> None:
    if as_json:
        print(json.dumps(result, indent=1))
    else:
        table(result)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.debug:
        os.environ[DEBUG] = "1"  # the flow's log shows explained errors' tracebacks too
    if args.command in ("run", "sweep"):
        stopping.install()  # Ctrl-C and SIGTERM stop the run in order (runtime/stopping.py)
    try:
        if args.command == "presets":
            from bardflow.model.config import PRESETS as CONFIGS
            from bardflow.model.config import build_config

            names = [args.name] if args.name else list(CONFIGS)
            print(json.dumps({n: build_config(n).model_dump(mode="json") for n in names}, indent=2))
        elif args.command == "artifacts":
            _artifacts(args)
        elif args.command == "runs":
            from bardflow.flows.runs import show_runs

            show_runs(store_location(args.store), args.diff, args.json)
        elif args.command == "sweep":
            result = _sweep(args)
            _show(result, args.json, _print_sweep)
            if all(run["status"] != "completed" for run in result["runs"]):
                return 1
        elif args.command == "ui":
            _ui(args)
        elif args.command == "server":
            from bardflow.flows.server import command

            command(args.action, args.port)
        elif args.command == "run" and (follower := _cluster_follower()) is not None:
            _follow(follower, args.join_timeout, args.cpu_devices)  # process 0 reports the run
        elif args.command == "run":
            _show(_run(args), args.json, _print_summary)
        return 0
    except stopping.Stopped as stop:
        if stopping.failure():
            print(f"bardflow: error: {stopping.failure()}", file=sys.stderr)
            return 1
        print(f"bardflow: {stop}", file=sys.stderr)
        return stop.exit_code
    except BardflowError as error:
        if debugging():
            import traceback

            traceback.print_exc()
        _settle_reports()
        print(f"bardflow: error: {error}", file=sys.stderr)
        return 2 if isinstance(error, UsageError) else 1
    except Exception:
        signum = stopping.requested()
        if signum is None or debugging():
            raise
        if stopping.failure():
            print(f"bardflow: error: {stopping.failure()}", file=sys.stderr)
            return 1
        # What a stop breaks on its way out (a client call cut short) is not news.
        print(f"bardflow: stopped by {stopping.name(signum)} {stopping.where()}; rerun the same command to go on",
              file=sys.stderr)
        return 128 + signum


def _settle_reports(timeout_s: float = 5.0) -> None:
    """Sends what Prefect still holds for the server (the failed run's events and logs)
    before the error line, so that its own drain messages ("Still processing items") come
    before that line rather than after it."""
    if "prefect" not in sys.modules or stopping.failure():
        return
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    for worker in (APILogWorker, EventsWorker):
        try:
            worker.drain_all(timeout=timeout_s)
        except Exception:  # noqa: BLE001 - reports are a courtesy here: the error line matters
            pass


def entry() -> None:
    """The `bardflow` command. It exits as the interpreter does — non-daemon threads joined,
    exit handlers run (Prefect's logs and events sent, its temporary server stopped) — but
    without the teardown of every module afterwards (JAX's and Prefect's take about half a
    second, a sixth of a fully cached run): the exit handler registered first runs last."""
    import atexit
    import logging

    code = [1]

    def end_here() -> None:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code[0])

    atexit.register(end_here)
    try:
        code[0] = main()
    except SystemExit as stop:  # argparse's --help and usage errors
        if isinstance(stop.code, str):
            print(stop.code, file=sys.stderr)
        code[0] = stop.code if isinstance(stop.code, int) else int(stop.code is not None)
    sys.exit(code[0])


if __name__ == "__main__":
    entry()
