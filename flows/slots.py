"""One training per host: the training stages hold this host's slot of a Prefect global
concurrency limit, so that a second flow run on the same host (a second worker, a second
pool, a terminal run) waits for it instead of sharing the device.

The limit is named after the host (``bardflow-training-<host>``, or ``BARDFLOW_TRAINING_SLOT``;
``off`` turns it off) and created with one slot on first use; ``prefect gcl update NAME
--limit N`` lets N runs train there at once. A slot is a lease that the holder renews while
it trains and releases when its stage ends, however it ends (done, failed, stopped,
cancelled). A holder killed outright (SIGKILL, out of memory) releases nothing: the next run
on the host that waits for the slot finds the holder's process gone (the holder is recorded in
a Prefect variable of the same name) and releases its lease at once; on a host where nobody
waits, the lease lapses on its own (``LEASE_S`` plus the server's 15-second sweep).
"""

from __future__ import annotations

import contextvars
import os
import re
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from bardflow.runtime import stopping

SLOT = "BARDFLOW_TRAINING_SLOT"
LEASE_S = 60.0  # the server's shortest lease
RENEW_S = 15.0
POLL_S = 1.0


def slot_name(env: dict[str, str] | None = None) -> str | None:
    """This host's slot name, or None when turned off."""
    value = (os.environ if env is None else env).get(SLOT, "").strip()
    if value.lower() == "off":
        return None
    name = value or f"bardflow-training-{socket.gethostname()}"
    return re.sub(r"[^a-z0-9_-]+", "-", name.lower()).strip("-")  # what a Prefect variable's name allows


def _process_start(pid: int) -> str | None:
    """When process ``pid`` started (clock ticks since boot), so a reused pid is not taken for
    the holder; None when no such process runs."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass
        return ""  # alive, start time unknown (no /proc)
    fields = stat.rpartition(")")[2].split()
    return None if fields[0] == "Z" else fields[19]


def _holder_gone(holder: dict) -> bool:
    """Whether the recorded holder was a process of this host that no longer runs."""
    if holder.get("host") != socket.gethostname():
        return False  # another host's process: its lease lapses on its own
    started = _process_start(int(holder.get("pid", 0)))
    return started is None or (started != "" and started != holder.get("started"))


@contextmanager
def training_slot(stage: str, log: Callable[[str], None], flow_run_id: str | None = None,
                  name: str | None = None) -> Iterator[None]:
    """Holds this host's training slot (or the slot ``name``) for the body; waits for it,
    saying so, while another run holds it. A stop (SIGINT/SIGTERM) while waiting stops the
    run as anywhere else."""
    name = name or slot_name()
    if name is None:
        yield
        return
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        _ensure_limit(client, name, log)
        waited = time.monotonic()
        said = False
        while (lease := _take(client, name, flow_run_id)) is None:
            if not said:
                log(f"{stage}: waiting for this host's training slot {name}: another run is training here "
                    "(its stage ends, the slot is free)")
                said = True
            _release_if_holder_gone(client, name, log)
            stopping.check(f"while {stage} waited for the training slot {name}")
            time.sleep(POLL_S)
        _set_holder(name, {"lease": lease, "host": socket.gethostname(), "pid": os.getpid(),
                           "started": _process_start(os.getpid()), "stage": stage, "flow_run": flow_run_id})
        log(f"{stage}: holds this host's training slot {name}"
            + (f" (waited {time.monotonic() - waited:.0f} s)" if said else ""))
        done = threading.Event()
        renewer = threading.Thread(target=contextvars.copy_context().run, args=(_renew, lease, done), daemon=True,
                                   name="bardflow-slot-lease")
        renewer.start()
        try:
            yield
        finally:
            done.set()
            renewer.join(timeout=5)
            _set_holder(name, None)
            try:
                client.release_concurrency_slots_with_lease(lease)
            except Exception:  # noqa: BLE001, S110 - a server gone mid-run is reported by its watch; the lease lapses
                pass
            log(f"{stage}: released this host's training slot {name}")


def _ensure_limit(client, name: str, log: Callable[[str], None]) -> None:
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
    from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound

    try:
        client.read_global_concurrency_limit_by_name(name)
        return
    except ObjectNotFound:
        pass
    try:
        client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=name, limit=1))
        log(f"created the concurrency limit {name} (1 slot: one training at a time on this host; "
            f"`prefect gcl update {name} --limit N` allows N)")
    except ObjectAlreadyExists:  # another run on this host created it first
        pass


def _take(client, name: str, flow_run_id: str | None) -> str | None:
    """A lease on one slot, or None while the limit is full."""
    import httpx
    from prefect.client.schemas.objects import ConcurrencyLeaseHolder

    holder = ConcurrencyLeaseHolder(type="flow_run", id=flow_run_id) if flow_run_id else None
    try:
        response = client.increment_concurrency_slots_with_lease([name], 1, "concurrency", LEASE_S, holder)
    except httpx.HTTPStatusError as error:
        if error.response.status_code == 423:  # locked: every slot is held
            return None
        raise
    return str(response.json()["lease_id"])


def _renew(lease: str, done: threading.Event) -> None:
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        while not done.wait(RENEW_S):
            try:
                client.renew_concurrency_lease(lease, LEASE_S)
            except Exception:  # noqa: BLE001, S110 - retried at the next turn; a dead server is the run's watch's news
                pass


def _variable(name: str) -> str:
    return f"{name}-holder"


def _set_holder(name: str, holder: dict | None) -> None:
    """Who holds the slot, where every run of the host (and the UI's Variables page) sees it."""
    from prefect.variables import Variable

    if holder is None:
        Variable.unset(_variable(name))
    else:
        Variable.set(_variable(name), holder, overwrite=True)


def _release_if_holder_gone(client, name: str, log: Callable[[str], None]) -> None:
    from prefect.variables import Variable

    holder = Variable.get(_variable(name), default=None)
    if not isinstance(holder, dict) or not _holder_gone(holder):
        return
    try:
        client.release_concurrency_slots_with_lease(holder["lease"])
    except Exception:  # noqa: BLE001, S110 - released by another waiter, or lapsed
        pass
    Variable.unset(_variable(name))
    log(f"the training slot {name} was held by process {holder['pid']} (flow run {holder.get('flow_run')}), "
        "which is gone: its slot is released")
