"""Test session set-up. JAX reads XLA_FLAGS once, at import, so the two emulated
CPU devices that data-parallel tests need are requested here, before any test
module imports JAX. Prefect gets a private home so tests never touch ~/.prefect."""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

import numpy as np
import pytest

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
).strip()
os.environ["JAX_PLATFORMS"] = "cpu"
_prefect_home = tempfile.mkdtemp(prefix="bardflow-test-prefect-")
for name, value in {
    "PREFECT_HOME": _prefect_home,
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "300",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "DO_NOT_TRACK": "1",
}.items():
    os.environ[name] = value
os.environ.pop("PREFECT_API_URL", None)

REPO = Path(__file__).resolve().parents[1]
SHARED_CORPUS = REPO.parent / "shared" / "data" / "tinyshakespeare.txt"
TINYSHAKESPEARE_MD5 = "6fb458f1232090904fb40fe944165e91"


def play_text(n_bytes: int, seed: int = 0) -> bytes:
    """Deterministic play-shaped text: speaker names, colons, short lines."""
    rng = np.random.default_rng(seed)
    names = ["ROMEO", "JULIET", "HAMLET", "FIRST CITIZEN", "KING RICHARD III"]
    words = "the of and to my thou thee lord good love what shall not with be is".split()
    out = []
    size = 0
    while size < n_bytes:
        line = f"{rng.choice(names)}:\n" + " ".join(rng.choice(words, size=int(rng.integers(4, 12)))) + ".\n\n"
        out.append(line)
        size += len(line)
    return "".join(out).encode()[:n_bytes]


def md5_bytes(data: bytes) -> str:
    return hashlib.md5(data).hexdigest()


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
