"""The command lines that the benchmarks and the tests start bardflow with."""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Sequence
from pathlib import Path


def bardflow(*args: str) -> list[str]:
    """``python -m bardflow ARGS`` with this interpreter."""
    return [sys.executable, "-m", "bardflow", *args]


def tiny(
    corpus: Path, store: Path | str, *extra: str, devices: int | None = 1, settings: Sequence[str] = ()
) -> list[str]:
    """The options of a ``tiny`` run or sweep of ``corpus`` into ``store``, the corpus's md5
    stated (nothing downloaded, nothing read twice), on ``devices`` emulated devices (None: the
    command's own choice), each of ``settings`` (``section.field=value``) under ``--set``, then
    ``extra``."""
    md5 = hashlib.md5(Path(corpus).read_bytes()).hexdigest()
    options = ["--preset", "tiny", "--corpus", str(corpus), "--store", str(store)]
    options += [arg for setting in (f"data.md5={md5}", *settings) for arg in ("--set", setting)]
    return [*options, *(["--cpu-devices", str(devices)] if devices is not None else []), *extra]
