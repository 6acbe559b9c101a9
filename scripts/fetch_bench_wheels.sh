#!/usr/bin/env bash
# Downloads, here (the GPU machine has no network), the wheels of the optional benchmark
# baselines that the GPU image lacks into .whl/bench/: tokamax (benchmarks/tokamax_baseline.py)
# and the dependencies it imports. scripts/gpu_run.sh installs them into a directory of their
# own and names it in JAXFUSE_BENCH_SITE; carry .whl with the call (about 36 MB, most of it
# xprof, which tokamax imports at module level).
#
#   scripts/fetch_bench_wheels.sh [PYTHON]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${1:-python3}
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >>.git/info/exclude
mkdir -p .whl/bench
# Versions checked together (tokamax 0.0.17 wants jax >= 0.11.1; the GPU image has 0.11.2).
# The image's own packages come first on sys.path, so these fill in only what it lacks.
$PY -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl/bench \
  tokamax==0.0.17 absl-py==2.5.1 einshape==1.0 jaxtyping==0.3.11 wadler-lindig==0.1.8 \
  pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 \
  qwix==0.1.8 tqdm==4.70.1 immutabledict==4.3.1 tensorboardx==2.6.5 protobuf==7.36.2 \
  xprof==2.24.2 fire==0.7.1 termcolor==3.3.0
ls -la .whl/bench
