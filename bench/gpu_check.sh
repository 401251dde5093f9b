#!/usr/bin/env bash
# The one GPU check (bench/gpu_check.py says what it runs): from the repository root, on a
# GPU host that has the JAX stack but not Prefect and no internet. The wheel kit (.whl/, made
# by bench/gpu_wheels.sh) is installed first; results go under $OUT (or bench/results).
#   bash bench/gpu_check.sh            # on the GPU host, at most 9 minutes
#   bash bench/gpu_check.sh --dry-run  # the same commands on CPU: tiny preset, a few steps
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false DO_NOT_TRACK=1
python="${PYTHON:-python3}"
if ls .whl/*.whl >/dev/null 2>&1 && ! "$python" -c "import prefect" 2>/dev/null; then
  site="$(mktemp -d)/site"
  "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" .whl/*.whl
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$(pwd)${PYTHONPATH:+:$PYTHONPATH}"
exec "$python" -m bench.gpu_check --out "${OUT:-bench/results}" "$@"
