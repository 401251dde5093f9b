"""Where this machine keeps what bardflow caches for itself."""

import os
from pathlib import Path


def cache_dir() -> Path:
    """This machine's caches (``$BARDFLOW_CACHE_DIR``, default ``~/.cache/bardflow``): the CPU
    step's measured settings, compiled programs, local corpora's checksums. Never part of a
    run's outputs."""
    return Path(os.environ.get("BARDFLOW_CACHE_DIR", "~/.cache/bardflow")).expanduser()
