"""Orchestration: the pipeline flow and the ``bardflow`` command line."""
