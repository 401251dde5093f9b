"""A maintainer's editor follows the code: each import leads to its file, and the uses of a
name are found in every folder (jedi, the engine of most Python editors' go-to-definition)."""

import re

import pytest

from tests.code_versions import ROOMS, module_files
from tests.helpers import REPO

jedi = pytest.importorskip("jedi")


def _at(path, pattern):
    """(line, column) of the first match of ``pattern``'s group 1 in ``path``."""
    for number, line in enumerate(path.read_text().splitlines(), 1):
        found = re.search(pattern, line)
        if found:
            return number, found.start(1)
    raise AssertionError(f"{pattern} not in {path}")


def test_go_to_definition_crosses_folders_and_find_references_finds_every_use():
    project = jedi.Project(REPO, added_sys_path=[])
    use = REPO / "flows" / "run_config.py"
    line, column = _at(use, r"\b(build_config)\(")
    (definition,) = jedi.Script(path=use, project=project).goto(line, column, follow_imports=True)
    assert definition.module_path == REPO / "config" / "settings.py" and definition.type == "function"

    line, column = _at(definition.module_path, r"^def (build_config)\(")
    found = jedi.Script(path=definition.module_path, project=project).get_references(line, column)
    files = {reference.module_path for reference in found}
    # Every module of the package that names it: the same set a search of the text finds.
    named = {path for room in ROOMS for path in module_files(room) if re.search(r"\bbuild_config\b", path.read_text())}
    assert named <= files, sorted(str(p.relative_to(REPO)) for p in named - files)
    assert {path.parent.name for path in named} >= {"config", "flows", "cli"}
