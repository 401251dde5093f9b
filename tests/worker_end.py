"""A pytest plugin of the suite's (registered by tests/conftest.py): the end of a pytest-xdist
worker. A worker's tests and fixtures are done and reported when it unconfigures, but the
controller ends every worker as soon as the last one has reported, and execnet sends a worker
still busy 5 s later a SIGINT: the last worker's unconfigure (pytest's garbage collection among
it, with JAX's callback on each collection) can outlast that on a loaded machine, and the
SIGINT then lands in JAX's callback, a KeyboardInterrupt warning at the suite's end
(tests/test_session.py). Nothing is left to interrupt there: the worker ignores it."""

from __future__ import annotations

import os
import signal

import pytest


@pytest.hookimpl(tryfirst=True)
def pytest_unconfigure(config):
    if os.environ.get("PYTEST_XDIST_WORKER"):
        signal.signal(signal.SIGINT, signal.SIG_IGN)
