#!/usr/bin/env bash
# The wheel kit for a GPU host without internet (bench/gpu_kit.py says what and why): every
# package `pip install -e .` resolves here, for CPython 3.12 on manylinux x86_64, less what
# the host has, into .whl/ (ignored by git), under 56 MiB. --verify installs and imports it.
set -euo pipefail
cd "$(dirname "$0")/.."
python="${PYTHON:-.venv/bin/python}"
exec "$python" -m bench.gpu_kit "$@"
