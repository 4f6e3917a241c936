#!/usr/bin/env bash
# Everything that needs the GPU machine, in one call (run there from the repo root, with the build
# folder made here by `scripts/gpu_build.sh` carried along):
#   bash scripts/gpu_run.sh BUILD_DIR COMMIT [STEPS]
# STEPS is a comma list of: check (CUDA tests + compute-sanitizer), calibrate (planner constants grid
# search; its winner, or the defaults when the winner leads them by <= 0.5 %, is passed to bench as
# flags), bench (paper suite -> CSV).
# Results land in $OUT (or ./out when OUT is unset).
set -uo pipefail
B=${1:-build-gpu}
COMMIT=${2:-unknown}
STEPS=${3:-check,calibrate,bench}
OUT=${OUT:-out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem,memory.total --format=csv | tee "$OUT/gpu.txt"
status=0
has() { [[ ",$STEPS," == *",$1,"* ]]; }
if has check; then
  echo "== CUDA tests + sanitizers =="
  # Per-step logs stay in a scratch folder (the device tool returns few files); the summary is kept.
  OUT=$(mktemp -d) GPU_CHECK_TIMING=0 GPU_CHECK_PROFILE=0 bash scripts/gpu_check.sh "$B" 2>&1 | tee "$OUT/gpu_check.log" || status=1
fi
if has calibrate; then
  echo "== calibration =="
  "$B/fasttree" calibrate --csv "$OUT/calibration.csv" --flags-out "$OUT/planner_flags.txt" 2>&1 | tee "$OUT/calibrate.log" || status=1
fi
if has bench; then
  FLAGS=""
  [[ -f "$OUT/planner_flags.txt" ]] && FLAGS=$(cat "$OUT/planner_flags.txt")
  echo "== paper suite (planner flags: ${FLAGS:-defaults}) =="
  # shellcheck disable=SC2086
  "$B/fasttree" bench --suite paper --csv "$OUT/h200-paper-suite.csv" --commit "$COMMIT" $FLAGS 2>&1 | tee "$OUT/bench.log" || status=1
fi
exit $status
