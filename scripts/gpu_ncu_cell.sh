#!/usr/bin/env bash
# Full Nsight Compute report (every section: speed of light, occupancy, warp-state stalls, memory
# tables) of the first COUNT kernels matching REGEX in one untimed, ungraphed fasttree run of one
# tree (run on the GPU machine from the repo root, binary carried):
#   bash scripts/gpu_ncu_cell.sh BIN LEVELS LENS HEADS [REGEX] [COUNT] [EXTRA BENCH ARGS...]
# e.g. bash scripts/gpu_ncu_cell.sh gpu-bin/fasttree 1,10 4000,400 16/1 "tree_attention_kernel|merge_kernel" 2
# Writes $OUT/ncu-LEVELS-HEADS.txt (the text details page).
set -uo pipefail
BIN=$1 LEVELS=$2 LENS=$3 HEADS=$4
REGEX=${5:-tree_attention_kernel|warp_staged_kernel|merge_kernel}
COUNT=${6:-3}
shift $(( $# < 6 ? $# : 6 ))
OUT=${OUT:-out}
mkdir -p "$OUT"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
tag="${LEVELS//,/-}-${HEADS//\//x}"
timeout 300 ncu ${NCU_ARGS:---set full} --kernel-name regex:"$REGEX" --launch-count "$COUNT" \
  "$BIN" bench --levels "$LEVELS" --lens "$LENS" --heads "$HEADS" --dtypes fp16 --iters 1 --warmup 0 \
  --check-queries 0 --no-graph "$@" > "$OUT/ncu-$tag.txt" 2>&1
rc=$?
grep -E "^  [a-z_]+.*\(|Duration|Registers Per|Achieved Occupancy|Warp Cycles Per Issued|DRAM Throughput" "$OUT/ncu-$tag.txt" | head -40
exit $rc
