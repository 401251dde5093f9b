"""``python -m bardflow``: the ``bardflow`` command without an installed script. The command
lives in ``cli/main.py`` (``bardflow.cli.main``, mapped by pyproject.toml's ``package-dir``),
found here by name as Python finds it: a type checker reads this folder alone."""

from importlib import import_module

import_module("bardflow.cli.main").entry()
