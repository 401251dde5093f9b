"""One training per host (prefect_server/slots.py), on the session's Prefect server: a slot is released
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

from bardflow.prefect_server.slots import SLOT, slot_name, training_slot
from tests.helpers import REPO

pytestmark = pytest.mark.flow

HOLD = """
import sys, time
from bardflow.prefect_server.slots import training_slot
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


WAIT = """
from bardflow.prefect_server.slots import training_slot
with training_slot("train_parallel", lambda line: None):
    print("holds it", flush=True)
"""


def _waiter(prefect_server, name: str) -> subprocess.Popen:
    """A run that waits for the slot with the log turned down to warnings (nothing of
    Prefect's INFO on its terminal): what it says about its wait must still reach stderr."""
    return subprocess.Popen(
        [sys.executable, "-c", WAIT],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **prefect_server.env, SLOT: name, "PREFECT_LOGGING_LEVEL": "WARNING"},
    )


def test_a_slot_is_released_when_its_stage_fails_and_a_killed_holder_s_slot_is_taken_over(on_server, prefect_server):
    name = on_server
    said: list[str] = []
    with pytest.raises(RuntimeError, match="diverged"), training_slot("train_single", said.append):
        raise RuntimeError("diverged")
    assert said[-1] == f"train_single: released this host's training slot {name}"
    limit = prefect_server.api(f"/v2/concurrency_limits/{name}")
    assert (limit["limit"], limit["active_slots"]) == (1, 0)

    # A holder killed outright (no stage end, no release): a process of its own, SIGKILLed
    # while another run waits and says, on its terminal, who holds the slot.
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, **prefect_server.env, SLOT: name},
    )
    waiter = None
    try:
        assert holder.stdout.readline().startswith(f"train_single: holds this host's training slot {name}")
        waiter = _waiter(prefect_server, name)
        told = waiter.stderr.readline()
        assert told.startswith(
            f"bardflow: train_parallel: waiting for this host's training slot {name}: held by process {holder.pid} on "
        ), told
        assert "train_single of flow run None, for " in told, told
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
    killed = time.monotonic()
    out, err = waiter.communicate(timeout=60)
    assert waiter.returncode == 0 and out == "holds it\n", err
    assert time.monotonic() - killed < 10  # not the lease's minute
    assert f"held by process {holder.pid} on " in err and "is gone: its slot is released" in err, err
    assert prefect_server.api(f"/v2/concurrency_limits/{name}")["active_slots"] == 0


def test_a_slot_counted_with_no_live_holder_is_freed(on_server, prefect_server):
    """What a server restarted under a run leaves: it forgot the run's lease (Prefect keeps
    leases in memory) but its database still counts the slot, which then never lapses; the
    holder, gone, recorded itself with a lease that no longer exists."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
    from prefect.variables import Variable

    name = on_server
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True
    )
    with get_client(sync_client=True) as client:
        client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=name, limit=1))
        client.increment_concurrency_slots([name], 1, "concurrency")  # a count without a lease
    import socket

    Variable.set(
        f"{name}-holder",
        {
            "lease": str(uuid.uuid4()),
            "host": socket.gethostname(),
            "pid": int(gone.stdout),
            "started": "1",
            "stage": "train_single",
        },
    )
    assert prefect_server.api(f"/v2/concurrency_limits/{name}")["active_slots"] == 1
    started = time.monotonic()
    waiter = _waiter(prefect_server, name)
    out, err = waiter.communicate(timeout=60)
    assert waiter.returncode == 0 and out == "holds it\n", err
    assert time.monotonic() - started < 30
    assert "which is gone: its slot is released" in err, err
    assert f"1 of the 1 held slot(s) of {name} had no live holder" in err, err
    assert prefect_server.api(f"/v2/concurrency_limits/{name}")["active_slots"] == 0
    assert Variable.get(f"{name}-holder", default=None) is None
