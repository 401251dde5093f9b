#!/usr/bin/env bash
# The one GPU check: run from the repository root on a GPU machine that has jax, flax,
# optax, orbax-checkpoint and pyarrow (it downloads nothing). Prints a short table and
# writes the JSON under $OUT (or bench/results).
set -euo pipefail
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$(pwd)"
out="${OUT:-bench/results}"
python3 - <<'PY'
import jax
print("devices:", jax.devices(), "backend:", jax.default_backend())
PY
# The codelab step is dominated by dispatch on a GPU: time enough steps to see it.
python3 -m bench --steps "${BENCH_STEPS:-100}" --pairs "${BENCH_PAIRS:-3}" --out "$out"
# Time to quality: the `quality` preset against nanoGPT's 1.4697 (target: 1.47 within 60 s).
timeout "${QUALITY_TIMEOUT_S:-300}" python3 -m bench.quality --preset quality --target 1.47 --out "$out" \
  || echo "bench.quality: failed or timed out (exit $?)"
