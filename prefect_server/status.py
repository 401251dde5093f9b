"""The kept server's state in one line, as `bardflow server status` prints it."""

from __future__ import annotations

import time


def server_status(record: dict) -> str:
    """Address, pid, uptime and the idle time left, in one line."""
    now = time.time()
    line = f"running at {record['url']} (pid {record['pid']}, up {_duration(now - record.get('started', now))}"
    idle_s = float(record.get("idle_s") or 0)
    if idle_s > 0:
        left = idle_s - (now - float(record.get("idle_since") or record.get("started") or now))
        line += f", stops after {_duration(max(0.0, left))} more idle"
    else:
        line += ", kept until `bardflow server stop`"
    return line + f"; Prefect home {record.get('prefect_home', '?')})"


def _duration(seconds: float) -> str:
    whole = int(seconds)
    return (
        f"{whole // 3600} h {whole % 3600 // 60:02d} min" if whole >= 3600 else f"{whole // 60} min {whole % 60:02d} s"
    )
