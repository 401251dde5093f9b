"""The runtime of a training run: its processes (launch, supervision, the multi-host group),
stop signals, the CPU step tuner, and one training run from a request to its files. It drives
``bardflow.model``; neither Prefect nor the store is known here."""

import os as _os
from pathlib import Path as _Path


def cache_dir() -> _Path:
    """This machine's caches (``$BARDFLOW_CACHE_DIR``, default ``~/.cache/bardflow``): the CPU
    step's measured settings, compiled programs. Never part of a run's outputs."""
    return _Path(_os.environ.get("BARDFLOW_CACHE_DIR", "~/.cache/bardflow")).expanduser()
