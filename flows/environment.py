"""Where things live, and the settings a run needs, decided before Prefect or JAX is
imported (both read parts of their environment once, at import or first use)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import cast

from ..config.machine import cache_dir, install_hint
from ..config.settings import PRESETS, ConfigError
from ..errors import BardflowError
from ..processes.distributed import CPU_DEVICE_FLAG

DEFAULT_STORE = "store"  # relative to the working directory; git-ignored
PRESET_NAMES = ("auto", *PRESETS)
DEBUG = "BARDFLOW_DEBUG"


def store_location(store: str | None = None) -> str:
    """The store a run uses: a local folder (made absolute) or an object store URL (s3://…)."""
    if store is not None and not store.strip():
        raise ConfigError(
            "--store is empty; give a folder or an s3:// URL, or leave it out for ./store (or BARDFLOW_STORE)"
        )
    location = store or os.environ.get("BARDFLOW_STORE") or DEFAULT_STORE
    if "://" in location:
        return location.rstrip("/")
    return str(Path(location).expanduser().resolve())


def empty_corpus(name: str) -> str:
    """The refusal of an empty corpus source, named as the user gave it."""
    return (
        f"{name} is empty; give an https URL, a file:// URL or a path, or leave it out for the public "
        "TinyShakespeare URL"
    )


def debugging() -> bool:
    """Whether explained errors show their traceback too (``--debug`` or BARDFLOW_DEBUG=1)."""
    return os.environ.get(DEBUG, "") not in ("", "0", "false")


def prepare_environment(cpu_devices: int | None = None) -> None:
    """Defaults that make a local run work offline on a small machine; anything the
    user already set wins."""
    defaults = {
        # A fresh embedded server migrates its database first: 20 s is too short on 2 cores.
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "DO_NOT_TRACK": "1",
        # JAX takes GPU memory as it needs it: the flow process uses the first GPU for
        # train_single, and the processes of a multi-process train_parallel need theirs.
        "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
        # Compiled programs are kept on this machine and shared by its runs and their training
        # processes: a rerun, a resumed stage, a new store or a sweep's next trial compiles
        # nothing it compiled before (docs/architecture.md; set it empty to turn it off).
        "JAX_COMPILATION_CACHE_DIR": str(cache_dir() / "jax"),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0.2",  # the sampler and the evaluation too
    }
    for name, value in defaults.items():
        os.environ.setdefault(name, value)
    flags = os.environ.get("XLA_FLAGS", "")
    if cpu_devices or CPU_DEVICE_FLAG not in flags:
        # On a host without accelerators, emulate one device per core (at least 2) so that
        # train_parallel really shards; on a GPU host the flag only adds CPU devices JAX
        # does not use.
        count = cpu_devices or max(2, os.cpu_count() or 1)
        os.environ["XLA_FLAGS"] = f"{flags} {CPU_DEVICE_FLAG}={count}".strip()


MIN_ADDRESS_SPACE = 8 << 30  # a tiny run on 2 cores fails at 3 GB and passes at 8 GB (docs/reliability.md)


def check_resource_limits() -> None:
    """Refuses a virtual-memory limit (``ulimit -v``) that a run cannot live under: JAX and
    XLA reserve address space as they start (thread stacks, allocator arenas), and a thread
    that cannot start ends the run in native code or in a hang rather than an error."""
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY and soft < MIN_ADDRESS_SPACE:
        raise ResourceLimitError(
            f"this shell limits virtual memory to {soft / 2**30:.1f} GiB (ulimit -v {soft // 1024}); JAX and XLA "
            f"reserve more than that as they start their threads: raise it to at least {MIN_ADDRESS_SPACE >> 30} GiB "
            f"(ulimit -v {MIN_ADDRESS_SPACE >> 10}) or lift it (ulimit -v unlimited)"
        )


class ResourceLimitError(BardflowError, RuntimeError):
    """The process may not have the memory or threads a run needs."""


STORE_CREDENTIALS = "BARDFLOW_STORE_CREDENTIALS"  # aws-credentials/NAME: the bucket's keys from a Prefect block


def store_credentials() -> str | None:
    """An object store's keys from the Prefect block ``BARDFLOW_STORE_CREDENTIALS`` names
    (prefect-aws's ``AwsCredentials``: keys, region and endpoint), put into this process's
    environment for the run, so that a worker keeps no keys of its own; the block's name,
    or None when none is named."""
    named = os.environ.get(STORE_CREDENTIALS, "").strip()
    if not named:
        return None
    from ..config.settings import ConfigError

    kind, _, block = named.partition("/")
    if kind != "aws-credentials" or not block:
        raise ConfigError(f"{STORE_CREDENTIALS}={named}: name an AWS Credentials block as aws-credentials/NAME")
    try:
        from prefect_aws import AwsCredentials
        from pydantic import SecretStr
    except ImportError:
        raise ConfigError(f"{STORE_CREDENTIALS} needs prefect-aws: {install_hint('aws')}") from None
    try:
        found = cast("AwsCredentials", AwsCredentials.load(block))  # the synchronous call's result
    except ValueError:
        raise ConfigError(
            f"{STORE_CREDENTIALS}={named}: the Prefect server has no such block; make it in the UI "
            "(Blocks, AWS Credentials) or with AwsCredentials(...).save(NAME)"
        ) from None
    secret, token = found.aws_secret_access_key, found.aws_session_token  # token: plain text, a secret in some releases
    values = {
        "AWS_ACCESS_KEY_ID": found.aws_access_key_id,
        "AWS_SECRET_ACCESS_KEY": secret.get_secret_value() if secret is not None else None,
        "AWS_SESSION_TOKEN": token.get_secret_value() if isinstance(token, SecretStr) else token,
        "AWS_REGION": found.region_name,
        "AWS_PROFILE": found.profile_name,
        "AWS_ENDPOINT_URL": found.aws_client_parameters.endpoint_url,
    }
    os.environ.update({name: str(value) for name, value in values.items() if value})
    return named


def label_flow_run() -> None:
    """Labels the flow run in progress with this process (``prefect_server/keeper.py``'s
    ``PROCESS_LABEL``), so that a server can end it as Crashed once the process is gone
    without a word (a ``kill -9`` leaves it Running for good, counted as activity)."""
    from prefect.client.orchestration import get_client
    from prefect.runtime import flow_run

    from ..prefect_server.keeper import PROCESS_LABEL, process_identity

    if flow_run.id is None:
        return
    with get_client(sync_client=True) as client:
        client.update_flow_run_labels(flow_run.id, {PROCESS_LABEL: process_identity()})
