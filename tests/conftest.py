"""Test session set-up. JAX reads XLA_FLAGS once, when it starts, so the two emulated
CPU devices that data-parallel tests need are requested here, before any test
module uses JAX. Prefect gets a private home so tests never touch ~/.prefect, and the
end-to-end tests share one Prefect server, started when the first of them needs it.
Nothing is written inside the repository: what tests keep for people to look at
(screenshots, timings) goes to $BARDFLOW_TEST_OUTPUT, by default one folder in the temporary
folder that each session writes over; what a session needs only while it runs (Prefect's home, a
cache folder) is removed when it ends."""

from __future__ import annotations

import atexit
import importlib.util
import os
import shutil
import sqlite3
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

# The end of a pytest-xdist worker, kept from an interrupt that comes once its work is done.
pytest_plugins = ["tests.worker_end"]


def _quick_compile_flags() -> str:
    """The tests check what programs compute, not how fast: XLA:CPU's backend at -O0, and its
    older fusion emitters, compile a training step in about a quarter of the time
    (docs/benchmarks.md, the test suite). An XLA that no longer knows a flag would end every
    process at its start, so the second is tried once, in a process of its own, and the result
    passed to the workers in the environment."""
    found = os.environ.get("BARDFLOW_TEST_XLA_FLAGS")
    if found is None:
        emitters = "--xla_cpu_use_fusion_emitters=false"
        tried = subprocess.run(
            [sys.executable, "-c", "import jax; jax.devices()"],
            check=False,
            capture_output=True,
            env={**os.environ, "XLA_FLAGS": emitters, "JAX_PLATFORMS": "cpu"},
        )
        found = os.environ["BARDFLOW_TEST_XLA_FLAGS"] = "--xla_backend_optimization_level=0" + (
            f" {emitters}" if tried.returncode == 0 else ""
        )
    return found


# BARDFLOW_TEST_DEVICE=accelerator (bench/tpu_check.py, bench/gpu_check.py): the tests a device
# changes run on the machine's GPU or TPU, as JAX finds it; otherwise on the CPU, two of them.
ON_ACCELERATOR = os.environ.get("BARDFLOW_TEST_DEVICE") == "accelerator"
if not ON_ACCELERATOR:
    # Every process a test starts inherits these with the rest of XLA_FLAGS.
    os.environ["XLA_FLAGS"] = " ".join(
        [os.environ.get("XLA_FLAGS", ""), _quick_compile_flags(), "--xla_force_host_platform_device_count=2"]
    ).strip()
    os.environ["JAX_PLATFORMS"] = "cpu"
# Compiled programs are kept on disk and shared by every process of the session (the CLI
# runs, the training processes) and by later sessions: most tests compile the same few
# tiny-model programs. Outside the repository; BARDFLOW_TEST_JAX_CACHE moves it.
os.environ.setdefault(
    "JAX_COMPILATION_CACHE_DIR",
    os.environ.get("BARDFLOW_TEST_JAX_CACHE")
    or str(Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "bardflow" / "test-jax-cache"),
)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
# Each pytest process's own (the controller's, each worker's), gone when it exits.
_scratch = Path(tempfile.mkdtemp(prefix="bardflow-test-"))
atexit.register(shutil.rmtree, _scratch, ignore_errors=True)
for _folder in ("prefect", "cache"):
    (_scratch / _folder).mkdir()
for name, value in {
    "PREFECT_HOME": str(_scratch / "prefect"),
    # What runs keep on this machine (local corpora's checksums, the CPU step's settings) stays
    # out of the user's ~/.cache/bardflow; the compiled programs' cache is the one above.
    "BARDFLOW_CACHE_DIR": str(_scratch / "cache"),
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "300",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "DO_NOT_TRACK": "1",
    # The CPU step's settings are measured once per machine and shape (model/training/cpu_tuning.py):
    # the suite's many shapes would each pay for it; tests/test_cpu_tuning.py turns it on.
    "BARDFLOW_CPU_TUNING": "off",
    # The export's transformers folder is written by every run but loaded with torch and
    # transformers (seconds a run) only by the tests about it: tests/test_hf_export.py.
    "BARDFLOW_HF_CHECK": "off",
    # One training per host (prefect_server/slots.py) would queue the suite's runs, which train beside
    # each other on this one machine on purpose, and a run a test kills would hold its slot
    # until it is noticed; the tests of the slot name one of their own.
    "BARDFLOW_TRAINING_SLOT": "off",
    # Each run's own server, as before the kept one: the suite's runs share the session's server
    # (PREFECT_API_URL) or start their own; tests/test_kept_server.py is about the kept one.
    "BARDFLOW_SERVER": "embedded",
    # Two workers share the cores: torch's OpenMP threads (the transformers checks) spin while
    # they wait, and beside the other worker's XLA threads took five times as long.
    "OMP_NUM_THREADS": "1",
    # Tests read the progress and stage lines a run sends at INFO: a shell quieted with
    # PREFECT_LOGGING_LEVEL=WARNING would send none.
    "PREFECT_LOGGING_LEVEL": "INFO",
}.items():
    os.environ[name] = value
os.environ.pop("PREFECT_API_URL", None)

# Prefect sets up logging on first use, closing the handlers already there: among them the
# one JAX's absl logging puts on this session's captured stderr. It goes first, then (where it
# is installed: the model's tests run without it).
if importlib.util.find_spec("prefect") is not None:
    import prefect.main  # noqa: F401 - after the environment above

from tests.helpers import SHARED_CORPUS, md5_bytes, play_text  # noqa: E402 - after the environment above

# JAX reads XLA_FLAGS once, at its first use: that is here, so that the session's two devices
# are fixed before a run called in this process with --cpu-devices 1 (which then takes one of
# them: processes/distributed.hardware) appends its own flag.
if importlib.util.find_spec("jax") is not None:
    import jax

    jax.devices()


@pytest.fixture
def small_corpus(tmp_path) -> tuple[Path, str]:
    """A 64 KB generated corpus and its md5."""
    data = play_text(64_000)
    path = tmp_path / "corpus.txt"
    path.write_bytes(data)
    return path, md5_bytes(data)


@pytest.fixture(scope="session")
def shakespeare() -> Path:
    if not SHARED_CORPUS.exists():
        pytest.skip(f"the TinyShakespeare copy is not at {SHARED_CORPUS}")
    return SHARED_CORPUS


def pytest_configure(config):
    """With ``-n``, files go to the workers in the order below (the long ones first), not in
    pytest-xdist's own (the files with the most tests first: the deployment module last)."""
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


# Every module, longest first (their durations with an empty compilation cache, in
# docs/benchmarks.md): handed out in this order, the workers end together. The second is
# one that needs no Prefect server: it keeps a core busy while the first starts the
# session's server (its database made from scratch), instead of waiting for it. The modules
# that mostly wait (on servers, timeouts, other processes: kept_server, session, slots,
# sources, object_store) come before the short ones that compute, each between two that
# compute, so that their waits fall beside another module's work, not together at the end.
LONGEST_FIRST = (
    "test_deployment",
    "test_serving",
    "test_sweep",
    "test_signals",
    "test_distributed",
    "test_flow",
    "test_object_store_flow",
    "test_reliability",
    "test_kept_server",
    "test_fsdp",
    "test_train",
    "test_pool_server",
    "test_hf_export",
    "test_session",
    "test_resume",
    "test_slots",
    "test_tracking",
    "test_sources",
    "test_cli",
    "test_object_store",
    "test_tokenizer",
    "test_bench_baselines",
    "test_stages",
    "test_kernels",
    "test_kept_state",
    "test_cpu_tuning",
    "test_bench_quality",
    "test_code_versions",
    "test_checkpoint_and_sampling",
    "test_model",
    "test_data",
    "test_navigation",
    "test_store",
    "test_prefect_private",
    "test_layers",
    "test_config",
    "test_gpu_kit",
    "test_corpus_identity",
    "test_run_config",
)


def pytest_collection_modifyitems(items):
    """End-to-end runs and multi-process runs are the slow ones: ``-m "not slow"`` is the
    inner loop. Modules go in the order above, the longest first, so that parallel workers
    (the README's ``-n 2 --dist loadfile``) start the long ones early and end on short ones
    together; a module not named there goes last, with a warning (a long one there would end
    the session alone on one worker)."""
    for item in items:
        if item.get_closest_marker("flow") or item.get_closest_marker("processes"):
            item.add_marker(pytest.mark.slow)

    def rank(item) -> int:
        name = item.module.__name__.rsplit(".", 1)[-1]
        return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)

    unranked = {
        item.module.__name__: item for item in items if item.module.__name__.rsplit(".", 1)[-1] not in LONGEST_FIRST
    }
    for name, item in unranked.items():
        item.warn(
            pytest.PytestWarning(
                f"{name} is not in tests/conftest.py's LONGEST_FIRST: add it where its duration puts it"
            )
        )
    items.sort(key=rank)  # stable: file order within a module, and among the rest


def _session_root(tmp_path_factory) -> Path:
    """The folder that every pytest-xdist worker of this session shares (its own without xdist)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@pytest.fixture(scope="session")
def prefect_server(tmp_path_factory):
    """One Prefect server (``bardflow server start``) for the session's end-to-end tests, in
    every worker: a CLI run pointed at it skips the embedded server's start-up (10-30 s a run
    here). What a worker starts beside it (pool workers) it stops itself."""
    from tests.servers import Server, shared

    env = dict(os.environ)

    def start(home: Path) -> dict:
        server = Server(home, env).serve()
        # Its database, made (migrated) a moment ago and not yet used: a copy is the
        # database of this session's own Prefect home, which the runs that start an
        # embedded server use. Each would otherwise migrate one of its own (seconds of CPU).
        template = home / "template.db"
        with sqlite3.connect(home / "prefect.db") as made, sqlite3.connect(template) as copy:
            made.backup(copy)
        return {"home": str(home), "port": server.port, "template": str(template)}

    def stop(record: dict) -> None:
        Server(Path(record["home"]), env, record["port"]).stop_all()

    with shared(_session_root(tmp_path_factory) / "prefect-server", start, stop) as record:
        own = Path(os.environ["PREFECT_HOME"]) / "prefect.db"
        if not own.exists():
            shutil.copyfile(record["template"], own)
        server = Server(Path(record["home"]), env, record["port"])
        try:
            yield server
        finally:
            server.stop_processes()


@pytest.fixture(scope="session")
def object_server(tmp_path_factory):
    """One S3 server (SeaweedFS) for the session's object-store tests, in every worker."""
    from tests.servers import ObjectServer, shared

    def start(home: Path) -> dict:
        server = ObjectServer(home).serve()
        return {"home": str(home), "port": server.port, "pid": server.process.pid, "grpc_ports": server.grpc_ports}

    def stop(record: dict) -> None:
        ObjectServer.kill(record["pid"], record["grpc_ports"])

    with shared(_session_root(tmp_path_factory) / "s3-server", start, stop) as record:
        yield ObjectServer(Path(record["home"]), record["port"])


@pytest.fixture(scope="session")
def run_env(prefect_server) -> dict[str, str]:
    """The environment of a ``bardflow run`` that uses the shared server."""
    return {**os.environ, "PREFECT_API_URL": prefect_server.env["PREFECT_API_URL"], "PYTHONUNBUFFERED": "1"}


@pytest.fixture(scope="session")
def mlflow_db(tmp_path_factory):
    """``mlflow_db(path)`` puts an empty MLflow database (SQLite) at ``path`` and returns its
    URI: a copy of one made once for the session, so that MLflow's schema migrations (seconds
    of CPU) run once, not once per database."""
    from tests.servers import made_once

    def make(path: Path) -> None:
        from mlflow.tracking import MlflowClient

        MlflowClient(f"sqlite:///{path}").search_experiments()  # creates and migrates it

    template = made_once(_session_root(tmp_path_factory) / "mlflow-template" / "mlflow.db", make)

    def copy(path: Path) -> str:
        shutil.copyfile(template, path)
        return f"sqlite:///{path}"

    return copy
