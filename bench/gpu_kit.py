"""The wheel kit for a GPU host without internet (``bench/gpu_wheels.sh`` runs it).

The host has Python 3.12 and the JAX stack but not Prefect: the kit is every distribution
that ``pip install -e .`` resolves here (the same versions, as constraints) for CPython 3.12
on manylinux x86_64, less what the host already has, as wheels in ``.whl/``, one version
each, under a size limit so that the repository can travel beside it. There:

    python3 -m pip install --no-index --no-deps --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site:$PWD

``python -m bench.gpu_kit [--out .whl] [--limit-mib 56] [--verify]``; ``--verify`` installs the
kit into an empty folder and imports Prefect and the command line with a local Python 3.12
(what the host's Python will do), or says why it cannot.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PYTHON = "3.12"
PLATFORMS = [
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_24_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux_2_5_x86_64",
    "manylinux1_x86_64",
]
# What the GPU host's image holds (its package list, read 2026-11-17): never carried.
HOST_HAS = frozenset(
    """
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build certifi
charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core
cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock
flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx
huggingface-hub humanize hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin
jaxlib jaxtyping jinja2 joblib kiwisolver lazy-loader lightning lightning-utilities linear-operator lineax
llvmlite lxml markdown markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack
multidict multipledispatch mypy-extensions nanobind narwhals networkx ninja numba numba-cuda numpy numpyro
onnx onnx-ir onnxruntime onnxscript opencv-python-headless optax opt-einsum opt-einsum-fx optimistix
orbax-checkpoint packaging pandas pathspec patsy peft pillow pip pluggy portalocker prometheus-client
propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing pyproject-hooks pyre-extensions
pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist python-dateutil pytorch-lightning
pyyaml regex requests rich sacrebleu safetensors scikit-build-core scikit-image scikit-learn scipy seaborn
sentencepiece sentence-transformers setuptools shellingham simplejson six sortedcontainers statsmodels sympy
tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm tokenizers
toolz torch torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope
triton typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray
xxhash yarl zipp
""".split()
)


# The host's JAX stack: what the check below need not stand in for (large, and not imported
# by Prefect or the command line).
JAX_STACK = frozenset(
    """jax jaxlib flax optax orbax-checkpoint chex tensorstore scipy pyarrow matplotlib ml-dtypes
pillow contourpy fonttools kiwisolver cycler pyparsing treescope etils opt-einsum absl-py""".split()
)


class KitError(RuntimeError):
    """The kit cannot be made or checked; the message says why and what to do."""


def normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirements() -> list[str]:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]


def _target_options() -> list[str]:
    options = ["--only-binary=:all:", "--python-version", PYTHON, "--implementation", "cp"]
    return options + [arg for platform in PLATFORMS for arg in ("--platform", platform)]


def resolve(python: str = sys.executable) -> list[tuple[str, str]]:
    """(name, version) of every distribution ``pip install -e .`` needs on the host:
    resolved for CPython 3.12 on manylinux x86_64, held to the versions installed here."""
    with tempfile.TemporaryDirectory() as tmp:
        frozen = subprocess.run(
            [python, "-m", "pip", "freeze", "--exclude-editable"], capture_output=True, text=True, check=True
        ).stdout
        constraints = Path(tmp) / "constraints.txt"
        constraints.write_text("\n".join(line for line in frozen.splitlines() if "==" in line) + "\n")
        report = Path(tmp) / "report.json"
        done = subprocess.run(
            [
                python,
                "-m",
                "pip",
                "install",
                "--quiet",
                "--dry-run",
                "--ignore-installed",
                "--report",
                str(report),
                "--target",
                str(Path(tmp) / "target"),
                *_target_options(),
                "-c",
                str(constraints),
                *requirements(),
            ],
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            raise KitError(f"pip could not resolve the requirements for CPython {PYTHON}:\n{done.stderr[-2000:]}")
        installs = json.loads(report.read_text())["install"]
    return sorted((normalized(item["metadata"]["name"]), item["metadata"]["version"]) for item in installs)


def plan(resolved: list[tuple[str, str]]) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(what to carry, what the host already has)."""
    carried = [(name, version) for name, version in resolved if name not in HOST_HAS]
    left_out = [(name, version) for name, version in resolved if name in HOST_HAS]
    return carried, left_out


def wheel_name(path: Path) -> str:
    return normalized(path.name.split("-")[0])


def build(out: Path, limit_mib: float, python: str = sys.executable) -> dict:
    resolved = resolve(python)
    carried, left_out = plan(resolved)
    if out.exists():
        shutil.rmtree(out)  # one version of each package: never a leftover beside a new one
    out.mkdir(parents=True)
    done = subprocess.run(
        [
            python,
            "-m",
            "pip",
            "download",
            "--quiet",
            "--no-deps",
            *_target_options(),
            "-d",
            str(out),
            *[f"{name}=={version}" for name, version in carried],
        ],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        raise KitError(f"pip could not download every wheel for CPython {PYTHON}:\n{done.stderr[-2000:]}")
    wheels = sorted(out.glob("*.whl"))
    names = [wheel_name(w) for w in wheels]
    twice = sorted({n for n in names if names.count(n) > 1})
    missing = sorted({name for name, _ in carried} - set(names))
    if twice or missing:
        raise KitError(f"the kit is inconsistent: twice {twice}, missing {missing}")
    total = sum(w.stat().st_size for w in wheels) / 2**20
    kit = {
        "python": PYTHON,
        "platforms": PLATFORMS,
        "total_mib": round(total, 2),
        "limit_mib": limit_mib,
        "carried": dict(carried),
        "left_out_host_has": dict(left_out),
        "wheels": [w.name for w in wheels],
    }
    (out / "kit.json").write_text(json.dumps(kit, indent=1))
    if total > limit_mib:
        raise KitError(
            f"the kit is {total:.1f} MiB, over the {limit_mib:g} MiB that leaves room for the repository; "
            f"its largest wheels: "
            f"{', '.join(w.name for w in sorted(wheels, key=lambda w: -w.stat().st_size)[:3])}"
        )
    return kit


def find_python(version: str = PYTHON) -> str | None:
    root = Path(os.environ.get("PYENV_ROOT", "~/.pyenv")).expanduser()
    pyenv = sorted(root.glob(f"versions/{version}*/bin/python{version}"))
    for candidate in (f"python{version}", f"/usr/bin/python{version}", *map(str, pyenv)):
        found = shutil.which(candidate)
        if found and subprocess.run(
            [found, "-c", "import sys; print(sys.version_info[:2])"], capture_output=True, text=True
        ).stdout.strip() == str(tuple(map(int, version.split(".")))):
            return found
    return None


def verify(out: Path) -> str:
    """Installs the kit as the host will, with --no-index into an empty folder, beside a
    stand-in for what the host has (its packages at the resolved versions, less the JAX
    stack, which Prefect and the command line do not import), and imports Prefect and the
    command line from it with a local CPython 3.12. Returns what was checked; raises
    KitError if it fails."""
    python = find_python()
    if python is None:
        return f"no local Python {PYTHON}: the kit's completeness was checked against pip's resolution only"
    kit = json.loads((out / "kit.json").read_text())
    with tempfile.TemporaryDirectory() as site, tempfile.TemporaryDirectory() as host:
        stand_in = [f"{n}=={v}" for n, v in kit["left_out_host_has"].items() if n not in JAX_STACK]
        fetched = subprocess.run(
            [python, "-m", "pip", "download", "--quiet", "--no-deps", *_target_options(), "-d", host, *stand_in],
            capture_output=True,
            text=True,
        )
        if fetched.returncode != 0:
            raise KitError(f"could not fetch the stand-in for the host's packages:\n{fetched.stderr[-2000:]}")
        wheels = sorted(out.glob("*.whl")) + sorted(Path(host).glob("*.whl"))
        install = subprocess.run(
            [
                python,
                "-m",
                "pip",
                "install",
                "--quiet",
                "--no-index",
                "--no-deps",
                "--no-compile",
                "--target",
                site,
                *map(str, wheels),
            ],
            capture_output=True,
            text=True,
        )
        if install.returncode != 0:
            raise KitError(f"the kit does not install with --no-index:\n{install.stderr[-2000:]}")
        env = {**os.environ, "PYTHONPATH": f"{site}{os.pathsep}{REPO}", "PYTHONNOUSERSITE": "1"}
        env.pop("PREFECT_API_URL", None)
        probe = (
            "import prefect, pydantic, s3fs, bardflow.cli.main, bardflow.flows.environment, "
            "bardflow.config.settings, bardflow.artifacts.store; print(prefect.__version__)"
        )
        for command in (
            [python, "-c", probe],
            [python, "-m", "bardflow", "--help"],
            [python, "-m", "bardflow", "presets", "tiny"],
        ):
            done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
            if done.returncode != 0:
                raise KitError(
                    f"with the kit, `{' '.join(command[1:])}` failed on Python {PYTHON}:\n{done.stderr[-2000:]}"
                )
    return (
        f"installed with --no-index into an empty folder (beside {len(stand_in)} of the host's packages) and "
        f"imported prefect and the command line on {python}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.gpu_kit", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=REPO / ".whl")
    parser.add_argument("--limit-mib", type=float, default=56.0)
    parser.add_argument("--verify", action="store_true", help="install the kit into an empty folder and import it")
    args = parser.parse_args(argv)
    try:
        kit = build(args.out, args.limit_mib)
        print(f"{len(kit['wheels'])} wheels, {kit['total_mib']:.1f} MiB (limit {args.limit_mib:g}) in {args.out}")
        print("left out, the GPU host has them: " + ", ".join(f"{n} {v}" for n, v in kit["left_out_host_has"].items()))
        if args.verify:
            print(verify(args.out))
    except KitError as error:
        print(f"gpu_kit: error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
