"""One training per host (flows/slots.py), on the session's Prefect server: a slot is released
however its holder's stage ends, and a holder killed outright does not block the host: the
next run that waits finds its process gone and releases its lease. (Two workers of one pool
taking turns: tests/test_sweep.py, the pool sweep.)"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid

import pytest

from bardflow.flows.slots import SLOT, slot_name, training_slot
from tests.helpers import REPO

pytestmark = pytest.mark.flow

HOLD = """
import sys, time
from bardflow.flows.slots import training_slot
with training_slot("train_single", lambda line: print(line, flush=True)):
    time.sleep(600)
"""


@pytest.fixture
def on_server(prefect_server, monkeypatch):
    """This process talks to the session's server, with a slot name of its own."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    name = f"bardflow-training-test-{uuid.uuid4().hex[:8]}"
    monkeypatch.setenv(SLOT, name)
    with temporary_settings(updates={PREFECT_API_URL: prefect_server.env["PREFECT_API_URL"]}):
        yield name


def test_the_slot_name_is_the_host_s_unless_set_and_off_turns_it_off():
    import socket

    assert slot_name({}) == f"bardflow-training-{socket.gethostname()}".lower()
    assert slot_name({SLOT: "GPU box/7"}) == "gpu-box-7"
    assert slot_name({SLOT: "off"}) is None


def test_a_slot_is_released_when_its_stage_fails_and_a_killed_holder_s_slot_is_taken_over(on_server,
                                                                                           prefect_server):
    name = on_server
    said: list[str] = []
    with pytest.raises(RuntimeError, match="diverged"), training_slot("train_single", said.append):
        raise RuntimeError("diverged")
    assert said[-1] == f"train_single: released this host's training slot {name}"
    limit = prefect_server.api(f"/v2/concurrency_limits/{name}")
    assert (limit["limit"], limit["active_slots"]) == (1, 0)

    # A holder killed outright (no stage end, no release): a process of its own, SIGKILLed.
    holder = subprocess.Popen([sys.executable, "-c", HOLD], cwd=REPO, stdout=subprocess.PIPE, text=True,
                              env={**os.environ, **prefect_server.env, SLOT: name})
    try:
        assert holder.stdout.readline().startswith(f"train_single: holds this host's training slot {name}")
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
    assert prefect_server.api(f"/v2/concurrency_limits/{name}")["active_slots"] == 1  # still held

    said.clear()
    started = time.monotonic()
    with training_slot("train_parallel", said.append):
        took_s = time.monotonic() - started
        assert prefect_server.api(f"/v2/concurrency_limits/{name}")["active_slots"] == 1
    assert took_s < 10, took_s  # not the lease's minute
    assert said[0].startswith(f"train_parallel: waiting for this host's training slot {name}")
    assert f"held by process {holder.pid}" in said[1] and "is gone: its slot is released" in said[1]
    assert said[2].startswith(f"train_parallel: holds this host's training slot {name}")
    assert prefect_server.api(f"/v2/concurrency_limits/{name}")["active_slots"] == 0
