#!/usr/bin/env bash
# Builds the stand-alone checks (cuda/gpu/*/check_*.cu, linked with the other .cu files of
# their folder) into OUTDIR, compiling the objects in parallel (JOBS, default: nproc).
# Used by scripts/gpu_run.sh's `check` stage; run it on the dev machine too, to carry a
# prebuilt binary in .gpu_src/prebuilt/ (it runs on the GPU machine: same CUDA 13).
#
#   scripts/build_check.sh OUTDIR [PYTHON]
#
# REUSE_BUILD=DIR takes the library's objects from a CMake build directory of the same
# sources (e.g. the wheel's build-dir) where they are newer than every source and header of
# the folder, instead of recompiling the CUTLASS files (minutes each on 2 cores). CMake
# compiles them with the flags below (plus -fPIC).
set -euo pipefail
cd "$(dirname "$0")/.."
out=$1
py=${2:-python3}
jobs=${JOBS:-$(nproc)}
cutlass=$($py -c "import cutlass_library,os;print(os.path.dirname(cutlass_library.__file__)+'/source')")
# cuBLASLt's header (check_grouped_gemm --cublaslt-grouped opens the library at run time):
# the CUDA toolkit's, else the nvidia-cublas wheel's, as CMakeLists.txt looks for it.
cublas_include=$($py -c "
import os
try:
  import nvidia; paths = list(nvidia.__path__)
except ImportError:
  paths = []
print(next((os.path.join(p, s) for p in paths for s in ('cu13/include', 'cublas/include')
            if os.path.exists(os.path.join(p, s, 'cublasLt.h'))), ''))")
flags=(-std=c++17 -O3 -DNDEBUG --expt-relaxed-constexpr -diag-suppress=940,2473
       -gencode=arch=compute_90a,code=sm_90a -Icuda/include -I"$cutlass/include"
       -I"$cutlass/tools/util/include" ${cublas_include:+-I"$cublas_include"})
mkdir -p "$out"
for source in cuda/gpu/*/check_*.cu; do
  [ -e "$source" ] || continue
  name=$(basename "$source" .cu)
  dir=$(dirname "$source")
  objects="$out/$name.objects"
  mkdir -p "$objects"
  # A reused object must be newer than every library source and header it may include.
  newest=$(ls -t $(ls "$dir"/*.cu "$dir"/*.cuh | grep -v '/check_') cuda/include/jaxfuse/*.h | head -1)
  to_compile=()
  for unit in "$dir"/*.cu; do
    built=$(ls "${REUSE_BUILD:-/nonexistent}"/CMakeFiles/*/"$unit".o 2>/dev/null | head -1 || true)
    if [ "$unit" != "$source" ] && [ -n "$built" ] && [ "$built" -nt "$newest" ]; then
      cp "$built" "$objects/$(basename "$unit" .cu).o"
    else
      to_compile+=("$unit")
    fi
  done
  printf '%s\n' "${to_compile[@]}" | xargs -P "$jobs" -I{} sh -c \
    'nvcc "$@" -I"$(dirname "$0")" -c "$0" -o "'"$objects"'/$(basename "$0" .cu).o"' {} "${flags[@]}"
  nvcc "${flags[@]}" "$objects"/*.o -o "$out/$name"
  echo "built $out/$name"
done
