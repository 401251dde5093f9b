"""Where things live, and the Prefect settings a run needs, decided before Prefect
or JAX is imported (both read their environment once, at import)."""

from __future__ import annotations

import os
from pathlib import Path

DEFAULT_STORE = "store"  # relative to the working directory; git-ignored
STAGES = ("fetch", "encode", "train_single", "train_parallel", "compare", "checkpoint", "verify", "generate")
PRESETS = ("auto", "codelab", "cpu", "tiny")


def store_root(store: str | None = None) -> Path:
    return Path(store or os.environ.get("BARDFLOW_STORE") or DEFAULT_STORE).expanduser().resolve()


def prepare_environment(cpu_devices: int | None = None) -> None:
    """Defaults that make a local run work offline on a small machine; anything the
    user already set wins."""
    defaults = {
        # A fresh embedded server migrates its database first: 20 s is too short on 2 cores.
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "DO_NOT_TRACK": "1",
    }
    for name, value in defaults.items():
        os.environ.setdefault(name, value)
    if cpu_devices:
        flag = f"--xla_force_host_platform_device_count={cpu_devices}"
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip()
