"""The source each stage runs, digested: ``python -m tests.code_versions`` records the table
that ``tests/test_code_versions.py`` compares with the code (``tests/code_versions.json``).

A stage's digest covers its build module and every bardflow module that it imports, directly
or not, each taken without comments and docstrings: a change there may change what the stage
builds for the same inputs, so its cached versions would be stale unless its code version in
``tasks/registry.py`` is bumped.
"""

from __future__ import annotations

import ast
import hashlib
import json
import sys
from importlib.util import find_spec, resolve_name
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TABLE = Path(__file__).with_name("code_versions.json")
ROOMS = ("errors", "processes", "config", "model", "tasks", "artifacts", "prefect_server", "flows", "serving", "cli")
# The list of stages and their code versions: bumping one stage must not flag the others.
REGISTRY = "bardflow.tasks.registry"
OWN_PACKAGES = {"bardflow"}  # what source_of looks up


def source_of(module: str) -> Path | None:
    """The file Python would import for ``module`` (``importlib``'s own finders), when it is
    one of this repository's; None for the standard library and third-party packages (not
    looked up: finding ``a.b`` imports ``a``)."""
    if module.split(".")[0] not in OWN_PACKAGES:
        return None
    try:
        spec = find_spec(module)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.origin or not spec.has_location:
        return None
    path = Path(spec.origin).resolve()
    return path if path.is_relative_to(REPO.resolve()) and path.suffix == ".py" else None


def package_of(path: Path) -> str | None:
    """The package a file of the repository belongs to (``tasks/train.py``: ``bardflow.tasks``;
    ``model/training/step.py``: ``bardflow.model.training``)."""
    parts = path.resolve().parent.relative_to(REPO.resolve()).parts
    return "bardflow." + ".".join(parts) if parts and parts[0] in ROOMS else None


def module_files(room: str) -> list[Path]:
    """Every module of a room, its sub-packages' too (``__init__.py`` files included)."""
    return sorted((REPO / room).rglob("*.py"))


def module_name(path: Path) -> str:
    """``model/training/step.py``: ``bardflow.model.training.step`` (a package's ``__init__.py``:
    the package)."""
    package = package_of(path)
    return package if path.stem == "__init__" else f"{package}.{path.stem}"


def imports(tree: ast.AST, package: str | None = None) -> set[str]:
    """Every module a module's code imports, anywhere in it, by its full name (a relative import
    resolved against ``package``, as Python resolves it); ``from ..model.training import
    loop`` names ``bardflow.model.training.loop`` too."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and (node.level == 0 or package):
            module = resolve_name("." * node.level + (node.module or ""), package) if node.level else node.module
            found.add(module)
            if module == "bardflow" or (module.startswith("bardflow.") and (REPO / _folder(module)).is_dir()):
                found |= {f"{module}.{alias.name}" for alias in node.names}
    return found


def _folder(package: str) -> Path:
    """The folder of a package of bardflow's (``bardflow.model.training``: ``model/training``)."""
    return Path(*package.split(".")[1:])


def normalized(path: Path) -> tuple[str, set[str]]:
    """The module's code without comments or docstrings, and the bardflow modules it imports."""
    tree = ast.parse(path.read_text())
    imported = imports(tree, package_of(path))
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (
            isinstance(body, list)
            and body
            and isinstance(body[0], ast.Expr)
            and isinstance(body[0].value, ast.Constant)
            and isinstance(body[0].value.value, str)
        ):
            node.body = body[1:] or [ast.Pass()]
    return ast.unparse(tree), {name for name in imported if source_of(name)}


def digests(root: str) -> dict[str, str]:
    """sha256 of every module ``root`` runs, by name."""
    seen, todo = {}, [root]
    while todo:
        module = todo.pop()
        if module in seen or module == REGISTRY or source_of(module) is None:
            continue
        code, imported = normalized(source_of(module))
        seen[module] = hashlib.sha256(code.encode()).hexdigest()[:16]
        todo += sorted(imported)
    return dict(sorted(seen.items()))


def table() -> dict[str, dict]:
    from bardflow.tasks.registry import STAGES

    return {stage.name: {"code_version": stage.code_version, "modules": digests(stage.module)} for stage in STAGES}


if __name__ == "__main__":
    TABLE.write_text(json.dumps(table(), indent=1) + "\n")
    print(f"recorded the code of {len(table())} stages in {TABLE.relative_to(REPO)}", file=sys.stderr)
