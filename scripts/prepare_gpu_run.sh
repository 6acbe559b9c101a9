#!/usr/bin/env bash
# Packs the committed tree (HEAD) for scripts/gpu_run.sh on the device machine, where git
# history is not available. Run it here, then carry .gpu_src (and .whl) with the call.
#
#   scripts/prepare_gpu_run.sh [--prebuilt WHEEL]
#
# --prebuilt WHEEL also packs a CUDA wheel built here (python 3.12, jaxlib 0.11.2 headers,
# nvcc 13.0: what the GPU machine has), for gpu_run.sh's `prebuilt` stage. It is refused
# unless the wheel was built from HEAD's cuda/ tree and CMakeLists.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .gpu_src && mkdir -p .gpu_src
git archive HEAD >.gpu_src/head.tar
git rev-parse HEAD >.gpu_src/COMMIT
grep -qx '/.gpu_src/' .git/info/exclude 2>/dev/null || echo '/.gpu_src/' >>.git/info/exclude
if [ "${1:-}" = --prebuilt ]; then
  wheel=$2
  built_from=$(cat "$(dirname "$wheel")/CUDA_TREE")
  head_tree="$(git rev-parse HEAD:cuda) $(git rev-parse HEAD:CMakeLists.txt)"
  [ "$built_from" = "$head_tree" ] || { echo "wheel built from $built_from, HEAD has $head_tree" >&2; exit 1; }
  mkdir -p .gpu_src/prebuilt && cp "$wheel" .gpu_src/prebuilt/ && echo "$head_tree" >.gpu_src/prebuilt/CUDA_TREE
fi
echo "packed $(cat .gpu_src/COMMIT) ($(du -sh .gpu_src | cut -f1))"
