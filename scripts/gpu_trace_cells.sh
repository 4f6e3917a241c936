#!/usr/bin/env bash
# Timeline and per-step sums of the tree kernel on a few cells (run on the GPU machine from the repo
# root, a trace build carried: BUILD_DIR=build-trace scripts/gpu_build.sh -DFASTTREE_TRACE=ON):
#   bash scripts/gpu_trace_cells.sh [BUILD_DIR] [CTAS_PER_SM...]
# For each cell below and each CTAs-per-SM setting (FT_MAIN_CTAS; default "1 2") it runs one
# `fasttree bench --diag` (fp16, checked against the fp64 reference) and prints the trace lines:
# medians over CTAs of the timeline marks (us after the first CTA started) and of the per-CTA sums
# (waits and issue time in us, the producer's steps and the consumer's tile time in kilocycles;
# cuda/device_plan.h TraceTreeEvent). CELLS (env) replaces the cell list: lines "LEVELS LENS HEADS".
set -uo pipefail
B=${1:-build-trace}
shift || true
CTAS=${*:-1 2}
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
CELLS=${CELLS:-"1,1024 2048,32 32/8
1,1024 2048,32 16/1
1,16,32,64,128,1024 256,128,64,16,16,16 16/1
1,4,8,256 8,256,256,32 16/1"}
status=0
while read -r levels lens heads; do
  [ -n "$levels" ] || continue
  for c in $CTAS; do
    echo "=== $levels | $lens $heads, $c CTA(s) per SM"
    FT_MAIN_CTAS=$c timeout 120 "$B/fasttree" bench --levels "$levels" --lens "$lens" --heads "$heads" --dtypes fp16 \
      --iters 10 --check-queries 4 --diag > /tmp/trace-cell.log 2>&1 || status=1
    grep -E "trace |sum |fp16 " /tmp/trace-cell.log
  done
done <<< "$CELLS"
exit $status
