"""One training per host: the training stages hold this host's slot of a Prefect global
concurrency limit, so that a second flow run on the same host (a second worker, a second
pool, a terminal run) waits for it instead of sharing the device.

The limit is named after the host (``bardflow-training-<host>``, or ``BARDFLOW_TRAINING_SLOT``;
``off`` turns it off) and created with one slot on first use; ``prefect gcl update NAME
--limit N`` lets N runs train there at once. A slot is a lease that the holder renews while
it trains and releases when its stage ends, however it ends (done, failed, stopped,
cancelled). Each holder records itself in a Prefect variable of its own
(``<name>-holder-<token>``: host, process, flow run, stage, since when, last renewal), which
the UI's Variables page shows.

The server's count of held slots is what admits a run, and it can outlive its holders: a
holder killed outright (SIGKILL, out of memory) releases nothing, and a server restarted
while a run holds a slot forgets the run's lease (Prefect keeps leases in memory) but not
the count, which then never lapses. So a run that waits settles the count against the
records: a record whose process is gone (this host) or that was not renewed for two leases
(another host) is dropped, its lease released; slots counted beyond the live holders for
``RECLAIM_AFTER_S`` are freed. A holder that finds its lease forgotten keeps its slot and
gives it back by count when its stage ends.
"""

from __future__ import annotations

import contextvars
import logging
import os
import re
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from ..processes import stopping

SLOT = "BARDFLOW_TRAINING_SLOT"
LEASE_S = 60.0  # the server's shortest lease
RENEW_S = 15.0
POLL_S = 1.0
RECLAIM_AFTER_S = 5.0  # a count no live holder owns is freed once it stays so this long
SAY_EVERY_S = 30.0  # a wait is told when it starts, then this often
LEASE_GONE = 410  # the server's answer to a lease it no longer knows


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


def _holder_gone(holder: dict, now: float | None = None) -> bool:
    """Whether a recorded holder no longer holds: a process of this host that no longer runs,
    or another host's holder that has not renewed for two leases."""
    if holder.get("host") != socket.gethostname():
        renewed = holder.get("renewed")
        return isinstance(renewed, (int, float)) and (now or time.time()) - renewed > 2 * LEASE_S
    started = _process_start(int(holder.get("pid", 0)))
    return started is None or (started != "" and started != holder.get("started"))


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds} s" if seconds < 60 else f"{seconds // 60} min {seconds % 60:02d} s"


def _describe(holder: dict, now: float) -> str:
    since = holder.get("since")
    held = f", for {_duration(now - since)}" if isinstance(since, (int, float)) else ""
    return (
        f"process {holder.get('pid')} on {holder.get('host')} ({holder.get('stage', 'a stage')} of flow run "
        f"{holder.get('flow_run')}{held})"
    )


@contextmanager
def training_slot(
    stage: str,
    log: Callable[[str], None],
    flow_run_id: str | None = None,
    name: str | None = None,
    say: Callable[[str], None] | None = None,
) -> Iterator[None]:
    """Holds this host's training slot (or the slot ``name``) for the body; waits for it,
    saying so (with ``say``, else ``log``; and on stderr where the log would not show it), while
    another run holds it. A stop (SIGINT/SIGTERM) while waiting stops the run as anywhere else."""
    name = name or slot_name()
    if name is None:
        yield
        return
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        _ensure_limit(client, name, log)
        wait = _Wait(stage, name, say or log)
        holding = _Holding(
            name,
            {
                "host": socket.gethostname(),
                "pid": os.getpid(),
                "started": _process_start(os.getpid()),
                "stage": stage,
                "flow_run": flow_run_id,
            },
        )
        while True:
            holding.claim()  # seen by every waiter before the server can count this run's slot
            try:
                lease = _take(client, name, flow_run_id)
            except BaseException:
                holding.withdraw(client)
                raise
            if lease is not None:
                break
            holding.withdraw(client)
            wait.turn(client)
            stopping.check(f"while {stage} waited for the training slot {name}")
            time.sleep(POLL_S)
        holding.hold(lease)
        (wait.log if wait.said else log)(
            f"{stage}: holds this host's training slot {name}"
            + (f" (waited {_duration(time.monotonic() - wait.began)})" if wait.said else "")
        )
        done = threading.Event()
        renewer = threading.Thread(
            target=contextvars.copy_context().run, args=(holding.renew, done), daemon=True, name="bardflow-slot-lease"
        )
        renewer.start()
        try:
            yield
        finally:
            done.set()
            renewer.join(timeout=5)
            if holding.release(client):
                log(f"{stage}: released this host's training slot {name}")
                holding.withdraw(client)


class _Holding:
    """This process's slot: its record, its lease, and how it is given back. The record is
    written ("taking") before each attempt to take the slot, so that a waiter that sees the
    server count a slot also sees who may hold it, however slowly the holder records its lease."""

    def __init__(self, name: str, holder: dict):
        self.name, self.holder, self.lease = name, holder, ""
        self.variable = f"{_prefix(name)}{uuid.uuid4().hex[:12]}"
        self.lease_lost = False  # the server forgot the lease (restarted): the slot goes back by count

    def claim(self) -> None:
        self.holder.update({"state": "taking", "since": time.time(), "renewed": time.time()})
        self.record()

    def withdraw(self, client) -> None:
        try:
            client.delete_variable_by_name(self.variable)
        except Exception:  # noqa: BLE001 - a waiter drops a gone holder's record
            pass

    def hold(self, lease: str) -> None:
        self.lease = lease
        self.holder.update({"state": "holding", "since": time.time(), "renewed": time.time()})
        self.record()

    def record(self) -> None:
        from prefect.variables import Variable

        Variable.set(
            self.variable, {**self.holder, "lease": None if self.lease_lost else self.lease or None}, overwrite=True
        )

    def renew(self, done: threading.Event) -> None:
        from prefect.client.orchestration import get_client

        with get_client(sync_client=True) as client:
            while not done.wait(RENEW_S):
                try:
                    if not self.lease_lost:
                        client.renew_concurrency_lease(uuid.UUID(self.lease), LEASE_S)
                except Exception as error:  # noqa: BLE001 - retried at the next turn; a dead server is the run's watch's news
                    self.lease_lost = _status(error) == LEASE_GONE
                try:
                    self.holder["renewed"] = time.time()
                    self.record()  # also puts it back if a restarted server's variables lost it
                except Exception:  # noqa: BLE001 - as above
                    pass

    def release(self, client) -> bool:
        """Gives the slot back by its lease, or by count when the server no longer knows the
        lease (releasing an unknown lease frees nothing); whether it did. Not when the run's
        server is gone (its client would retry for long): a waiter settles the count."""
        if stopping.failure() is not None:
            return False
        try:
            client.renew_concurrency_lease(uuid.UUID(self.lease), LEASE_S)  # does the server still know it?
        except Exception as error:  # noqa: BLE001 - any other failure: the release below says the same
            self.lease_lost = self.lease_lost or _status(error) == LEASE_GONE
        try:
            if self.lease_lost:
                client.release_concurrency_slots([self.name], 1, max(time.time() - self.holder["since"], 1.0))
            else:
                client.release_concurrency_slots_with_lease(uuid.UUID(self.lease))
        except Exception:  # noqa: BLE001 - a server gone mid-run is reported by its watch; a waiter settles the count
            return False  # the record stays: the next waiter finds this process gone and frees the slot
        return True


class _Wait:
    """A run waiting for the slot: says so with who holds it and for how long, and settles
    the server's count against the holders' records (see the module's docstring)."""

    def __init__(self, stage: str, name: str, log: Callable[[str], None]):
        self.stage, self.name, self.log = stage, name, log
        self.began = time.monotonic()
        self.said = False
        self.last_said = 0.0
        self.unowned_since: float | None = None

    def tell(self, line: str) -> None:
        """In the run's log (and the UI), and on stderr when the log would not show it."""
        self.log(line)
        if not logging.getLogger("prefect").isEnabledFor(logging.INFO):
            sys.stderr.write(f"bardflow: {line}\n")
            sys.stderr.flush()

    def turn(self, client) -> None:
        now = time.time()
        # The count first, then the records: a run that the count includes wrote its record
        # ("taking") before the server counted it, so the records read next include it.
        limit = client.read_global_concurrency_limit_by_name(self.name)
        holders, dropped = [], False
        for variable, holder in _holders(client, self.name):
            if _holder_gone(holder, now):
                self._drop(client, variable, holder)
                dropped = True
            else:
                holders.append(holder)
        if dropped:
            return  # its slot may be free now: asked for again at once
        holding = [h for h in holders if h.get("state") != "taking"]
        unowned = int(limit.active_slots) - len(holding)  # slots no run holds…
        if unowned <= 0:
            self.unowned_since = None
        else:
            self.unowned_since = self.unowned_since or time.monotonic()
            # …freed once they stay so for RECLAIM_AFTER_S, on a turn where no run is taking one
            # (whose slot the count may already include).
            if len(holders) == len(holding) and time.monotonic() - self.unowned_since >= RECLAIM_AFTER_S:
                client.release_concurrency_slots([self.name], unowned, 1.0)  # occupancy: unknown, must be > 0
                self.tell(
                    f"{self.stage}: {unowned} of the {int(limit.active_slots)} held slot(s) of {self.name} had "
                    "no live holder (a holder killed outright, or a server restarted under a run): freed"
                )
                self.unowned_since = None
                return
        waited = time.monotonic() - self.began
        if not self.said or time.monotonic() - self.last_said >= SAY_EVERY_S:
            if holding:
                why = f"held by {'; '.join(_describe(h, now) for h in holding)}; it is free when that stage ends"
            else:
                why = (
                    f"counted as held, but no live run holds it (freed in {RECLAIM_AFTER_S:.0f} s unless its "
                    "holder shows up)"
                )
            self.tell(
                f"{self.stage}: waiting for this host's training slot {self.name}"
                + (f" ({_duration(waited)} so far)" if self.said else "")
                + f": {why}"
            )
            self.said, self.last_said = True, time.monotonic()

    def _drop(self, client, variable: str, holder: dict) -> None:
        if holder.get("lease"):
            try:
                client.release_concurrency_slots_with_lease(holder["lease"])
            except Exception:  # noqa: BLE001 - released by another waiter, or lapsed; the count is settled anyway
                pass
        try:
            client.delete_variable_by_name(variable)
        except Exception:  # noqa: BLE001 - another waiter dropped it first
            pass
        self.tell(
            f"the training slot {self.name} was held by process {holder.get('pid')} on {holder.get('host')} "
            f"(flow run {holder.get('flow_run')}), which is gone: its slot is released"
        )


def _prefix(name: str) -> str:
    return f"{name}-holder-"


def _holders(client, name: str) -> list[tuple[str, dict]]:
    """The recorded holders of the slot ``name``: (variable, record). The one record of
    earlier versions (``<name>-holder``) counts too."""
    response = client.request(
        "POST", "/variables/filter", json={"variables": {"name": {"like_": f"{name}-holder%"}}, "limit": 200}
    )
    return [
        (v["name"], v["value"])
        for v in response.json()
        if (v["name"].startswith(_prefix(name)) or v["name"] == f"{name}-holder") and isinstance(v["value"], dict)
    ]


def _status(error: Exception) -> int | None:
    response = getattr(error, "response", None)
    return getattr(response, "status_code", None)


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
        log(
            f"created the concurrency limit {name} (1 slot: one training at a time on this host; "
            f"`prefect gcl update {name} --limit N` allows N)"
        )
    except ObjectAlreadyExists:  # another run on this host created it first
        pass


def _take(client, name: str, flow_run_id: str | None) -> str | None:
    """A lease on one slot, or None while the limit is full."""
    import httpx
    from prefect.client.schemas.objects import ConcurrencyLeaseHolder

    holder = ConcurrencyLeaseHolder(type="flow_run", id=uuid.UUID(str(flow_run_id))) if flow_run_id else None
    try:
        response = client.increment_concurrency_slots_with_lease([name], 1, "concurrency", LEASE_S, holder)
    except httpx.HTTPStatusError as error:
        if error.response.status_code == 423:  # locked: every slot is held
            return None
        raise
    return str(response.json()["lease_id"])
