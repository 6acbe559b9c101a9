#!/usr/bin/env bash
# Downloads, here (the GPU machine has no network), pytest-xdist and execnet into .whl/, for
# `TEST_WORKERS=N scripts/gpu_run.sh ... test` (the GPU image has pytest, not pytest-xdist),
# and hypothesis with sortedcontainers, which tests/ops/test_properties.py imports.
# gpu_run.sh installs .whl/*.whl into a directory on PYTHONPATH; carry .whl with the call.
#
#   scripts/fetch_test_wheels.sh [PYTHON]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${1:-python3}
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >>.git/info/exclude
mkdir -p .whl
# Pure-Python wheels; these versions ran the GPU suite on the GPU image in session 38.
$PY -m pip download --no-deps --only-binary=:all: -d .whl pytest-xdist==3.8.0 execnet==2.1.2 \
  hypothesis==6.170.27 sortedcontainers==2.4.0
ls -la .whl
