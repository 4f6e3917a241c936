#!/usr/bin/env bash
# Per-kernel profile of the paper suite (run on the GPU machine from the repo root, build carried):
#   bash scripts/gpu_profile.sh BUILD_DIR [ONLY]
# Nsight Compute times every tree-attention, warp-unit and merge kernel launch of one untimed,
# ungraphed run per cell and plan variant (fp16; ncu serializes the launches and flushes the caches
# before each), with the DRAM bytes each moved. Output: $OUT/ncu.csv (one row per kernel x metric)
# and $OUT/suite-prof.csv (the bench's own rows, for the cell order; ncu.csv lists the launches in
# that order). ONLY: a --only filter of fasttree bench (default: every cell).
set -uo pipefail
B=${1:-build-gpu}
ONLY=${2:-}
OUT=${OUT:-out}
mkdir -p "$OUT"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
args=(bench --suite paper --dtypes fp16 --iters 1 --warmup 0 --check-queries 0 --no-graph --csv "$OUT/suite-prof.csv")
[ -n "$ONLY" ] && args+=(--only "$ONLY")
ncu --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum \
  --kernel-name regex:"tree_attention_kernel|merge_kernel|warp_unit_kernel" --csv --log-file "$OUT/ncu.csv" \
  "$B/fasttree" "${args[@]}" > "$OUT/profile.log" 2>&1
rc=$?
tail -n 5 "$OUT/profile.log"
exit $rc
