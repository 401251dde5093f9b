"""The house rules: imports point down (flows -> tasks -> model / artifacts), model/ is
self-contained, and a training process never imports Prefect."""

import ast
import subprocess
import sys

import pytest

from tests.conftest import REPO

PACKAGES = ("flows", "tasks", "model", "artifacts")
# What each package may import of the project's own packages.
ALLOWED = {"flows": {"flows", "tasks", "model", "artifacts"}, "tasks": {"tasks", "model", "artifacts"},
           "model": {"model"}, "artifacts": {"artifacts", "model"}}


def own_imports(path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return {name for name in found if name.split(".")[0] in PACKAGES}


@pytest.mark.parametrize("package", PACKAGES)
def test_imports_point_down(package):
    for path in sorted((REPO / package).glob("*.py")):
        for name in own_imports(path):
            assert name.split(".")[0] in ALLOWED[package], f"{path.relative_to(REPO)} imports {name}"


def test_artifacts_take_only_the_error_family_from_model():
    """artifacts/ may lean on model/ for one thing: the error family."""
    for path in sorted((REPO / "artifacts").glob("*.py")):
        assert {n for n in own_imports(path) if n.startswith("model")} <= {"model.errors"}, path


def test_no_import_cycle_among_modules():
    graph = {}
    for package in PACKAGES:
        for path in (REPO / package).glob("*.py"):
            module = f"{package}.{path.stem}"
            graph[module] = {name for name in own_imports(path) if name in {f"{p}.{q.stem}" for p in PACKAGES
                                                                          for q in (REPO / p).glob("*.py")}}
    done, path = set(), []

    def visit(module):
        assert module not in path, f"import cycle: {' -> '.join(path[path.index(module):] + [module])}"
        if module in done:
            return
        path.append(module)
        for target in graph.get(module, ()):
            visit(target)
        path.pop()
        done.add(module)

    for module in graph:
        visit(module)


def test_a_training_process_and_the_registry_never_import_prefect():
    code = ("import sys, tasks.train_process, model.multiprocess, model.launch, tasks.registry, tasks.stage; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('prefect', 'jax')))")
    loaded = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert loaded.stdout.strip() == "[]"  # not even JAX: the command line reads the registry first
