"""The command line's words: its parser, ``--set key=value`` and a sweep's ``--grid`` and
``--list``, each turned into settings and refused in one line when they do not parse."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..errors import BardflowError
from ..flows.environment import DEBUG, PRESET_NAMES
from ..serving.limits import ServeSettings
from ..tasks.registry import NAMES


class UsageError(BardflowError, ValueError):
    """The command line asks for something that does not exist."""


def preset_name(text: str) -> str:
    """``--preset``'s value, checked after parsing (argparse's ``choices`` would print its usage
    block): else one line naming the presets, and the one meant where one is spelled nearly so."""
    if text in PRESET_NAMES:
        return text
    import difflib

    close = difflib.get_close_matches(text, PRESET_NAMES, n=1, cutoff=0.6)
    meant = f" (did you mean {close[0]}?)" if close else ""
    raise UsageError(f"--preset {text!r} is no preset{meant}; presets are {', '.join(PRESET_NAMES)}")


STORE_HELP = "store: a folder or s3://bucket/prefix, gs://… (default: $BARDFLOW_STORE or ./store)"


def _pipeline_options(parser: argparse.ArgumentParser) -> None:
    """What `run`, `sweep` and `serve` share."""
    parser.add_argument(
        "--preset",
        metavar="{" + ",".join(PRESET_NAMES) + "}",
        help="codelab (the codelab exactly), cpu (minutes on a laptop), quality (time to quality "
        "on a GPU), tiny (seconds); auto (the default, unless --config names one) picks "
        "codelab on a GPU, else cpu",
    )
    parser.add_argument(
        "--config",
        metavar="FILE",
        help="YAML or JSON file with any of the sections of `bardflow presets` and optionally "
        "a preset; --set applies on top (start from `bardflow presets --yaml NAME`)",
    )
    parser.add_argument(
        "--corpus",
        help="the corpus: a file or a folder (its files in path order, joined as they are; "
        "data.glob picks which), plain or .gz/.xz/.zst/.zip/.tar archives, an http(s):// or file:// URL, "
        "or s3:// gs:// (default: $BARDFLOW_CORPUS or the public TinyShakespeare URL)",
    )
    parser.add_argument("--store", help=STORE_HELP)
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        dest="settings",
        help="override a setting, e.g. --set train.steps=100 (see `bardflow presets`)",
    )
    parser.add_argument(
        "--track",
        action="append",
        default=[],
        metavar="mlflow[=URI]|tensorboard[=DIR]",
        help="track the run as it trains: MLflow (default $MLFLOW_TRACKING_URI or ./mlflow.db) "
        "or TensorBoard event files (default ./runs); repeatable",
    )
    parser.add_argument(
        "--cpu-devices",
        type=int,
        metavar="N",
        help="emulate N CPU devices so train_parallel shards on a machine without accelerators",
    )
    parser.add_argument(
        "--processes",
        type=int,
        default=1,
        metavar="N",
        help="run train_parallel as N processes of this host sharing its devices (default 1). "
        "On a cluster, start `bardflow run` once per host with BARDFLOW_COORDINATOR, "
        "BARDFLOW_NUM_PROCESSES and BARDFLOW_PROCESS_ID set (or under srun): process 0 "
        "runs the pipeline, the others join its train_parallel",
    )
    parser.add_argument(
        "--server",
        choices=("kept", "embedded"),
        help="where the run reports: kept (the default, or $BARDFLOW_SERVER where PREFECT_API_URL names no "
        "server): the background server, started by the first run and kept for later ones until "
        "$BARDFLOW_SERVER_IDLE_MINUTES (30) pass without a run; embedded: a server of the run's own, gone "
        "when it ends",
    )
    parser.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    parser.add_argument(
        "--verbose",
        action="store_true",
        help="show every line of the run's log here too (Prefect's own included); by default the "
        "terminal shows each stage's end, progress, warnings and errors, the UI everything",
    )


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="bardflow",
        description="Train a byte-level transformer on TinyShakespeare as a Prefect flow of cached, versioned stages.",
    )
    parser.add_argument(
        "--debug", action="store_true", help=f"show the full traceback of explained errors too (or {DEBUG}=1)"
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    run = commands.add_parser(
        "run",
        help="run the pipeline (stages already in the store come back cached)",
        description="Run the whole pipeline, reporting to the kept Prefect server (started by the first run; "
        "--server embedded for one of the run's own), or the one PREFECT_API_URL points at.",
    )
    _pipeline_options(run)
    run.add_argument(
        "--refresh",
        action="append",
        default=[],
        metavar="STAGE",
        help=f"rerun this stage even if cached; repeatable; one of {', '.join(NAMES)}",
    )
    run.add_argument(
        "--join-timeout",
        type=int,
        default=3600,
        metavar="S",
        help="cluster processes other than 0: seconds to wait for process 0 to reach train_parallel (default 3600)",
    )

    _sweep_command(commands)

    _store_commands(commands)
    _ui_command(commands)
    _serve_command(commands)
    _pool_commands(commands)
    return parser


def _store_commands(commands) -> None:
    """What reads the store and the presets alone: ``runs``, ``presets``, ``artifacts``."""
    runs = commands.add_parser(
        "runs",
        help="list trained versions and how they differ (no server needed)",
        description="List the trained versions in the store with the settings in which "
        "they differ; --diff A B compares two of them in full.",
    )
    runs.add_argument("--store", help=STORE_HELP)
    runs.add_argument("--diff", nargs=2, metavar=("A", "B"), help="two version keys (or unique key prefixes)")
    runs.add_argument("--json", action="store_true", help="print JSON instead of a table")

    presets = commands.add_parser(
        "presets",
        help="show the presets, or one preset and its memory per device",
        description="A table of the presets (or one preset, and its memory per device on a GPU and a CPU); "
        "--json prints every field, --yaml one preset as a config file.",
    )
    presets.add_argument("name", nargs="?", choices=PRESET_NAMES[1:])
    presets.add_argument("--json", action="store_true", help="print every field as JSON instead of a table")
    presets.add_argument(
        "--yaml",
        action="store_true",
        help="print the preset (one must be named) as a complete config file for --config",
    )

    listing = commands.add_parser(
        "artifacts",
        help="list the versions in the store (no server needed)",
        description="List the stage versions in the store, newest first.",
    )
    listing.add_argument("stage", nargs="?", choices=NAMES)
    listing.add_argument("--store", help=STORE_HELP)
    listing.add_argument("--json", action="store_true", help="print JSON instead of a table")


def _serve_command(commands) -> None:
    serve = commands.add_parser(
        "serve",
        help="serve a trained model over an OpenAI-compatible HTTP API",
        description="Serve the model a run's settings name (every stage up to it from the store, built where "
        "missing, as `bardflow run` would), or the checkpoint or trained version KEY names, at "
        "/v1/completions (streamed or whole), /v1/models and /health. Binds 127.0.0.1 unless --host says "
        "otherwise; Ctrl-C stops it.",
    )
    serve.add_argument("key", nargs="?", metavar="KEY", help="a checkpoint or trained version's key, or its prefix")
    _pipeline_options(serve)
    chosen = ServeSettings  # the defaults the server's record holds
    serve.add_argument(
        "--host", default=chosen.host, help=f"address to bind (default {chosen.host}: this machine only)"
    )
    serve.add_argument("--port", type=int, default=chosen.port, help=f"port to listen on (default {chosen.port})")
    serve.add_argument(
        "--slots",
        type=int,
        default=chosen.slots,
        help="sequences decoded together in one compiled step; give it the streams you expect at once "
        f"(default {chosen.slots})",
    )
    serve.add_argument(
        "--queue",
        type=int,
        default=chosen.queue,
        help=f"sequences that may wait for a slot before requests get 503 (default {chosen.queue})",
    )
    serve.add_argument(
        "--max-tokens",
        type=int,
        default=chosen.max_tokens,
        help=f"the most bytes one sequence may ask for (default {chosen.max_tokens})",
    )
    serve.add_argument(
        "--kernels",
        action="store_true",
        help="TPU only: Pallas kernels store and read the cache in place (faster over many slots; "
        "a request's bytes are then the server's own, not the sampler's bit for bit)",
    )
    serve.add_argument(
        "--cache",
        choices=["float32", "bfloat16"],
        help="the key/value cache's type (default: the weights'); bfloat16 reads half the bytes a step",
    )
    serve.add_argument(
        "--api-key-file",
        type=Path,
        metavar="FILE",
        help="a file whose first line is the API key requests must send (Authorization: Bearer KEY); kept out of ps",
    )
    serve.add_argument(
        "--api-key", help="the API key itself (visible in ps: prefer --api-key-file or BARDFLOW_API_KEY)"
    )
    serve.add_argument(
        "--allow-host",
        action="append",
        default=[],
        metavar="NAME",
        help="a host name requests may address besides the bound address and the loopback names "
        "(repeatable; '*' for any)",
    )
    serve.add_argument(
        "--insecure-no-key",
        action="store_true",
        help="serve a non-loopback --host without an API key: anyone who reaches the machine may call it",
    )
    serve.set_defaults(refresh=[], join_timeout=3600)


def _ui_command(commands) -> None:
    ui = commands.add_parser(
        "ui",
        help="print the Prefect UI's address, starting the kept server if none is up",
        description="Print where the Prefect UI is: PREFECT_API_URL's server, or bardflow's kept server "
        "(started now if none is up, in the background, bound to 127.0.0.1; `bardflow server stop` stops it).",
    )
    ui.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to bind (default 127.0.0.1: this machine only); another address serves in the foreground, "
        "reachable by anyone who can reach this machine",
    )
    ui.add_argument("--port", type=int, help="the kept server's port (default 4200, or a free one if it is taken)")


def _sweep_command(commands) -> None:
    sweep = commands.add_parser(
        "sweep",
        help="run the pipeline once per configuration of a grid, and compare the runs",
        description="Run one pipeline per configuration (child flow runs of one parent flow, on one store, so "
        "stages the configurations share are built once) and compare them in one table.",
    )
    sweep.add_argument(
        "--grid",
        action="append",
        default=[],
        metavar="KEY=V1,V2,…",
        help="a setting and its values; several --grid make every combination",
    )
    sweep.add_argument(
        "--list",
        action="append",
        default=[],
        metavar="JSON",
        dest="listed",
        help="one more configuration as a JSON object, e.g. '{\"train.steps\": 100}'; repeatable",
    )
    sweep.add_argument(
        "--max-runs", type=int, default=None, metavar="N", help="refuse sweeps of more than N runs (default 32)"
    )
    sweep.add_argument(
        "--search",
        type=int,
        metavar="N",
        help="search instead of a grid: N trials proposed by Optuna (pip install 'bardflow[search]') "
        "within the ranges given as --set KEY=LOW..HIGH[:log] (and --grid KEY=A,B as choices), "
        "minimising the validation loss; the study is kept in the store, and the same command "
        "again resumes it (more trials with a larger N)",
    )
    sweep.add_argument(
        "--parallel",
        type=int,
        default=1,
        metavar="K",
        help="with --search and --pool: K trials at a time on the pool's workers (default 1)",
    )
    sweep.add_argument("--seed", type=int, default=0, help="with --search: the sampler's seed (default 0)")
    sweep.add_argument(
        "--pool",
        metavar="NAME",
        help="run each configuration as a run of the `bardflow-pipeline/sweep` deployment on this "
        "work pool, all at once: every worker of the pool trains one (needs a running server)",
    )
    _pipeline_options(sweep)


def _pool_commands(commands) -> None:
    """What an operator of a pool runs: the background server, and the messages it sends."""
    server = commands.add_parser(
        "server",
        help="the kept Prefect server (127.0.0.1) that runs report to: start, stop or show it",
        description="start: the kept Prefect server, bound to 127.0.0.1, which `run` and `sweep` use while it "
        "runs (unless PREFECT_API_URL names another; a run that finds none starts it); started here it is "
        "kept until stopped, unless --idle-minutes; stop: stop it; status: its address, pid, uptime and the "
        "idle time left (exit 3 if it is not running); env: the shell line that points Prefect's commands at it "
        '(eval "$(bardflow server env)"). One per Prefect home (PREFECT_HOME) and cache folder '
        "(BARDFLOW_CACHE_DIR).",
    )
    server.add_argument("action", choices=("start", "stop", "status", "env"))
    server.add_argument("--port", type=int, help="start: this port (default 4200, or a free one if it is taken)")
    server.add_argument(
        "--idle-minutes",
        type=float,
        metavar="M",
        help="start: stop after M minutes with no run (default: kept until `bardflow server stop`)",
    )
    server.add_argument(
        "--database",
        metavar="URL",
        help="start: keep the server's state in PostgreSQL (postgresql://USER:PASSWORD@HOST:5432/DB), "
        "as a pool of workers needs, instead of a SQLite file in PREFECT_HOME",
    )
    notify = commands.add_parser(
        "notify",
        help="a message when a run fails or crashes, or a sweep finishes (automations on the server)",
        description="add: send a message to a webhook URL (or through a notification block made in the UI) "
        "when a pipeline run fails or crashes and when a sweep finishes, naming the run, the stage "
        "and the error (or the best configuration), with a link; list: show them; remove: stop one. "
        "Needs the server the runs report to (PREFECT_API_URL, or `bardflow server start`).",
    )
    notify.add_argument("action", choices=("add", "list", "remove"))
    notify.add_argument("url", nargs="?", help="add: an http(s) webhook URL (Slack's are sent in its format)")
    notify.add_argument("--name", default="default", help="the destination's name (default: default)")
    notify.add_argument(
        "--block",
        metavar="TYPE/NAME",
        help="add: send through this notification block instead of a URL, e.g. slack-webhook/alerts",
    )
    notify.add_argument("--json", action="store_true", help="list: print JSON")
