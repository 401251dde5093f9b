"""bardflow's uses of Prefect's internals (prefect_server/prefect_private.py) still match what Prefect
does, and no other module makes any: a Prefect release that changes one fails here."""

import ast
import importlib
import inspect

from bardflow.prefect_server.prefect_private import APP_FACTORY, EPHEMERAL_ENV, ephemeral_server_command
from tests.code_versions import ROOMS
from tests.helpers import REPO

# Modules and settings of Prefect that its public API does not cover.
INTERNAL = ("prefect.server", "prefect._internal", "prefect.events.worker", "prefect.logging.handlers")


def test_the_run_server_is_the_app_prefect_starts_for_its_own_ephemeral_server():
    from prefect.server.api.server import SubprocessASGIServer

    prefects_own = inspect.getsource(SubprocessASGIServer._run_uvicorn_command)
    assert f'"{APP_FACTORY}"' in prefects_own
    for name, value in EPHEMERAL_ENV.items():
        assert f'"{name}": "{value}"' in prefects_own, name
    module, _, name = APP_FACTORY.partition(":")
    factory = getattr(importlib.import_module(module), name)
    assert {"ephemeral", "final"} <= set(inspect.signature(factory).parameters)
    for variable in ("PREFECT__SERVER_EPHEMERAL", "PREFECT__SERVER_FINAL"):
        assert variable in inspect.getsource(factory), variable  # what makes the served app ephemeral
    command, env = ephemeral_server_command(4321)
    assert command[command.index("--factory") + 1] == APP_FACTORY
    assert command[command.index("--host") + 1] == "127.0.0.1" and command[command.index("--port") + 1] == "4321"
    assert all(env[name] == value for name, value in EPHEMERAL_ENV.items())


def test_prefects_report_workers_still_drain_within_a_timeout():
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    for worker in (EventsWorker, APILogWorker):
        assert "timeout" in inspect.signature(worker.drain_all).parameters, worker


def test_no_other_module_uses_prefects_internals():
    for room in ROOMS:
        for path in sorted((REPO / room).glob("*.py")):
            if path.name == "prefect_private.py":
                continue
            text = path.read_text()
            assert "PREFECT__" not in text, f"{path.relative_to(REPO)} sets a private Prefect variable"
            for node in ast.walk(ast.parse(text)):
                names = (
                    [node.module or ""]
                    if isinstance(node, ast.ImportFrom)
                    else [alias.name for alias in node.names]
                    if isinstance(node, ast.Import)
                    else []
                )
                for name in names:
                    assert not name.startswith(INTERNAL), f"{path.relative_to(REPO)} imports {name}"
