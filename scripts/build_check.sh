#!/usr/bin/env bash
# Builds the stand-alone checks (cuda/gpu/*/check_*.cu, linked with the other .cu files of
# their folder) into OUTDIR, compiling the objects in parallel (JOBS, default: nproc).
# Used by scripts/gpu_run.sh's `check` stage; run it on the dev machine too, to carry a
# prebuilt binary in .gpu_src/prebuilt/ (it runs on the GPU machine: same CUDA 13).
#
#   scripts/build_check.sh OUTDIR [PYTHON]
set -euo pipefail
cd "$(dirname "$0")/.."
out=$1
py=${2:-python3}
jobs=${JOBS:-$(nproc)}
cutlass=$($py -c "import cutlass_library,os;print(os.path.dirname(cutlass_library.__file__)+'/source')")
flags=(-std=c++17 -O3 -DNDEBUG --expt-relaxed-constexpr -diag-suppress=940,2473
       -gencode=arch=compute_90a,code=sm_90a -Icuda/include -I"$cutlass/include"
       -I"$cutlass/tools/util/include")
mkdir -p "$out"
for source in cuda/gpu/*/check_*.cu; do
  [ -e "$source" ] || continue
  name=$(basename "$source" .cu)
  dir=$(dirname "$source")
  objects="$out/$name.objects"
  mkdir -p "$objects"
  ls "$dir"/*.cu | xargs -P "$jobs" -I{} sh -c \
    'nvcc "$@" -I"$(dirname "$0")" -c "$0" -o "'"$objects"'/$(basename "$0" .cu).o"' {} "${flags[@]}"
  nvcc "${flags[@]}" "$objects"/*.o -o "$out/$name"
  echo "built $out/$name"
done
