#!/usr/bin/env bash
# Set up (or refresh) the project's virtual environment in .venv: CPU torch first, then the
# project with its test extras. Idempotent; safe to run before every command.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
if ! python -c "import torch" 2>/dev/null; then
  # torch==2.13.0 is the CPU wheel on this class of machine; users with a GPU install their CUDA
  # build first (the project only requires torch>=2.4).
  pip install --quiet "torch==${TORCH_VERSION:-2.13.0}"
fi
pip install --quiet -e '.[test]'
