#!/usr/bin/env bash
# Nsight Compute on kernels of the stand-alone grouped GEMM check (the prebuilt binary in
# .gpu_src/prebuilt/), one profile per kernel-name pattern: speed of light, warp states and
# sampled stall sources. Each profile takes the SKIP+1-th launch matching its pattern (past
# the warm-up launches) and stops the binary there. Writes, under OUTDIR, NAME.ncu-rep, the
# details page and the SASS source page as gzipped CSV (read the latter here with
# scripts/ncu_stall_table.py).
#
#   scripts/ncu_check_kernels.sh OUTDIR "CHECK ARGS" NAME=REGEX [NAME=REGEX ...]
#   scripts/ncu_check_kernels.sh OUTDIR "CHECK ARGS" --metrics NAME
#
# The second form times every launch once (JAXFUSE_CHECK_LAUNCHES=1) and collects, for every
# CUTLASS kernel launch, duration, DRAM bytes read and written and the L2 hit rate into
# OUTDIR/NAME_metrics.csv (one pass per launch: a whole --grouping-cost run in ~1 min).
#
# e.g. the grouped ping-pong forward next to CUTLASS's batched ping-pong (--grouping-cost
# launches the 64 x 512 case first):
#   scripts/ncu_check_kernels.sh $OUT/ncu "--grouping-cost" \
#     grouped=KernelPtrArrayTmaWarpSpecializedPingpong batched=KernelTmaWarpSpecializedPingpong
set -uo pipefail
cd "$(dirname "$0")/.."
out=$1 args=$2
shift 2
binary=.gpu_src/prebuilt/check_grouped_gemm
[ -x "$binary" ] || { echo "no $binary (scripts/prepare_gpu_run.sh --check)" >&2; exit 2; }
mkdir -p "$out"
status=0
if [ "${1:-}" = --metrics ]; then
  JAXFUSE_CHECK_LAUNCHES=1 timeout ${NCU_TIMEOUT:-300} ncu --clock-control none \
    --kernel-name-base demangled -k 'regex:^void cutlass::device_kernel' --csv --page raw \
    --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sector_hit_rate.pct,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_elapsed \
    "$binary" $args >"$out/$2_metrics.csv" 2>"$out/$2_metrics.log"
  status=$?
  grep PERF "$out/$2_metrics.csv" | cut -c1-120 | head -40
  exit $status
fi
for spec in "$@"; do
  name=${spec%%=*} regex=${spec#*=}
  echo "== ncu $name: $regex"
  # Clocks as the benchmarks see them (not locked to base); --kill stops the binary once
  # the launch is profiled.
  timeout ${NCU_TIMEOUT:-240} ncu --clock-control none --kernel-name-base demangled \
    -k "regex:$regex" --launch-skip ${SKIP:-5} --launch-count 1 --kill yes \
    --section SpeedOfLight --section WarpStateStats --section SourceCounters \
    --section SchedulerStats --section MemoryWorkloadAnalysis --section LaunchStats \
    -o "$out/$name" -f "$binary" $args >"$out/$name.log" 2>&1
  tail -3 "$out/$name.log"
  [ -f "$out/$name.ncu-rep" ] || { status=1; continue; }
  ncu -i "$out/$name.ncu-rep" --page details --csv | gzip >"$out/${name}_details.csv.gz"
  ncu -i "$out/$name.ncu-rep" --page source --csv --print-source sass | gzip >"$out/${name}_sass.csv.gz"
  ncu -i "$out/$name.ncu-rep" --page details | grep -E "Duration|Elapsed Cycles|Compute \(SM\) Throughput|Memory Throughput|L2 Hit|Registers|Dynamic Shared" | head -12
done
exit $status
