#!/usr/bin/env bash
# The one TPU check (bench/tpu_check.py says what it runs): from the repository root, on a TPU
# host that has the JAX stack, a package index of its own and no internet. What bardflow's model
# code needs beyond the JAX stack is installed from that index, and what the index lacks from
# the wheel kit .whl-tpu/ where one was carried; both go after the host's own packages on
# PYTHONPATH, so that the host's JAX stays the one imported. Results go under $OUT (or bench/results).
#   bash bench/tpu_check.sh            # on the TPU host, at most 9 minutes
#   bash bench/tpu_check.sh --dry-run  # the same commands on CPU: small shapes, a few steps
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 DO_NOT_TRACK=1
python="${PYTHON:-python3}"
index="${BARDFLOW_TPU_INDEX:-/opt/pypi/simple}"
# What it installs goes into a temporary folder removed when the check ends, passed or not.
installed="$(mktemp -d)"
trap 'rm -rf "$installed"' EXIT
if ! "$python" -c "import flax, optax, orbax.checkpoint, pyarrow, yaml, pydantic" 2>/dev/null; then
  site="$installed/site"
  if [ -d "$index" ]; then
    PIP_CONFIG_FILE=/dev/null "$python" -m pip install --isolated -q --only-binary=:all: --no-cache-dir \
      --index-url "file://$index" --target "$site" flax optax orbax-checkpoint pyarrow pyyaml pydantic
  fi
  if ls .whl-tpu/*.whl >/dev/null 2>&1; then
    PIP_CONFIG_FILE=/dev/null "$python" -m pip install --isolated -q --no-index --no-deps --no-compile \
      --no-cache-dir --upgrade --target "$site" .whl-tpu/*.whl
  fi
  export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$site"
fi
export PYTHONPATH="$(pwd)${PYTHONPATH:+:$PYTHONPATH}"
"$python" -m bench.tpu_check --out "${OUT:-bench/results}" "$@"
