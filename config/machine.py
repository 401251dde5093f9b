"""Where this machine keeps what bardflow caches for itself."""

import os
from pathlib import Path


def cache_dir() -> Path:
    """This machine's caches (``$BARDFLOW_CACHE_DIR``, default ``~/.cache/bardflow``): the CPU
    step's measured settings, compiled programs, local corpora's checksums. Never part of a
    run's outputs."""
    return Path(os.environ.get("BARDFLOW_CACHE_DIR", "~/.cache/bardflow")).expanduser()


def install_hint(extra: str) -> str:
    """The command that adds the optional ``extra`` where bardflow is installed: in a clone
    (installed with ``pip install -e``, its extras come from that folder) ``pip install -e
    '.[hf]'``, else from the package index, ``pip install 'bardflow[hf]'``."""
    clone = Path(__file__).resolve().parents[1]  # a clone's root; site-packages/bardflow otherwise
    if not (clone / "pyproject.toml").is_file():
        return f"pip install 'bardflow[{extra}]'"
    return f"pip install -e '{'.' if Path.cwd().resolve() == clone else clone}[{extra}]'"
