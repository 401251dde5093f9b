"""bardflow: a byte-level transformer trained on TinyShakespeare as a Prefect flow of cached,
versioned stages. Its parts are the repository's top-level folders, imported as
``bardflow.errors``, ``bardflow.processes``, ``bardflow.config``, ``bardflow.model``, ``bardflow.tasks``,
``bardflow.artifacts``, ``bardflow.prefect_server``, ``bardflow.flows``, ``bardflow.serving`` and
``bardflow.cli``: an installed wheel holds them
under ``bardflow/`` (pyproject.toml's ``package-dir``), and a checkout on ``PYTHONPATH`` finds
them beside this folder."""

from pathlib import Path as _Path

_checkout = _Path(__file__).resolve().parent.parent
if (_checkout / "pyproject.toml").is_file() and (_checkout / "model" / "__init__.py").is_file():
    __path__.append(str(_checkout))

__version__ = "0.1.0"
