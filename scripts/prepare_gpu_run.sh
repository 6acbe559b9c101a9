#!/usr/bin/env bash
# Packs the committed tree (HEAD) for scripts/gpu_run.sh on the device machine, where git
# history is not available. Run it here, then carry .gpu_src (and .whl) with the call.
#
#   scripts/prepare_gpu_run.sh [--prebuilt WHEEL] [--check BINARY]
#
# --prebuilt WHEEL also packs a CUDA wheel built here (python 3.12, jaxlib 0.11.2 headers,
# nvcc 13.0: what the GPU machine has), for gpu_run.sh's `prebuilt` stage; --check BINARY a
# stand-alone check built by scripts/build_check.sh, for the `check` stage. Each is refused
# unless a CUDA_TREE file next to it says it was built from HEAD's cuda/ and CMakeLists.txt
# (echo "$(git rev-parse HEAD:cuda) $(git rev-parse HEAD:CMakeLists.txt)" > DIR/CUDA_TREE).
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .gpu_src && mkdir -p .gpu_src
git archive HEAD >.gpu_src/head.tar
git rev-parse HEAD >.gpu_src/COMMIT
grep -qx '/.gpu_src/' .git/info/exclude 2>/dev/null || echo '/.gpu_src/' >>.git/info/exclude
head_tree="$(git rev-parse HEAD:cuda) $(git rev-parse HEAD:CMakeLists.txt)"
while [ $# -gt 0 ]; do
  case "$1" in
    --prebuilt|--check)
      artifact=$2
      built_from=$(cat "$(dirname "$artifact")/CUDA_TREE")
      [ "$built_from" = "$head_tree" ] || {
        echo "$artifact was built from $built_from, HEAD has $head_tree" >&2; exit 1; }
      mkdir -p .gpu_src/prebuilt
      cp "$artifact" .gpu_src/prebuilt/
      echo "$head_tree" >.gpu_src/prebuilt/CUDA_TREE
      shift 2 ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
done
echo "packed $(cat .gpu_src/COMMIT) ($(du -sh .gpu_src | cut -f1))"
