#!/usr/bin/env bash
# GPU checks, run ON the GPU machine from the repository root with an already-built folder:
#   bash scripts/gpu_check.sh [build-dir]        (default build-cuda)
# 1. the CUDA tests (CudaAttention.*), 2. compute-sanitizer memcheck and 3. racecheck on a small
# subset, 4. (unless GPU_CHECK_TIMING=0) the timing table of the paper's suite (45 cells, fused and
# separate merge; FT_TIMING_ONLY / FT_TIMING_ITERS narrow it, see the test), 5. (unless
# GPU_CHECK_PROFILE=0) Nsight Compute on one cell. A step that
# times out (a hang) skips the steps after it. Logs go to $OUT when set (the device tool's result
# folder), else to ./gpu_check_logs. Prints a summary last; exits non-zero when a step failed.
set -uo pipefail
BUILD=${1:-build-cuda}
TESTS="$BUILD/fasttree_tests"
LOGS=${OUT:-gpu_check_logs}
mkdir -p "$LOGS"
SMALL='CudaAttention.SanitizerSmall:CudaAttention.EmptyPathsAndEmptyPlan:CudaEngineOps.*Small*'
SUMMARY=()
status=0
hung=0

step() {  # step NAME TIMEOUT_S COMMAND...
  local name=$1 limit=$2
  shift 2
  if [ "$hung" -ne 0 ]; then
    SUMMARY+=("$(printf '%-10s skipped (an earlier step timed out)' "$name")")
    return 0
  fi
  echo "=== $name: $*"
  local t0=$SECONDS
  timeout "$limit" "$@" >"$LOGS/$name.log" 2>&1
  local rc=$?
  tail -n 20 "$LOGS/$name.log"
  local verdict
  verdict=$(grep -E '^\[  PASSED|^\[  FAILED|ERROR SUMMARY|RACECHECK SUMMARY' "$LOGS/$name.log" | sort -u | tr '\n' ' ' | cut -c1-160)
  SUMMARY+=("$(printf '%-10s rc=%-3s %4ss  %s' "$name" "$rc" "$((SECONDS - t0))" "$verdict")")
  [ "$rc" -ne 0 ] && status=1
  [ "$rc" -eq 124 ] && hung=1
  return 0
}

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader || true
[ -x "$TESTS" ] || { echo "missing $TESTS (build with -DFASTTREE_STATIC_RUNTIME=ON and carry it)"; exit 2; }

step tests 100 "$TESTS" --gtest_filter='CudaAttention.*'
step memcheck 90 compute-sanitizer --tool memcheck --error-exitcode 3 "$TESTS" --gtest_filter="$SMALL"
step racecheck 90 compute-sanitizer --tool racecheck --racecheck-report analysis --print-limit 30 \
  --error-exitcode 3 "$TESTS" --gtest_filter='CudaAttention.SanitizerSmall'
step synccheck 90 compute-sanitizer --tool synccheck --error-exitcode 3 "$TESTS" --gtest_filter='CudaAttention.SanitizerSmall'
if [ "${GPU_CHECK_TIMING:-1}" != 0 ]; then
  # SM clock / power every 50 ms while timing (the numbers mean little if the clocks never rose).
  nvidia-smi --query-gpu=clocks.sm,clocks.mem,power.draw --format=csv,noheader -lms 50 >"$LOGS/clocks.log" 2>&1 &
  smi=$!
  step timing 240 "$TESTS" --gtest_also_run_disabled_tests --gtest_filter='CudaAttention.DISABLED_Timing*'
  kill "$smi" 2>/dev/null
  wait "$smi" 2>/dev/null
  awk -F', ' '{gsub(/ MHz/, "", $1); n++; s += $1; if (min == "" || $1 < min) min = $1; if ($1 > max) max = $1}
    END {if (n) printf "SM clock during timing: min %d, mean %d, max %d MHz over %d samples\n", min, s / n, max, n}' \
    "$LOGS/clocks.log" | tee -a "$LOGS/timing.log"
  SUMMARY+=("$(tail -n 1 "$LOGS/timing.log")")
fi

if [ "${GPU_CHECK_PROFILE:-1}" != 0 ] && command -v ncu >/dev/null; then
  # Nsight Compute on one tree-kernel launch (clocks left alone; FT_PROFILE_CELL picks the cell, see
  # the test); full report in ncu.txt.
  step profile 150 ncu --clock-control none --set full --print-details all --kernel-name regex:tree_attention_kernel \
    --launch-count 1 "$TESTS" --gtest_also_run_disabled_tests --gtest_filter='CudaAttention.DISABLED_ProfileOneCell'
  mv "$LOGS/profile.log" "$LOGS/ncu.txt" 2>/dev/null
  grep -E "tree_attention_kernel|^    Duration|DRAM Throughput|Memory Throughput|Compute \(SM\) Throughput|Issue Slots Busy|Warp Cycles Per Issued|Achieved Occupancy|Registers Per|No Eligible|Stall" \
    "$LOGS/ncu.txt" | head -n 60
fi

echo "=== summary"
for line in "${SUMMARY[@]}"; do echo "$line"; done
exit $status
