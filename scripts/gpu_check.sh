#!/usr/bin/env bash
# One prepared GPU check (scripts/gpu_check.py): a bf16 window of the 1B peer, the codec on CUDA
# against the CPU, the automatic micro-batch, the validator's scoring forward. At most 8 minutes
# on one GPU; the last line of stdout is one JSON object, the exit status is 0 only when every
# section passed.
#
#   bash scripts/gpu_check.sh              # on a machine with one GPU and a CUDA build of torch
#   bash scripts/gpu_check.sh --dry-run    # every step on the CPU with the tiny model, < 1 minute
#
# The interpreter: $PYTHON, else the project's .venv/bin/python, else python3.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
if [ -n "${PYTHON:-}" ]; then
  PY=$PYTHON
elif [ -x .venv/bin/python ]; then
  PY=.venv/bin/python
else
  PY=python3
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
exec "$PY" scripts/gpu_check.py "$@"
