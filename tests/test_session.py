"""The test session itself, as the README's command runs it (pytest-xdist workers)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.helpers import REPO

SLOW_END = """
import gc, os, time, pytest

pytest_plugins = ["tests.worker_end"]  # the suite's, as its conftest registers it


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    if os.environ.get("PYTEST_XDIST_WORKER"):  # a worker slow to end, collecting garbage now and then
        end = time.monotonic() + 6
        while time.monotonic() < end:
            gc.collect()  # JAX's callback runs in each
            time.sleep(0.05)
"""

USES_JAX = """
import jax.numpy as jnp


def test_one():
    assert float(jnp.ones(3).sum()) == 3.0
"""


@pytest.mark.slow  # a pytest session of its own, with workers
def test_a_worker_slow_to_end_ends_without_a_keyboard_interrupt(tmp_path):
    """execnet sends a worker still busy 5 s after the controller ends it a SIGINT; with the
    suite's plugin for a worker's end, one that takes longer over its end (here 6 s, collecting garbage
    with JAX's callback now and then) ends the session cleanly instead of with a KeyboardInterrupt warning."""
    (tmp_path / "conftest.py").write_text(SLOW_END)
    (tmp_path / "test_uses_jax.py").write_text(USES_JAX)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", "1", "-p", "no:cacheprovider"],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0 and "1 passed" in out, out[-3000:]
    assert "KeyboardInterrupt" not in out and "Unraisable" not in out, out[-3000:]


@pytest.mark.slow  # a pytest session of its own, in a clone
def test_the_readme_s_inner_loop_collects_as_written_in_a_fresh_clone(tmp_path):
    """The README's inner loop, the ``pytest`` command itself (not ``python -m pytest``, which
    puts the folder on the path), in a fresh clone: it collects every test, where it once
    stopped at ``No module named 'tests'``. And the README stays a guide: 300 lines at most."""
    import re
    import shlex
    from pathlib import Path

    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 300
    found = re.search(r'`(\.venv/bin/pytest -m "not slow"[^`]*)`', readme)
    assert found, "the README names its inner loop"
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(REPO), str(clone)], check=True, timeout=120)
    pytest_bin = str(Path(sys.executable).parent / "pytest")
    command = shlex.split(found.group(1).replace(".venv/bin/pytest", pytest_bin, 1))
    env = {name: value for name, value in os.environ.items() if name != "PYTHONPATH"}
    done = subprocess.run(
        [*command, "--collect-only", "-q"], cwd=clone, env=env, capture_output=True, text=True, timeout=300
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0 and "ModuleNotFoundError" not in out, out[-3000:]
    assert re.search(r"\d+/\d+ tests collected \(\d+ deselected\)", out), out[-3000:]
