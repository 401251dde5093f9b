"""A run's configuration as a file (``bardflow run --config run.yaml``): YAML or JSON with
any of the sections of ``bardflow presets`` and, optionally, the preset they apply to.
``--set`` applies on top; the deployments take the same content as their ``settings``
parameter. Refused in one line naming the file, the key and the value."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bardflow.model.config import PRESETS, ConfigError, PipelineConfig, build_config

SECTIONS = tuple(PipelineConfig.model_fields)
KEYS = ("preset", *SECTIONS)


def read(path: str | Path) -> tuple[str | None, dict[str, Any]]:
    """The preset named in the file (or None) and its settings as ``section.field`` overrides."""
    import yaml  # JSON is YAML too

    path = Path(path).expanduser()
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist; check --config") from None
    except (IsADirectoryError, PermissionError, UnicodeDecodeError) as error:
        raise ConfigError(f"config file {path} cannot be read ({error.__class__.__name__}); check --config") from None
    try:
        content = yaml.safe_load(text)
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        problem = getattr(error, "problem", None) or str(error).splitlines()[0]
        raise ConfigError(f"config file {path} is not valid YAML or JSON{where}: {problem}") from None
    return settings(content if content is not None else {}, str(path))


def settings(content: Any, source: str = "settings") -> tuple[str | None, dict[str, Any]]:
    """What a config file holds (already parsed), checked: its preset and its overrides."""
    if not isinstance(content, dict):
        raise ConfigError(f"{source}: expected a mapping of sections ({', '.join(KEYS)}), "
                          f"got {type(content).__name__}")
    for key in content:
        if key not in KEYS:
            raise ConfigError(f"{source}: unknown key {key!r}; the keys are {', '.join(KEYS)} (see `bardflow "
                              "presets --yaml NAME`)")
    preset = content.get("preset")
    if preset is not None and preset not in ("auto", *PRESETS):
        raise ConfigError(f"{source}: preset: {preset!r} is not a preset; choose one of auto, {', '.join(PRESETS)}")
    overrides: dict[str, Any] = {}
    for section in SECTIONS:
        values = content.get(section)
        if values is None:
            continue
        if not isinstance(values, dict):
            raise ConfigError(f"{source}: {section}: expected a mapping of its settings, got {values!r}")
        for field, value in values.items():
            overrides[f"{section}.{field}"] = value
    check(preset, overrides, source)
    return preset, overrides


def check(preset: str | None, overrides: dict[str, Any], source: str) -> None:
    """Validates the file's settings alone, so that a bad one is blamed on the file, with its
    value: against the preset it names, or, naming none (or auto), against every preset it
    might meet (refused only when none accepts it; --set and the preset are checked later)."""
    candidates = [preset] if preset in PRESETS else list(PRESETS)
    errors = []
    for candidate in candidates:
        try:
            build_config(candidate, overrides)
            return
        except ConfigError as error:
            errors.append(error)
    message = str(errors[0])
    blamed = next((key for key in overrides if key in message), None)
    value = f" = {overrides[blamed]!r}" if blamed is not None else ""
    raise ConfigError(f"{source}: {blamed or 'settings'}{value}: {message}")


def as_yaml(preset: str) -> str:
    """A complete file to start from: the preset's every setting, which the file then pins."""
    import yaml

    body = build_config(preset).model_dump(mode="json")
    header = (f"# bardflow run --config FILE: the {preset} preset in full. Edit what you need, or delete\n"
              "# sections to keep the preset's values; --set still applies on top.\n")
    return header + yaml.safe_dump({"preset": preset, **body}, sort_keys=False)
