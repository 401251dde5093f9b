"""``python -m bardflow``: the ``bardflow`` command without an installed script."""

from bardflow.flows.cli import entry

entry()
