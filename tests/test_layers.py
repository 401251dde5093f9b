"""The house rules: imports point down (cli -> flows -> tasks -> model -> config; artifacts
under tasks beside model; the Prefect server's operations under flows; process control,
processes/, and the error family, errors/, below every room), and inside model/ by concern
(training and inference build on the network and the data; the network and the data on
nothing else of it); model/ knows neither Prefect nor the store, a training process is started
through a module the launcher's caller imports, and a training process never imports Prefect."""

import ast
import subprocess
import sys

import pytest

from tests.code_versions import ROOMS, module_files, module_name, package_of
from tests.code_versions import imports as imports_of
from tests.helpers import REPO

# What each room may import of bardflow's own rooms; process control (processes/) and the
# error family (errors/) lie below them all.
ALLOWED = {
    "cli": {*ROOMS},
    "flows": set(ROOMS) - {"cli"},
    "prefect_server": {"prefect_server", "processes", "config", "errors"},
    "serving": {"serving", "model", "processes", "config", "errors"},
    "tasks": {"tasks", "model", "artifacts", "processes", "config", "errors"},
    "model": {"model", "processes", "config", "errors"},
    "artifacts": {"artifacts", "config", "errors"},
    "config": {"config", "errors"},
    "processes": {"processes", "errors"},
    "errors": {"errors"},
}
# Inside model/: what each concern may import of the others.
MODEL_ALLOWED = {
    "network": {"network"},
    "data": {"data"},
    "training": {"training", "network", "data"},
    "inference": {"inference", "network", "training"},
}
# Beside the standard library, model/ imports the numerical stack and what its data and
# configuration are made of (Arrow files, validated pydantic models, a BPE's tokenizers), a training's
# trackers their libraries and a corpus's sources their decompressors (imported when asked
# for): no Prefect, no store (a corpus in a bucket is read through the store's Bucket, handed in).
MODEL_THIRD_PARTY = {
    "jax",
    "jaxlib",
    "flax",
    "optax",
    "orbax",
    "numpy",
    "ml_dtypes",
    "pyarrow",
    "pydantic",
    "tokenizers",
}
TRACKER_LIBRARIES = {"mlflow", "tensorboard"}
# A corpus's sources may be compressed with Zstandard (imported when one is read).
SOURCE_LIBRARIES = {"zstandard"}


def imports(path) -> set[str]:
    return imports_of(ast.parse(path.read_text()), package_of(path))


def own_imports(path) -> set[str]:
    return {name for name in imports(path) if name.split(".")[0] == "bardflow" and name.count(".") >= 1}


def modules() -> dict[str, object]:
    return {module_name(path): path for room in ROOMS for path in module_files(room) if path.stem != "__init__"}


@pytest.mark.parametrize("room", ROOMS)
def test_imports_point_down(room):
    for path in module_files(room):
        for name in own_imports(path):
            assert name.split(".")[1] in ALLOWED[room], f"{path.relative_to(REPO)} imports {name}"


@pytest.mark.parametrize("concern", MODEL_ALLOWED)
def test_each_concern_of_the_model_builds_only_on_those_below_it(concern):
    for path in module_files(f"model/{concern}"):
        for name in own_imports(path):
            parts = name.split(".")
            if parts[1] == "model" and len(parts) > 2:
                assert parts[2] in MODEL_ALLOWED[concern], f"{path.relative_to(REPO)} imports {name}"


def test_model_knows_neither_prefect_nor_the_store():
    standard = set(sys.stdlib_module_names)
    for path in module_files("model"):
        allowed = standard | MODEL_THIRD_PARTY | (TRACKER_LIBRARIES if path.stem == "trackers" else set())
        allowed |= SOURCE_LIBRARIES if path.stem == "sources" else set()
        for name in imports(path):
            top = name.split(".")[0]
            assert top in allowed or name.startswith(
                ("bardflow.model", "bardflow.config", "bardflow.processes", "bardflow.errors")
            ), f"{path.relative_to(REPO)} imports {name}"


def test_the_error_family_imports_nothing_of_bardflow():
    """Every layer raises its errors: they lie below them all (errors/)."""
    assert not [name for path in module_files("errors") for name in own_imports(path)]


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
    names = modules()  # once, not per word: each call walks the tree
    for path in names.values():
        tree = ast.parse(path.read_text())
        docstrings = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Expr)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
                words = node.value.replace("-m ", " ").split()
                named = [w for w in words if w.rstrip(".,:;") in names]
                assert not named, f"{path.relative_to(REPO)}: {node.value!r}"


def test_a_training_process_is_started_from_the_module_its_caller_imports():
    from bardflow.processes.launch import process_command
    from bardflow.tasks import train, train_process

    assert train.train_process is train_process  # tasks.train imports what it launches
    assert process_command(train_process, None)[1:3] == ["-m", "bardflow.tasks.train_process"]
    assert "bardflow.tasks.train_process" in own_imports(REPO / "tasks" / "train.py")


def test_no_two_modules_share_a_file_name_but_a_stage_and_the_model_code_it_wraps():
    """A name leads to one module; ``tasks/export.py`` beside ``model/inference/export.py`` is
    a stage and the model code it runs, on purpose."""
    named: dict[str, list[str]] = {}
    for module in modules():
        named.setdefault(module.rpartition(".")[2], []).append(module)
    for name, found in named.items():
        if len(found) > 1:
            assert sorted(m.split(".")[1] for m in found) == ["model", "tasks"], f"{name}.py: {sorted(found)}"
            (model_side,) = [m for m in found if m.startswith("bardflow.model.")]
            assert model_side in own_imports(REPO / "tasks" / f"{name}.py"), name


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
        "import sys, bardflow.tasks.train_process, bardflow.model.training.multiprocess, "
        "bardflow.processes.launch, "
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
        "pipeline-tpu": "bardflow-pipeline",
        "pipeline-cpu": "bardflow-pipeline",
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
    layout = text.split("## Layout\n\n", 1)[1]
    assert layout.startswith("```\n"), "the map comes first"
    mapped = set(re.findall(r"^([a-z_/]+)/ ", layout.split("```\n", 2)[1], re.MULTILINE))
    packages = {
        p.parent.relative_to(REPO).as_posix() for room in ROOMS for p in module_files(room) if p.name == "__init__.py"
    }
    assert packages <= mapped, sorted(packages - mapped)
    assert all((REPO / folder).is_dir() for folder in mapped), sorted(f for f in mapped if not (REPO / f).is_dir())


@pytest.mark.parametrize("room", ["tasks", "artifacts"])
def test_the_stages_and_the_store_know_no_prefect(room):
    """A stage tells its lines and progress through ``tasks/report.py``, whose reporter the
    flows hand it (``flows/ui.py``: the run's log, the bars, the UI's artifacts); the store
    is files and buckets. Neither imports Prefect, so either runs without it."""
    for path in module_files(room):
        assert not [name for name in imports(path) if name.split(".")[0] == "prefect"], path.relative_to(REPO)
