#!/usr/bin/env bash
# The GPU smoke check in one command, for a node with torch (CUDA) but without the index or steadyrl's other
# dependencies (docs/gpu.md):
#
#   bash benchmarks/gpu_smoke.sh [WHEEL_DIR] [--out FILE] [--cases a,b] [--steps N] [--case-timeout S]
#
# 1. WHEEL_DIR (default .gpu-wheels, filled on a CPU machine by `make gpu-wheels`) is checked against its
#    manifest (a missing or altered wheel is named and nothing is installed), then installed into this Python
#    without the index and without dependencies: the missing packages and steadyrl itself. No folder: skipped
#    (everything is installed already).
# 2. benchmarks/gpu_smoke.py runs every case in its own process under its own timeout and writes one JSON
#    (default benchmarks/results/gpu_smoke.json) and a one-screen summary. Exit status 1 if a case failed.
#
# PYTHON picks the interpreter (default python3).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
WHEELS=.gpu-wheels
if [[ $# -gt 0 && $1 != --* ]]; then WHEELS=$1; shift; fi

if [[ -d $WHEELS ]]; then
  "$PY" benchmarks/gpu_wheels.py --check "$WHEELS" || exit 2
  echo "installing $(ls "$WHEELS"/*.whl | wc -l) wheels from $WHEELS (no index, no dependencies)"
  "$PY" -m pip install --quiet --no-index --no-deps --no-compile --disable-pip-version-check "$WHEELS"/*.whl \
    || { echo "error: installing the wheels of $WHEELS failed (above)" >&2; exit 2; }
else
  echo "no wheel folder $WHEELS: using the packages this Python has"
fi
"$PY" -c "import steadyrl.services.runtime.local_runtime" \
  || { echo "error: steadyrl's local runtime does not import (above): a wheel is missing from $WHEELS" >&2; exit 2; }
exec "$PY" -m benchmarks.gpu_smoke "$@"
