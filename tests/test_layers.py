"""The house rules: imports point down (cli -> flows -> tasks -> runtime -> model -> config;
artifacts beside runtime, under tasks; server operations under flows, over runtime; config at
the bottom, taking only the error family from model), model/ is pure ML,
a training process is started through a module the launcher's caller imports, and a training
process never imports Prefect."""

import ast
import subprocess
import sys

import pytest

from tests.code_versions import ROOMS, package_of
from tests.code_versions import imports as imports_of
from tests.helpers import REPO

# What each room may import of bardflow's own rooms.
ALLOWED = {
    "cli": set(ROOMS),
    "flows": set(ROOMS) - {"cli"},
    "server": {"server", "runtime", "model", "config"},
    "tasks": {"tasks", "runtime", "model", "artifacts", "config"},
    "runtime": {"runtime", "model", "config"},
    "model": {"model", "config"},
    "artifacts": {"artifacts", "model", "config"},
    "config": {"config", "model"},  # the error family alone: test_config_takes_only_the_error_family_from_model
}
# Beside the standard library, model/ imports the numerical stack and what its data and
# configuration are made of (Arrow files, validated pydantic models): no Prefect, no store.
MODEL_THIRD_PARTY = {"jax", "jaxlib", "flax", "optax", "orbax", "numpy", "ml_dtypes", "pyarrow", "pydantic"}


def imports(path) -> set[str]:
    return imports_of(ast.parse(path.read_text()), package_of(path))


def own_imports(path) -> set[str]:
    return {name for name in imports(path) if name.split(".")[0] == "bardflow" and name.count(".") >= 1}


def modules() -> dict[str, object]:
    return {
        f"bardflow.{room}.{path.stem}": path
        for room in ROOMS
        for path in (REPO / room).glob("*.py")
        if path.stem != "__init__"
    }


@pytest.mark.parametrize("room", ROOMS)
def test_imports_point_down(room):
    for path in sorted((REPO / room).glob("*.py")):
        for name in own_imports(path):
            assert name.split(".")[1] in ALLOWED[room], f"{path.relative_to(REPO)} imports {name}"


def test_model_is_pure_ml():
    standard = set(sys.stdlib_module_names)
    for path in sorted((REPO / "model").glob("*.py")):
        for name in imports(path):
            top = name.split(".")[0]
            assert top in standard | MODEL_THIRD_PARTY or name.startswith(("bardflow.model", "bardflow.config")), (
                f"{path.relative_to(REPO)} imports {name}"
            )


@pytest.mark.parametrize("room", ["artifacts", "config"])
def test_artifacts_and_config_take_only_the_error_family_from_model(room):
    for path in sorted((REPO / room).glob("*.py")):
        assert {n for n in own_imports(path) if n.startswith("bardflow.model")} <= {"bardflow.model.errors"}, path


def test_the_presets_are_files_a_user_copies():
    """Each preset is a YAML file of the configuration room, and the only source of its values."""
    import yaml

    from bardflow.config.settings import PRESET_FILES, PRESETS

    assert sorted(p.stem for p in PRESET_FILES.glob("*.yaml")) == sorted(PRESETS)
    for name, values in PRESETS.items():
        text = (PRESET_FILES / f"{name}.yaml").read_text()
        assert text.startswith(f"# {name}: ") and (yaml.safe_load(text) or {}) == values, name


def test_no_module_is_named_in_a_string():
    """A module started by name (``python -m``) is a dependency the import graph cannot see."""
    for path in modules().values():
        tree = ast.parse(path.read_text())
        docstrings = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Expr)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
                words = node.value.replace("-m ", " ").split()
                named = [w for w in words if w.rstrip(".,:;") in modules()]
                assert not named, f"{path.relative_to(REPO)}: {node.value!r}"


def test_a_training_process_is_started_from_the_module_its_caller_imports():
    from bardflow.runtime.launch import process_command
    from bardflow.tasks import train, train_process

    assert train.train_process is train_process  # tasks.train imports what it launches
    assert process_command(train_process, None)[1:3] == ["-m", "bardflow.tasks.train_process"]
    assert "bardflow.tasks.train_process" in own_imports(REPO / "tasks" / "train.py")


def test_no_two_modules_share_a_file_name_but_a_stage_and_the_model_code_it_wraps():
    """A name leads to one module; ``tasks/export.py`` beside ``model/export.py`` is a stage
    and the model code it runs, on purpose."""
    rooms_of: dict[str, set[str]] = {}
    for module in modules():
        rooms_of.setdefault(module.rpartition(".")[2], set()).add(module.split(".")[1])
    for name, rooms in rooms_of.items():
        if len(rooms) > 1:
            assert rooms == {"tasks", "model"}, f"{name}.py is in {sorted(rooms)}"
            assert f"bardflow.model.{name}" in own_imports(REPO / "tasks" / f"{name}.py"), name


def test_no_import_cycle_among_modules():
    known = modules()
    graph = {module: {n for n in own_imports(path) if n in known} for module, path in known.items()}
    done, path = set(), []

    def visit(module):
        assert module not in path, f"import cycle: {' -> '.join(path[path.index(module) :] + [module])}"
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
    code = (
        "import sys, bardflow.tasks.train_process, bardflow.runtime.multiprocess, bardflow.runtime.launch, "
        "bardflow.tasks.registry, bardflow.tasks.stage; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('prefect', 'jax')))"
    )
    loaded = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert loaded.stdout.strip() == "[]"  # not even JAX: the command line reads the registry first


def test_each_stage_builds_in_a_module_of_tasks():
    """The registry imports a stage's module when the stage has work (cheap to read first):
    each is a module of tasks/ with the build function it names."""
    from bardflow.tasks.registry import STAGES

    for stage in STAGES:
        assert stage.module in modules() and stage.module.startswith("bardflow.tasks."), stage.name
        assert callable(stage.build()), stage.name


def test_the_pipeline_the_samples_flow_and_the_sweep_are_distinct_flows_in_the_ui():
    import yaml

    from bardflow.flows.pipeline import pipeline, samples
    from bardflow.flows.sweep import DEPLOYMENT, sweep

    names = {pipeline.name, samples.name, sweep.name}
    assert len(names) == 3 and all(name.startswith("bardflow-") for name in names)
    deployments = yaml.safe_load((REPO / "prefect.yaml").read_text())["deployments"]
    entry = {d["name"]: d["entrypoint"].rpartition(":")[2] for d in deployments}
    flow_of = {"pipeline": pipeline.name, "samples": samples.name}
    assert DEPLOYMENT == f"{flow_of[entry['sweep']]}/sweep"
    assert {name: flow_of[function] for name, function in entry.items()} == {
        "pipeline": "bardflow-pipeline",
        "generate": "bardflow-samples",
        "sweep": "bardflow-pipeline",
    }
    # Each loads as `prefect deploy` and a worker's flow run load it (a file path would not
    # import: the package's modules import each other relatively).
    from prefect.flows import load_flow_from_entrypoint

    for deployment in deployments:
        assert load_flow_from_entrypoint(deployment["entrypoint"]).name in names, deployment["entrypoint"]


def test_the_architecture_map_names_every_folder_and_only_folders_that_exist():
    """docs/architecture.md's map, one entry a folder: every room of the package is on it, and
    every folder on it is in the tree."""
    import re

    text = (REPO / "docs" / "architecture.md").read_text()
    block = text.split("```\n", 2)[1]
    mapped = set(re.findall(r"^([a-z_]+)/ ", block, re.MULTILINE))
    assert set(ROOMS) <= mapped, sorted(set(ROOMS) - mapped)
    assert all((REPO / folder).is_dir() for folder in mapped), sorted(f for f in mapped if not (REPO / f).is_dir())
