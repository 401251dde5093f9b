"""A run's configuration, resolved in one module for every way a run starts: the command
line (``--preset``, ``--config``, ``--set``, ``--track``, ``--corpus``), a deployment's
parameters (``preset``, ``config`` or ``settings``, ``track``, ``corpus``) and a sweep's runs
(their settings over the sweep's). Whatever comes in, the same rules decide what wins: a whole
``config`` or a config file's ``settings`` (its own preset over the default one), the
overrides on top, then the run's ``track`` and ``corpus``; ``auto`` becomes a preset by the
hardware (``pick_preset``), and the command line checks every preset it may become before JAX
starts (``candidate_configs``)."""

from __future__ import annotations

import os
from typing import Any

from pydantic import ValidationError

from ..config import config_file
from ..config.config_file import parse_assignment
from ..config.settings import ConfigError, Overrides, PipelineConfig, TrackConfig, build_config
from .environment import empty_corpus
from .tracking import track_settings

AUTO_CHOICES = ("codelab", "cpu")  # what ``auto`` becomes: on a GPU, elsewhere


def pick_preset(preset: str) -> str:
    """``auto``: the codelab preset where JAX sees a GPU, the small ``cpu`` one elsewhere."""
    if preset != "auto":
        return preset
    from ..processes.distributed import hardware  # only now: XLA_FLAGS and friends are set by then

    on_gpu, elsewhere = AUTO_CHOICES
    return on_gpu if hardware()[1] == "gpu" else elsewhere


def command_line_overrides(
    preset: str | None, config: str | None, settings: list[str], track: list[str] | None
) -> tuple[str, Overrides]:
    """The preset and the overrides a command line asks for: ``--preset``, else the config
    file's own, else ``auto``; the file's settings, ``--set`` on top, then ``--track``."""
    named, overrides = config_file.read(config) if config else (None, {})
    overrides.update(parse_assignment(text) for text in settings)
    overrides.update(track_settings(track or []))
    return preset or named or "auto", overrides


def candidate_configs(preset: str, overrides: Overrides, corpus: str | None) -> dict[str, PipelineConfig | ConfigError]:
    """The configuration of each preset the run may become (``auto``'s choices), or why it is
    refused: a bad value is refused before JAX starts (picking ``auto`` asks JAX for a GPU)
    when no preset ``auto`` may become accepts it, and checked again once one is chosen.
    Raises the first refusal when none is accepted."""
    configs: dict[str, PipelineConfig | ConfigError] = {}
    for candidate in AUTO_CHOICES if preset == "auto" else (preset,):
        try:
            configs[candidate] = resolve_run_config(candidate, overrides, corpus=corpus, pin_corpus=False)[1]
        except ConfigError as error:
            configs[candidate] = error
    if not any(isinstance(found, PipelineConfig) for found in configs.values()):
        raise next(found for found in configs.values() if isinstance(found, ConfigError))
    return configs


def resolve_run_config(
    preset: str,
    overrides: Overrides | None = None,
    *,
    config: PipelineConfig | None = None,
    settings: Any = None,
    track: list[str] | None = None,
    corpus: str | None = None,
    pin_corpus: bool = True,
) -> tuple[str, PipelineConfig]:
    """The preset a run uses (``auto`` decided) and its whole configuration, validated.

    ``settings`` is a config file's content (its own preset, if it names one, over ``preset``);
    ``overrides`` (``section.field``: value) apply on top of it. ``pin_corpus`` records a local
    corpus's md5 in the configuration (it keys the versions; the flow pins it, a check before
    the flow need not read the corpus)."""
    overrides = dict(overrides or {})
    if settings is not None:
        if config is not None:
            raise ConfigError(
                "give either config (a whole configuration) or settings (a config file's content), not both"
            )
        named, from_file = config_file.settings(settings, "the settings parameter")
        preset = named or preset  # the file's own preset, over a deployment's default one
        overrides = {**from_file, **overrides}
    chosen = pick_preset(preset)
    return chosen, _with_inputs(config or build_config(chosen, overrides), track, corpus, pin_corpus)


def _with_inputs(
    config: PipelineConfig, track: list[str] | None, corpus: str | None, pin_corpus: bool
) -> PipelineConfig:
    """``config`` with the flow's own ``track`` and ``corpus`` parameters (as the command line's
    --track and --corpus; BARDFLOW_CORPUS where no corpus is given) and the corpus's md5 pinned:
    computed for a local corpus, it keys the versions."""
    if track:
        fields = {dotted.partition(".")[2]: where for dotted, where in track_settings(track).items()}
        try:
            config = config.model_copy(
                update={"track": TrackConfig.model_validate({**config.track.model_dump(), **fields})}
            )
        except ValidationError as error:
            raise ConfigError(f"invalid track parameter: {error.errors()[0]['msg']}") from error
    if corpus is not None and not corpus.strip():
        raise ConfigError(empty_corpus("corpus"))
    corpus = corpus or os.environ.get("BARDFLOW_CORPUS")
    if corpus:
        config = config.model_copy(update={"data": config.data.model_copy(update={"corpus": corpus})})
    if not pin_corpus:
        return config
    from ..tasks.corpus_identity import pin  # with the stage's Prefect artifacts: loaded by the flow, not before it

    return config.model_copy(update={"data": pin(config.data)})
