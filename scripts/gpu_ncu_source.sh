#!/usr/bin/env bash
# Per-SASS-instruction warp-stall samples (ncu source page, CSV) of the first kernel matching REGEX
# in one untimed, ungraphed fasttree run of one tree (run on the GPU machine from the repo root):
#   bash scripts/gpu_ncu_source.sh BIN LEVELS LENS HEADS [REGEX] [EXTRA BENCH ARGS...]
# Writes $OUT/sass-LEVELS-HEADS.csv (+ the details page as $OUT/details-LEVELS-HEADS.txt).
set -uo pipefail
BIN=$1 LEVELS=$2 LENS=$3 HEADS=$4
REGEX=${5:-tree_attention_kernel}
shift $(( $# < 5 ? $# : 5 ))
OUT=${OUT:-out}
mkdir -p "$OUT"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
tag="${LEVELS//,/-}-${HEADS//\//x}"
rep=$(mktemp -d)/r
timeout 300 ncu --set full --import-source no --kernel-name regex:"$REGEX" --launch-count 1 -o "$rep" \
  "$BIN" bench --levels "$LEVELS" --lens "$LENS" --heads "$HEADS" --dtypes fp16 --iters 1 --warmup 0 \
  --check-queries 0 --no-graph "$@" > /dev/null 2>&1
rc=$?
ncu -i "$rep.ncu-rep" --page details > "$OUT/details-$tag.txt" 2>&1
ncu -i "$rep.ncu-rep" --page source --csv --print-source sass > "$OUT/sass-$tag.csv" 2>&1
grep -E "Duration|Warp Cycles Per Issued|Issue Slots Busy|Eligible Warps|No Eligible" "$OUT/details-$tag.txt" | head
exit $rc
