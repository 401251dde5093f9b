"""``bardflow``: the command line. It checks the words, finds or starts the Prefect server and
runs the flows (``flows/``) for ``run``, ``sweep`` and ``serve``'s stages; the commands that
read what runs left (``artifacts``, ``runs``, ``serve KEY``) open the store themselves. Heavy
imports (Prefect, JAX) wait until the environment is set."""

from __future__ import annotations

import argparse
import json
import os
import sys
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

from ..config import config_file
from ..config.line_width import fit
from ..config.machine import install_hint
from ..config.settings import ConfigError, Overrides, PipelineConfig
from ..errors import BardflowError
from ..flows import cluster, preflight
from ..flows.environment import (
    DEBUG,
    STORE_CREDENTIALS,
    check_resource_limits,
    debugging,
    empty_corpus,
    prepare_environment,
    store_location,
)
from ..flows.records import SweepResult
from ..flows.run_config import candidate_configs, command_line_overrides, pick_preset
from ..flows.tracking import check_installed
from ..prefect_server.embedded import start_embedded
from ..prefect_server.process import (
    SERVER_MODE,
    PrefectServer,
    ServerError,
    check_chosen_server,
    chosen_server,
    full_database,
    refuse_full_database,
    silence_prefect,
    start_kept,
)
from ..prefect_server.status import server_status
from ..processes import stopping
from ..processes.distributed import MAX_CPU_DEVICES, requested_cpu_devices
from ..tasks.registry import NAMES
from . import printing
from .arguments import UsageError, parser, preset_name
from .ending import out_of_resources, settle_reports, writers_stuck
from .serve_command import compiling, requested_api_key, served_model

if TYPE_CHECKING:
    from ..flows.pipeline import Preset
    from ..flows.records import RunSummary


def _ui(args: argparse.Namespace) -> int:
    """The Prefect UI's address, at once: the server the user chose (PREFECT_API_URL), the kept
    server, or the kept server started now (its own process, its banner in its log, the user's
    Prefect profile untouched). Another address than 127.0.0.1 serves in the foreground."""
    from ..prefect_server import process

    prepare_environment()
    if args.host != "127.0.0.1":
        return _ui_in_foreground(args.host, args.port or process.DEFAULT_PORT)
    asked = f"http://127.0.0.1:{args.port}"
    if args.port is not None and process.healthy(asked):  # a Prefect server there already: say so
        print(f"Prefect UI:  {asked} (a server already there)\nArtifacts:   {asked}/artifacts", flush=True)
        return 0
    server = process.chosen_server()
    if server is None:
        server = process.start_kept(port=args.port)  # says at once where, when it starts one
        if server.starting is not None:
            process.wait_until_up(server.starting)
        record = process.running()
        whose = "the kept server" + (f": {server_status(record)}" if record else "")
    else:
        whose = "PREFECT_API_URL's server" if server.kind == "chosen" else "the kept server"
    print(f"Prefect UI:  {server.ui_url} ({whose})\nArtifacts:   {server.ui_url}/artifacts", flush=True)
    return 0


def _ui_in_foreground(host: str, port: int) -> int:
    """``--host`` other than this machine's loopback: Prefect's server in the foreground, bound
    where asked, until Ctrl-C."""
    url = f"http://{host}:{port}"
    # The UI's browser code asks the server where its API is; tell it this port, not 4200.
    os.environ.setdefault("PREFECT_UI_API_URL", f"{url}/api")
    os.environ.setdefault("PREFECT_UI_URL", url)  # the links in notifications (prefect_server/notify.py)
    os.environ.setdefault("PREFECT_SERVER_API_HOST", host)
    os.environ.setdefault("PREFECT_SERVER_API_PORT", str(port))
    print(
        f"Prefect UI:  {url} (reachable from other machines: bound to {host}; Ctrl-C stops it)\n"
        f"Artifacts:   {url}/artifacts\nRuns use it with: export PREFECT_API_URL={url}/api",
        flush=True,
    )
    command = [sys.executable, "-m", "prefect", "server", "start", "--host", host, "--port", str(port)]
    os.execv(sys.executable, command)


@dataclass(frozen=True)
class Prepared:
    """What ``_prepare`` checked: the store, the overrides, and the configuration of each preset
    the run may become (``auto``'s candidates), resolved once, or why it is refused."""

    root: str
    overrides: Overrides
    configs: dict[str, PipelineConfig | ConfigError]
    server: PrefectServer | None  # None: not started yet (``start_server=False``)

    def config_for(self, preset: str) -> PipelineConfig:
        found = self.configs[preset]
        if isinstance(found, ConfigError):
            raise found
        return found


def _prepare(args: argparse.Namespace, start_server: bool = True) -> Prepared:
    """What `run` and `sweep` check and set before anything heavy: the store's location and
    the --set overrides; the environment (devices, a background server) for Prefect and JAX.
    Then the run's own server starts, unless the caller has more to check first (every
    refusal comes before that server's start-up line)."""
    if args.cpu_devices is not None and not 1 <= args.cpu_devices <= MAX_CPU_DEVICES:
        raise UsageError(
            f"--cpu-devices must be 1 to {MAX_CPU_DEVICES} (emulated devices share this machine's cores; "
            f"{os.cpu_count()} here)"
        )
    if args.processes < 1:
        raise UsageError("--processes must be at least 1")
    if args.corpus is not None and not args.corpus.strip():
        raise UsageError(empty_corpus("--corpus"))
    root = store_location(args.store)
    check_resource_limits()
    prepare_environment(args.cpu_devices)
    if (requested_cpu_devices(os.environ["XLA_FLAGS"]) or 0) > MAX_CPU_DEVICES:
        raise UsageError(f"XLA_FLAGS asks for more than {MAX_CPU_DEVICES} emulated CPU devices; ask for fewer")
    server = _server_there(args)
    if server is not None:
        # A chosen server answers at once: JAX's device count comes from a process of its own
        # while Prefect loads here. (The run's own server takes seconds to start; JAX loads
        # here while this process waits for it: _terminal_run.)
        preflight.count_devices_meanwhile()
    check_chosen_server(server)
    refuse_full_database(server)
    if getattr(args, "pool", None) and server is None:
        raise UsageError(
            f"--pool {args.pool} needs a Prefect server that its workers share: start one "
            "(`bardflow server start`) or set PREFECT_API_URL"
        )
    args.preset, overrides = command_line_overrides(args.preset, args.config, args.settings, args.track)
    configs = candidate_configs(args.preset, overrides, args.corpus)
    accepted = [found for found in configs.values() if isinstance(found, PipelineConfig)]
    check_installed(accepted[0].track)  # --track mlflow without MLflow: refused now, not mid-run
    preflight.refuse_uneven_processes(accepted[0], args.processes)
    preflight.refuse_unreadable_corpus(accepted[0])
    if start_server:
        server = server or _start(args)  # comes up while Prefect and JAX load
    return Prepared(root, overrides, configs, server)


def _server_there(args: argparse.Namespace) -> PrefectServer | None:
    """The server already there that the run reports to: none where the command line asks for
    one of its own (``--server embedded`` wins over PREFECT_API_URL, which it says, and over a
    kept server); BARDFLOW_SERVER=embedded, a standing default, starts one only where no
    server is there."""
    if args.server == "embedded":
        if os.environ.get("PREFECT_API_URL"):
            print(
                fit(
                    f"bardflow: --server embedded: this run reports to a server of its own, not to "
                    f"PREFECT_API_URL ({os.environ['PREFECT_API_URL']})"
                ),
                file=sys.stderr,
            )
        return None
    return chosen_server()


def _start(args: argparse.Namespace) -> PrefectServer:
    """The server a run starts when none is there: the kept one, or (``--server embedded``) its own."""
    mode = args.server or os.environ.get(SERVER_MODE) or "kept"
    if mode not in ("kept", "embedded"):
        raise UsageError(f"{SERVER_MODE}={mode!r}: give kept or embedded")
    return start_embedded() if mode == "embedded" else start_kept()


@contextmanager
def _terminal_run(verbose: bool, server: PrefectServer):
    """Prefect settings for a flow run in this terminal, its log lines there (each stage's end,
    progress, warnings; every line with ``verbose``), and a watch over its server for as
    long as it runs. No run heartbeats unless the user asks (PREFECT_FLOWS_HEARTBEAT_FREQUENCY):
    this process reports its own end, heartbeats only feed automations a user would have to
    create, and the heartbeat thread, which sleeps in whole seconds, holds up the end of
    every run by up to a second (a third of a fully cached run). Deployment runs on workers
    keep Prefect's default."""
    from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings

    from ..flows.terminal import ExplainedErrorFilter, quiet_explained_errors

    ExplainedErrorFilter.quiet = not verbose
    quiet_explained_errors()  # before the flow starts: Prefect's first lines are already the log's alone
    watch = None
    if server.embedded is not None:
        preflight.load_training()  # while the server starts
        server.embedded.wait(float(os.environ["PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"]))
        server.embedded.watch()
    elif server.api_url.startswith(("http://", "https://")):
        from ..prefect_server.process import wait_until_up, watch_chosen

        if server.starting is not None:  # the kept server this run started
            preflight.load_training()  # while it starts
            wait_until_up(server.starting, float(os.environ["PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"]))
        watch = watch_chosen(server.api_url, rerun_starts_one=server.by_a_run)
    asked = any(
        name in os.environ for name in ("PREFECT_FLOWS_HEARTBEAT_FREQUENCY", "PREFECT_RUNNER_HEARTBEAT_FREQUENCY")
    )
    try:
        with nullcontext() if asked else temporary_settings(updates={PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}):
            yield
    except Exception as error:
        line = full_database(error, server)
        if line is None:
            raise
        silence_prefect()
        raise ServerError(line) from error
    finally:
        if watch is not None:
            watch.set()


def _run(args: argparse.Namespace) -> tuple[PrefectServer, RunSummary]:
    unknown = [s for s in args.refresh if s not in NAMES]
    if unknown:
        raise UsageError(f"unknown stage {unknown[0]!r} in --refresh; stages are {', '.join(NAMES)}")
    prepared = _prepare(args)
    root = prepared.root
    from ..artifacts.objects import checked_store

    config = prepared.config_for(pick_preset(args.preset))  # refused here, before Prefect starts
    if not os.environ.get(STORE_CREDENTIALS):  # keys from a block: checked by the flow, which has the server
        checked_store(root)  # so is a store that cannot be reached (the flow finds it checked)
    from ..flows.pipeline import pipeline

    server = prepared.server or _start(args)
    with _terminal_run(args.verbose, server):
        return server, pipeline(
            preset=args.preset,
            config=config,
            corpus=args.corpus,
            store=root,
            refresh=args.refresh,
            processes=args.processes,
        )


def _sweep(args: argparse.Namespace) -> SweepResult:
    from ..flows.sweep_configs import MAX_SWEEP_RUNS, plan, split_ranges

    args.settings, ranges = split_ranges(args.settings)
    if ranges and args.search is None:
        key, raw = next(iter(ranges.items()))
        raise UsageError(f"--set {key}={raw} is a range: search it with --search N, or give one value")
    if args.search is not None:
        from importlib.util import find_spec

        if find_spec("optuna") is None:  # refused before a run is recorded, not by the failed sweep
            raise UsageError(f"--search needs Optuna: {install_hint('search')}")
    if args.search is not None and not 1 <= args.search <= (args.max_runs or MAX_SWEEP_RUNS):
        raise UsageError(
            f"--search takes 1 to {args.max_runs or MAX_SWEEP_RUNS} trials (raise the limit with --max-runs)"
        )
    if args.parallel < 1 or (args.parallel > 1 and not args.pool):
        raise UsageError(
            "--parallel K runs K trials at once on a work pool's workers: add --pool NAME "
            "(here, trials run one at a time)"
        )
    prepared = _prepare(args, start_server=False)
    root, base = prepared.root, prepared.overrides
    from ..artifacts.objects import checked_store

    preset = pick_preset(args.preset)
    planned = plan(
        preset,
        base,
        args.grid,
        args.listed,
        ranges,
        args.search,
        args.parallel,
        args.seed,
        args.max_runs or MAX_SWEEP_RUNS,
    )
    if not os.environ.get(STORE_CREDENTIALS):
        checked_store(root)
    server = prepared.server or _start(args)
    from ..flows.sweep import sweep

    with _terminal_run(args.verbose, server):
        return sweep(
            configurations=planned.configurations,
            preset=cast("Preset", preset),
            settings=base,
            corpus=args.corpus,
            store=root,
            processes=args.processes,
            pool=args.pool,
            search=planned.search,
        )


def _presets(args: argparse.Namespace) -> int:
    from ..config.settings import PRESETS, build_config

    if args.yaml:
        if not args.name:
            raise UsageError("presets --yaml prints one preset: name it, e.g. bardflow presets --yaml cpu")
        print(config_file.as_yaml(args.name), end="")
        return 0
    names = [args.name] if args.name else list(PRESETS)
    if args.json:
        shown = {n: build_config(n).model_dump(mode="json") for n in names}
        if args.name:  # and what one device would hold, before a run finds out
            shown["memory_per_device"] = preflight.memory_table(build_config(args.name))
        print(json.dumps(shown, indent=2))
        return 0
    configs = {n: build_config(n) for n in names}
    printing.print_presets(configs, preflight.memory_table(configs[args.name]) if args.name else None)
    return 0


def _artifacts(args: argparse.Namespace) -> int:
    from .runs import corpus_of, manifests_of, readable_store

    store = readable_store(store_location(args.store))
    manifests = manifests_of(store)
    rows = [
        printing.VersionRow(
            stage=v.stage,
            key=v.key,
            created=v.manifest.get("created"),
            bytes=sum(f["bytes"] for f in v.manifest.get("files", {}).values()),
            metrics=v.metrics,
            corpus=corpus_of(v, manifests),
            path=v.location,
        )
        for v in store.versions(args.stage)
    ]
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    printing.print_versions(f"versions in {store_location(args.store)}", rows, paths=args.stage is not None)
    if args.stage == "generate" and rows:  # what the stage is for: the newest version's samples
        newest = max(store.versions("generate"), key=lambda v: v.manifest.get("created", ""))
        print(f"\nsamples of {newest.key[:12]}, the newest:")
        printing.print_samples(json.loads(newest.file("samples.json").read_text()))
    return 0


def _runs(args: argparse.Namespace) -> int:
    from .runs import show_runs

    show_runs(store_location(args.store), args.diff, args.json)
    return 0


def _sweep_command(args: argparse.Namespace) -> int:
    result = _sweep(args)
    printing.show(result, args.json, printing.print_sweep)
    return 1 if all(run["status"] != "completed" for run in result["runs"]) else 0


def _server(args: argparse.Namespace) -> int:
    from ..prefect_server.process import command

    command(args.action, args.port, args.database, args.idle_minutes)
    return 0


def _notify(args: argparse.Namespace) -> int:
    if args.action == "add" and bool(args.url) == bool(args.block):
        raise UsageError("notify add takes a webhook URL or --block TYPE/NAME (one of them)")
    if args.action == "remove" and args.url:
        args.name = args.url  # `notify remove NAME` reads naturally too
    server = chosen_server()
    if server is None:
        raise UsageError(
            "notifications live on the Prefect server that runs report to: start one "
            "(`bardflow server start`) or set PREFECT_API_URL"
        )
    check_chosen_server(server)
    from ..prefect_server import notify

    if args.action == "add":
        created = notify.add(args.url, args.name, args.block)
        print(
            f"bardflow: {args.name}: a message for every failed or crashed run and finished sweep reported to "
            f"{server.api_url} (automations {', '.join(created)})"
        )
    elif args.action == "remove":
        notify.remove(args.name)
        print(f"bardflow: {args.name}: removed")
    else:
        rows = notify.listed()
        if args.json:
            print(json.dumps(rows, indent=1))
        for row in [] if args.json else rows:
            print(f"{row['name']}: {', '.join(row['messages'])}{'' if row['enabled'] else ' (disabled)'}")
    return 0


def _run_command(args: argparse.Namespace) -> int:
    follower = cluster.follower()
    if follower is not None:
        cluster.follow(follower, args.join_timeout, args.cpu_devices)  # process 0 reports the run
    else:
        server, summary = _run(args)
        result = summary.to_json()
        if result.get("flow_run"):
            result["ui"] = f"{server.ui_url}/runs/flow-run/{result['flow_run']}"
            result["ui_served"] = server.embedded is None  # else: once `bardflow ui` serves this Prefect home
        printing.show(result, args.json, printing.print_summary)
    return 0


def _serve(args: argparse.Namespace) -> int:
    """The model a version key or a run's settings name, served until Ctrl-C."""
    from ..serving.limits import LOCAL_HOSTS, ServeSettings
    from ..serving.server import listening_socket, serve

    if args.key is not None and not args.key.strip():
        raise UsageError(
            "KEY is empty; give a checkpoint or trained version's key (`bardflow runs` lists them), or leave "
            "it out to serve a run's settings"
        )

    numbers = ServeSettings(port=args.port, slots=args.slots, queue=args.queue, max_tokens=args.max_tokens)
    if numbers.out_of_range():
        raise UsageError(numbers.out_of_range())
    if args.kernels:
        prepare_environment(args.cpu_devices)
        import jax

        if jax.default_backend() != "tpu":
            raise UsageError(
                f"--kernels runs Pallas TPU kernels, and JAX here runs on {jax.default_backend()} (they would run "
                "in an interpreter, slowly); drop --kernels"
            )
    api_key = requested_api_key(args)
    if args.host not in LOCAL_HOSTS and api_key is None and not args.insecure_no_key:
        raise UsageError(
            f"--host {args.host} is reachable from other machines: give an API key (--api-key-file FILE, "
            "BARDFLOW_API_KEY or --api-key KEY), or --insecure-no-key to let anyone call it"
        )
    settings = ServeSettings(
        args.host,
        args.port,
        args.slots,
        args.queue,
        args.max_tokens,
        args.kernels,
        args.cache,
        api_key,
        tuple(args.allow_host),
    )
    listener = listening_socket(settings.host, settings.port)  # held from now: a second server fails at once
    if args.host not in LOCAL_HOSTS and api_key is None:
        print(
            fit(f"bardflow: --host {args.host} without an API key: anyone who can reach this machine may call it"),
            file=sys.stderr,
        )
    if args.key:
        root = store_location(args.store)
        prepare_environment(args.cpu_devices)
    else:
        server, summary = _run(args)  # every stage up to the trained state: cached, or built now
        root, args.key = summary.store, summary.stages["checkpoint"].key
        if server.embedded is not None:  # the run's own Prefect server has done its work: serving needs none
            settle_reports()  # what Prefect still holds for it, sent before it goes, not failing at exit
            server.embedded.stop()
    model, tokenizer, model_id = served_model(root, args.key)
    return serve(model, model_id, settings, compiling, listener, tokenizer)


COMMANDS = {
    "run": _run_command,
    "sweep": _sweep_command,
    "runs": _runs,
    "presets": _presets,
    "artifacts": _artifacts,
    "ui": _ui,
    "server": _server,
    "notify": _notify,
    "serve": _serve,
}


def main(argv: list[str] | None = None) -> int:
    """One command: its exit status; an explained error is one line on stderr."""
    args = parser().parse_args(argv)
    if args.debug:
        os.environ[DEBUG] = "1"  # the flow's log shows explained errors' tracebacks too
    if args.command in ("run", "sweep") or (args.command == "serve" and not args.key):
        stopping.install()  # Ctrl-C and SIGTERM stop the run in order (processes/stopping.py)
    try:
        if getattr(args, "preset", None) is not None:
            preset_name(args.preset)
        return COMMANDS[args.command](args)
    except stopping.Stopped as stop:
        if stopping.failure():
            print(fit(f"bardflow: error: {stopping.failure()}"), file=sys.stderr)
            return 1
        print(fit(f"bardflow: {stop}"), file=sys.stderr)
        return stop.exit_code
    except BardflowError as error:
        if debugging():
            import traceback

            traceback.print_exc()
        settle_reports()
        print(fit(f"bardflow: error: {error}"), file=sys.stderr)
        return 2 if isinstance(error, UsageError) else 1
    except Exception as error:
        signum = stopping.requested()
        if out_of_resources(error) and not debugging():
            print(fit(f"bardflow: error: {out_of_resources(error)}"), file=sys.stderr)
            return 1
        if signum is None or debugging():
            raise
        if stopping.failure():
            print(fit(f"bardflow: error: {stopping.failure()}"), file=sys.stderr)
            return 1
        # What a stop breaks on its way out (a client call cut short) is not news.
        print(
            fit(f"bardflow: stopped by {stopping.name(signum)} {stopping.where()}; rerun the same command to go on"),
            file=sys.stderr,
        )
        return 128 + signum


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
    if stopping.failure():
        # The run's server is gone: what Prefect still holds for it can never be sent, and
        # the interpreter's exit would wait for Prefect's queues to drain into it (for minutes,
        # or for good), before any exit handler runs.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code[0])
    if code[0] != 0 and writers_stuck():
        # A checkpoint's background writers that failed leave the others waiting on them for
        # Orbax's coordination timeout, and the interpreter joins them before any exit
        # handler: run the handlers now, and end without the join.
        atexit._run_exitfuncs()
    sys.exit(code[0])


if __name__ == "__main__":
    entry()
