"""A run's configuration as a file (``bardflow run --config run.yaml``): YAML or JSON with
any of the sections of ``bardflow presets`` and, optionally, the preset they apply to.
``--set`` applies on top; the deployments take the same content as their ``settings``
parameter. Refused in one line naming the file, the key and the value.

A config file is input, so it is bounded before it is believed: its size, how far its aliases
expand (the "billion laughs": a few hundred bytes of nested aliases that name billions of
values), how deep it nests, and, by the settings themselves, how many prompts it holds and how
long they are. A key given twice is refused rather than the last one silently winning."""

from __future__ import annotations

import json
import os
import reprlib
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import Any

from ..errors import NotRegularFile, open_regular
from .settings import PRESETS, ConfigError, Overrides, PipelineConfig, build_config

SECTIONS = tuple(PipelineConfig.model_fields)
KEYS = ("preset", *SECTIONS)
MAX_BYTES = 1 << 20  # a whole preset in YAML is about 2 KB
MAX_VALUES = 100_000  # scalars, lists and mappings once aliases are expanded
MAX_DEPTH = 32
_short = reprlib.Repr()  # a value in a refusal: a glimpse, never the whole (or an expanded alias)
_short.maxstring = _short.maxother = 60
_short.maxlist = _short.maxdict = 4


def read(path: str | Path) -> tuple[str | None, Overrides]:
    """The preset named in the file (or None) and its settings as ``section.field`` overrides."""
    path = Path(path).expanduser()
    text = _text_of(path)
    content = parse_json(text, str(path)) if path.suffix.lower() == ".json" else parse(text, str(path))
    return settings(content if content is not None else {}, str(path))


def _text_of(path: Path) -> str:
    """A regular file's text, read no further than ``MAX_BYTES``: a device reports size 0 and
    reads for ever (``/dev/zero``), and a FIFO blocks its reader until a writer comes, so the
    kind is checked on the file opened without blocking, and the read is bounded whatever
    the size said."""
    try:
        with open_regular(path) as handle:
            data = handle.read(MAX_BYTES + 1)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist; check --config") from None
    except NotRegularFile as refused:
        raise ConfigError(
            f"config file {path} is a {refused.kind}, not a regular file; write the settings to a file "
            "and pass its path with --config"
        ) from None
    except OSError as error:  # a socket cannot be opened (ENXIO)
        raise ConfigError(f"config file {path} cannot be read ({error.strerror}); check --config") from None
    if len(data) > MAX_BYTES:
        raise ConfigError(
            f"config file {path} has {max(len(data), os.stat(path).st_size):,} bytes; a config file holds at most "
            f"{MAX_BYTES:,} (a whole preset is about 2,000): check --config"
        )
    try:
        return data.decode()
    except UnicodeDecodeError:
        raise ConfigError(f"config file {path} cannot be read (UnicodeDecodeError); check --config") from None


def parse(text: str, source: str) -> Any:
    """YAML (or JSON) within the bounds above, without duplicate keys."""
    import yaml  # JSON is YAML too

    loader = _loader_class()(text, source)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        values = _expanded_size(node, source)
        if values > MAX_VALUES:
            raise ConfigError(
                f"config file {source} expands to more than {MAX_VALUES:,} values (aliases that "
                "repeat aliases); write the settings out plainly"
            )
        return loader.construct_document(node)
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        problem = getattr(error, "problem", None) or str(error).splitlines()[0]
        raise ConfigError(f"config file {source} is not valid YAML or JSON{where}: {problem}") from None
    except RecursionError:
        raise ConfigError(
            f"config file {source} nests deeper than {MAX_DEPTH} levels; a config file has sections of settings"
        ) from None
    finally:
        loader.dispose()


def each_once(pairs: list[tuple[str, Any]], twice: Callable[[str], Exception]) -> dict[str, Any]:
    """A JSON object's ``pairs`` (``json.loads``'s ``object_pairs_hook``), refusing a key given
    twice with ``twice(key)``, where ``json.loads`` would keep the last silently."""
    seen: dict[str, Any] = {}
    for key, value in pairs:
        if key in seen:
            raise twice(key)
        seen[key] = value
    return seen


def parse_json(text: str, source: str) -> Any:
    """JSON as JSON (``1e1`` is the number 10; YAML 1.1 reads it as a string), within the
    same bounds as YAML and, as there, without duplicate keys."""

    def mapping(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        return each_once(
            pairs, lambda key: ConfigError(f"config file {source}: the key {key!r} is given twice; keep one")
        )

    too_deep = ConfigError(
        f"config file {source} nests deeper than {MAX_DEPTH} levels; a config file has sections of settings"
    )
    try:
        content = json.loads(text, object_pairs_hook=mapping)
    except json.JSONDecodeError as error:
        raise ConfigError(f"config file {source} is not valid JSON at line {error.lineno}: {error.msg}") from None
    except RecursionError:
        raise too_deep from None
    if _depth(content) > MAX_DEPTH:
        raise too_deep
    return content


def _depth(value: Any) -> int:
    children = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
    return 1 + max((_depth(child) for child in children), default=0)


def _loader_class():
    import yaml

    base: type[yaml.SafeLoader] = getattr(yaml, "CSafeLoader", yaml.SafeLoader)

    class BoundedLoader(base):
        def __init__(self, text: str, source: str):
            super().__init__(text)
            self.source = source

        def construct_mapping(self, node, deep=False):
            lines: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue  # `<<: *defaults` merges, and the keys after it override by design
                key = self.construct_object(key_node, deep=True)
                line = key_node.start_mark.line + 1
                if isinstance(key, Hashable) and key in lines:
                    raise ConfigError(
                        f"config file {self.source}: the key {key!r} is given twice (lines "
                        f"{lines[key]} and {line}); keep one"
                    )
                if isinstance(key, Hashable):
                    lines[key] = line
            return super().construct_mapping(node, deep)

    return BoundedLoader


def _expanded_size(node, source: str) -> int:
    """How many values the document holds with every alias expanded, counted without
    expanding anything (each node once): stops counting past the bound."""
    sizes: dict[int, int] = {}
    visiting: set[int] = set()

    def size(current, depth: int) -> int:
        key = id(current)
        if key in sizes:
            return sizes[key]
        if depth > MAX_DEPTH:
            raise RecursionError
        if key in visiting:
            raise ConfigError(
                f"config file {source} refers to itself (a recursive alias); write the settings out plainly"
            )
        visiting.add(key)
        children = current.value if isinstance(current.value, list) else []
        total = 1
        for child in children:
            for part in child if isinstance(child, tuple) else (child,):
                total += size(part, depth + 1)
                if total > MAX_VALUES:
                    break
        visiting.discard(key)
        sizes[key] = total
        return total

    return size(node, 0)


def settings(content: Any, source: str = "settings") -> tuple[str | None, Overrides]:
    """What a config file holds (already parsed), checked: its preset and its overrides."""
    if not isinstance(content, dict):
        raise ConfigError(f"{source}: expected a mapping of sections ({', '.join(KEYS)}), got {type(content).__name__}")
    for key in content:
        if key not in KEYS:
            raise ConfigError(
                f"{source}: unknown key {key!r}; the keys are {', '.join(KEYS)} (see `bardflow presets --yaml NAME`)"
            )
    preset = content.get("preset")
    if preset is not None and preset not in ("auto", *PRESETS):
        raise ConfigError(f"{source}: preset: {preset!r} is not a preset; choose one of auto, {', '.join(PRESETS)}")
    overrides: Overrides = {}
    for section in SECTIONS:
        values = content.get(section)
        if values is None:
            continue
        if not isinstance(values, dict):
            raise ConfigError(f"{source}: {section}: expected a mapping of its settings, got {_short.repr(values)}")
        for field, value in values.items():
            overrides[f"{section}.{field}"] = value
    check(preset, overrides, source)
    return preset, overrides


def check(preset: str | None, overrides: Overrides, source: str) -> None:
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
    value = f" = {_short.repr(overrides[blamed])}" if blamed is not None else ""
    raise ConfigError(f"{source}: {blamed or 'settings'}{value}: {message}")


def as_yaml(preset: str) -> str:
    """A complete file to start from: the preset's every setting, which the file then pins, but
    for the default corpus's URL (left out, so the file works offline with --corpus or
    BARDFLOW_CORPUS, and online as the preset does)."""
    import yaml

    from .settings import TINYSHAKESPEARE_URL

    body = build_config(preset).model_dump(mode="json")
    note = ""
    if body["data"].get("corpus") == TINYSHAKESPEARE_URL:
        del body["data"]["corpus"]
        note = (
            "# data.corpus is left out: the public TinyShakespeare download unless --corpus or BARDFLOW_CORPUS\n"
            "# names another source (a path, a folder, a file:// or https:// URL).\n"
        )
    header = (
        f"# bardflow run --config FILE: the {preset} preset in full. Edit what you need, or delete\n"
        "# sections to keep the preset's values; --set still applies on top.\n" + note
    )
    return header + yaml.safe_dump({"preset": preset, **body}, sort_keys=False)


def parse_value(raw: str) -> Any:
    """A value from the command line: JSON when it parses as JSON, else the text itself."""
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw


def parse_assignment(text: str) -> tuple[str, Any]:
    """``key=value`` from the command line."""
    key, sep, raw = text.partition("=")
    if not sep or not key:
        raise ConfigError(f"--set expects key=value, got {text!r}; e.g. --set train.steps=100")
    return key.strip(), parse_value(raw)
