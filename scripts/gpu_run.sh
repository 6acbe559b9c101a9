#!/usr/bin/env bash
# One complete GPU run on the H200 (the device machine): build jaxfuse there against its
# jaxlib, run the gpu-marked tests, the benchmarks and the stand-alone checks, and leave
# logs and result JSON under $OUT (at most 8 files come back: everything is tarred).
#
#   scripts/gpu_run.sh [build|prebuilt] [test] [bench] [sanitize] [check] [NAME.py ...]
#
# With no stage named, runs build test bench. Wheels missing on the machine (nvidia-cutlass)
# travel in .whl/ (carry it). Every later GPU claim in this repository comes from this script.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}
# Run on a committed tree only (what the results cite), not on uncommitted work that
# traveled with the working tree: scripts/prepare_gpu_run.sh packs `git archive HEAD` into
# .gpu_src/ (carry it); git history itself does not travel to the device machine.
if [ -f .gpu_src/head.tar ] && [ "${GPU_RUN_FROM_WORKTREE:-0}" != 1 ]; then
  export JAXFUSE_COMMIT=$(cat .gpu_src/COMMIT)
  rm -rf /tmp/jaxfuse-head && mkdir -p /tmp/jaxfuse-head
  tar xf .gpu_src/head.tar -C /tmp/jaxfuse-head
  [ -d .whl ] && cp -r .whl /tmp/jaxfuse-head/
  mkdir -p /tmp/jaxfuse-head/.gpu_src && cp .gpu_src/COMMIT /tmp/jaxfuse-head/.gpu_src/
  [ -d .gpu_src/prebuilt ] && cp -r .gpu_src/prebuilt /tmp/jaxfuse-head/.gpu_src/
  # Keep the build directory between calls on a warm machine.
  mkdir -p build && ln -sfn "$PWD/build" /tmp/jaxfuse-head/build
  cd /tmp/jaxfuse-head && exec env GPU_RUN_FROM_WORKTREE=1 OUT="$OUT" bash scripts/gpu_run.sh "$@"
fi
LOGS=/tmp/gpu_run_logs  # tarred into $OUT at the end (few files may come back)
rm -rf "$LOGS" && mkdir -p "$LOGS" "$OUT"
touch /tmp/gpu_run_started  # results newer than this were written by this run
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
stages=("$@")
[ ${#stages[@]} -eq 0 ] && stages=(build test bench)
status=0

log() { echo "== $(date -u +%H:%M:%S) $*" | tee -a "$OUT/summary.txt"; }

if compgen -G ".whl/*.whl" >/dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
# Optional benchmark baselines (scripts/fetch_bench_wheels.sh: tokamax and what it imports)
# go into a directory of their own: benchmarks append it to sys.path (JAXFUSE_BENCH_SITE),
# so the tests and the image's own packages never see them.
if compgen -G ".whl/bench/*.whl" >/dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site_bench .whl/bench/*.whl && export JAXFUSE_BENCH_SITE=/tmp/site_bench
fi
export JAXFUSE_COMMIT=${JAXFUSE_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
log "commit $JAXFUSE_COMMIT; $(nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader 2>/dev/null)"

for stage in "${stages[@]}"; do
  case "$stage" in
    build)
      log "build"
      # The machine's jaxlib provides the FFI headers; no build isolation.
      CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-16} \
        $PY -m pip install --no-build-isolation --no-deps -v -e . >"$LOGS/build.log" 2>&1 \
        || { status=1; log "BUILD FAILED"; tail -50 "$LOGS/build.log"; break; }
      $PY -c "import jaxfuse, json; print(json.dumps(jaxfuse.build_info()))" | tee -a "$OUT/summary.txt"
      ;;
    prebuilt)
      # The extension built on the dev machine (scripts/prepare_gpu_run.sh --prebuilt: the
      # same nvcc and jaxlib headers; it saves the ~4 min CUDA build of a cold machine).
      # It lands next to the sources, which take precedence on sys.path over any install.
      whl=$(ls .gpu_src/prebuilt/jaxfuse-*.whl 2>/dev/null | head -1)
      [ -n "$whl" ] || { status=1; log "no prebuilt wheel in .gpu_src/prebuilt"; break; }
      log "prebuilt extension from $(basename "$whl") (cuda/ tree $(cat .gpu_src/prebuilt/CUDA_TREE))"
      $PY - "$whl" <<'PYEOF' || { status=1; log "PREBUILT FAILED"; break; }
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as wheel:
  for name in wheel.namelist():
    if name.startswith("jaxfuse/") and name.endswith(".so"):
      wheel.extract(name, ".")
      print("extracted", name)
PYEOF
      $PY -c "import jaxfuse, json; print(json.dumps(jaxfuse.build_info()))" | tee -a "$OUT/summary.txt"
      ;;
    test)
      # GPU_TESTS narrows the run (e.g. "tests/ops/test_quantize.py"); default: all tests.
      # GPU_TESTS_K is a pytest -k expression, kept whole (GPU_TESTS is split at spaces).
      # TEST_WORKERS > 1 spreads the tests over that many pytest-xdist processes on the one
      # GPU (most of a test's time is XLA's compile, on the CPU; the pytest-xdist and execnet
      # wheels travel in .whl/: scripts/fetch_test_wheels.sh). Each process then allocates
      # GPU memory as it goes, not 75% of it up front.
      workers=() test_env=()
      if [ "${TEST_WORKERS:-1}" -gt 1 ] && $PY -c "import xdist" 2>/dev/null; then
        workers=(-n "$TEST_WORKERS") test_env=(XLA_PYTHON_CLIENT_PREALLOCATE=false)
      fi
      select=()
      [ -n "${GPU_TESTS_K:-}" ] && select=(-k "$GPU_TESTS_K")
      log "pytest -m gpu ${workers[*]} ${GPU_TESTS:-tests} ${GPU_TESTS_K:+-k \"$GPU_TESTS_K\"}"
      # SIGINT at the limit: pytest then stops and still prints what passed and failed (a
      # plain kill in session 51 lost the summary of a run whose last test had reported).
      # The JUnit XML names every test that finished: one cut off by the limit is the one
      # missing from it (-q names none; session 53).
      timeout -s INT -k 30 ${TEST_TIMEOUT:-420} env "${test_env[@]}" $PY -m pytest -m gpu -q -p no:cacheprovider -rfEs --durations=15 --junitxml="$LOGS/gpu_tests.xml" "${workers[@]}" "${select[@]}" ${GPU_TESTS:-tests} 2>&1 | tee "$LOGS/gpu_tests.log" | tail -40
      [ "${PIPESTATUS[0]}" -eq 0 ] || { status=1; log "GPU TESTS FAILED"; }
      ;;
    bench)
      # BENCHMARKS narrows the set (e.g. "bench_grouped_mlp"); default: every bench_*.py.
      # An entry NAME:ARGS passes its own arguments (commas for spaces), e.g.
      # "bench_moe:--quick profile_kernels:--tag,default"; otherwise BENCH_ARGS. Leading
      # VAR=VALUE: fields set environment variables for that entry only (a knob sweep), e.g.
      # "JAXFUSE_ROWWISE_MAX_THREADS=512:bench_activations:--tag,threads512".
      for entry in ${BENCHMARKS:-benchmarks/bench_*.py}; do
        entry_env=()
        while [[ "${entry%%:*}" == *=* ]]; do entry_env+=("${entry%%:*}"); entry=${entry#*:}; done
        script=${entry%%:*}
        script_args=${BENCH_ARGS:-}
        [[ "$entry" == *:* ]] && script_args=${entry#*:} && script_args=${script_args//,/ }
        [[ "$script" == */* ]] || script="benchmarks/$script.py"
        name=$(basename "$script" .py)
        log "benchmark $name $script_args ${entry_env[*]}"
        timeout ${BENCH_TIMEOUT:-300} env "${entry_env[@]}" $PY -m "benchmarks.$name" $script_args 2>&1 | tee -a "$LOGS/$name.log" | tail -25
        [ "${PIPESTATUS[0]}" -eq 0 ] || { status=1; log "BENCHMARK $name FAILED"; }
        # Archive results as they appear: they come back even if a later step runs out of
        # time, and as one file (at most 8 files come back from $OUT).
        new=$(cd benchmarks/results && find . -newer /tmp/gpu_run_started \( -name '*.json' -o -name '*.png' \))
        [ -z "$new" ] || tar czf "$OUT/results.tar.gz" -C benchmarks/results $new
      done
      ;;
    sanitize)
      # Edge-case GPU tests (hostile or empty group sizes, zero rows, NaN/Inf, many groups)
      # of every kernel family under memcheck. SANITIZE_K narrows or widens the selection;
      # -k also matches markers, so tests marked `sanitize` always run. SANITIZE_FILES
      # narrows the test files (default: every tests/ops/test_*.py). The permute kernel
      # variants' bit-exactness test is left out by default: it runs eight JAX processes,
      # which under memcheck took more than the 100 s left to it in session 38.
      sel=${SANITIZE_K:-"(sanitize or hostile or empty_groups or rows_past or zero_rows or nan or many_groups or many_rows or multi_uses or permute or unpermute) and not xla and not permute_kernel_variants"}
      log "compute-sanitizer memcheck: -m gpu -k '$sel', one process per test file"
      # XLA's default allocator sub-allocates one big pool, inside which memcheck sees no
      # out-of-bounds access: the platform allocator gives every buffer its own allocation.
      # XLA's CUDA graphs are kept out. One process per file with test names (-v): the
      # sanitized process has segfaulted mid-run (97f44ec0 after 14 tests, d11141b after 59),
      # which must cost one file's verdict, not all of them, and name the test it was in.
      deadline=$(( $(date +%s) + ${SANITIZE_TIMEOUT:-300} ))
      # SANITIZE_FILES=none runs check_grouped_gemm alone.
      files=${SANITIZE_FILES:-tests/ops/test_*.py}
      [ "$files" = none ] && files=
      for file in $files; do
        name=$(basename "$file" .py)
        left=$(( deadline - $(date +%s) ))
        [ $left -gt 20 ] || { log "sanitizer: out of time before $name"; status=1; break; }
        sanitize_file() {  # $1: log path, $2: seconds left
          XLA_PYTHON_CLIENT_ALLOCATOR=platform XLA_FLAGS="--xla_gpu_enable_command_buffer=" \
            timeout "$2" compute-sanitizer --tool memcheck --target-processes all --error-exitcode 9 \
            $PY -m pytest -m gpu -k "$sel" -v -p no:cacheprovider "$file" >"$1" 2>&1
        }
        sanitize_file "$LOGS/sanitizer_$name.log" $left
        rc=$?
        [ $rc -eq 5 ] && continue  # no test of this file is selected
        # The sanitized JAX process has segfaulted on the host side (3 of 6 runs in session
        # 43, at a different test each time, with no memcheck report): a crash without an
        # ERROR SUMMARY gets one more run, and both logs are kept (the first as .crashed).
        left=$(( deadline - $(date +%s) ))
        if [ $rc -ne 0 ] && [ $rc -ne 124 ] && [ $left -gt 20 ] &&
           ! grep -q "ERROR SUMMARY" "$LOGS/sanitizer_$name.log"; then
          log "sanitizer $name: rc=$rc without a memcheck summary (last test: $(grep -oE "^tests/[^ ]+" "$LOGS/sanitizer_$name.log" | tail -1)); running it again"
          mv "$LOGS/sanitizer_$name.log" "$LOGS/sanitizer_$name.crashed.log"
          sanitize_file "$LOGS/sanitizer_$name.log" $left
          rc=$?
        fi
        errors=$(grep -E "ERROR SUMMARY" "$LOGS/sanitizer_$name.log" | tail -1)
        tests=$(grep -E "[0-9]+ (passed|failed)" "$LOGS/sanitizer_$name.log" | tail -1)
        last=$(grep -oE "^tests/[^ ]+" "$LOGS/sanitizer_$name.log" | tail -1)
        log "sanitizer $name: rc=$rc ${errors:-no summary} ${tests:-no pytest summary} (last test: $last)"
        [ $rc -eq 0 ] || status=1
      done
      # The grouped GEMM's own hostile-layout cases, without JAX in the process
      # (SANITIZE_CHECK_ARGS picks a mode, e.g. "--wgrad-configs --no-perf").
      if [ -x .gpu_src/prebuilt/check_grouped_gemm ]; then
        log "compute-sanitizer memcheck: check_grouped_gemm ${SANITIZE_CHECK_ARGS:---no-perf}"
        timeout ${SANITIZE_TIMEOUT:-300} compute-sanitizer --tool memcheck --error-exitcode 9 \
          .gpu_src/prebuilt/check_grouped_gemm ${SANITIZE_CHECK_ARGS:---no-perf} >"$LOGS/sanitizer_check.log" 2>&1
        rc=$?; tail -5 "$LOGS/sanitizer_check.log" | tee -a "$OUT/summary.txt"
        [ $rc -eq 0 ] || { status=1; log "SANITIZER (check_grouped_gemm) FAILED rc=$rc"; }
      fi
      ;;
    check)
      # Stand-alone checks: a binary prebuilt on the dev machine (.gpu_src/prebuilt/NAME,
      # see scripts/build_check.sh) or built here; CHECK_ARGS go to every binary (e.g.
      # --sweep-scheduler for check_grouped_gemm); CHECK_TIMEOUT (s, default 420) bounds
      # each binary, so that the logs still come back from a call near its time limit.
      # Without JAX in the process, the nvidia wheels' libraries (cuBLASLt for
      # --cublaslt-grouped) are on no default path.
      wheel_libs=$($PY -c "import nvidia, os; print(':'.join(os.path.join(p, s) for p in nvidia.__path__ for s in ('cu13/lib', 'cublas/lib') if os.path.isdir(os.path.join(p, s))))" 2>/dev/null)
      export LD_LIBRARY_PATH=${wheel_libs}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
      log "nvidia-cublas $($PY -m pip show nvidia-cublas 2>/dev/null | grep -i '^version'); LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
      # Whether this cuBLASLt has the grouped batch mode (device shapes; newer than 13.1).
      log "cublasLt.h batch modes: $(grep -ho 'CUBLASLT_BATCH_MODE_[A-Z_]* = [0-9]' /usr/local/cuda/include/cublasLt.h 2>/dev/null | tr '\n' ' ')"
      for source in cuda/gpu/*/check_*.cu; do
        [ -e "$source" ] || continue
        name=$(basename "$source" .cu)
        binary=.gpu_src/prebuilt/$name
        if [ ! -x "$binary" ]; then
          log "building $name"
          bash scripts/build_check.sh /tmp/checks "$PY" >"$LOGS/$name.build.log" 2>&1 \
            || { status=1; log "BUILD OF $name FAILED"; tail -20 "$LOGS/$name.build.log"; continue; }
          binary=/tmp/checks/$name
        fi
        log "stand-alone $name ${CHECK_ARGS:-}"
        timeout ${CHECK_TIMEOUT:-420} "$binary" ${CHECK_ARGS:-} 2>&1 | tee "$LOGS/$name.log" | tail -60
        [ "${PIPESTATUS[0]}" -eq 0 ] || { status=1; log "$name FAILED"; }
      done
      ;;
    *.py)
      # Examples and scripts import jaxfuse from this tree (the prebuilt extension lands here).
      log "script $stage"
      PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} timeout ${SCRIPT_TIMEOUT:-300} $PY "$stage" 2>&1 \
        | tee "$LOGS/$(basename "$stage" .py).log" | tail -30
      [ "${PIPESTATUS[0]}" -eq 0 ] || { status=1; log "SCRIPT $stage FAILED"; }
      ;;
    *) log "unknown stage $stage"; status=1 ;;
  esac
done

# All logs as one archive (results are already in $OUT/results.tar.gz).
tar czf "$OUT/logs.tar.gz" -C "$(dirname "$LOGS")" "$(basename "$LOGS")"
log "done status=$status" 2>/dev/null || echo "done status=$status"
exit $status
