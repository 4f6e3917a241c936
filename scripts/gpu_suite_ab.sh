#!/usr/bin/env bash
# A/B timing of kernel variants on the paper suite, in one device call (run there from the repo root):
#   bash scripts/gpu_suite_ab.sh [tests] LABEL=BINARY[:VAR=VALUE...][@ARG@ARG...] ...
# (@ARG: extra arguments of fasttree bench, e.g. new=gpu-bin/fasttree@--kv-layout@head; SUITE_ARGS
# replaces the default "--suite paper --dtypes fp16", e.g. to time one tree.)
# "tests" first runs the CUDA attention tests and compute-sanitizer (memcheck, racecheck, synccheck)
# on their small case with the first variant's test binary (BINARY with fasttree -> fasttree_tests).
# Then each variant runs `fasttree bench --suite paper --dtypes fp16` (every cell also checked against
# the fp64 reference) with the given environment, writing $OUT/suite-LABEL.csv; the variants run
# interleaved cell range by cell range is not needed: each suite takes about a minute, all in one session.
# scripts/suite_compare.py prints the per-cell table and geomeans of the CSVs side by side.
set -uo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
status=0
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader | tee "$OUT/gpu.txt"
if [ "${1:-}" = tests ]; then
  shift
  first=${1#*=}; first=${first%%:*}; tests=${first%/*}/fasttree_tests
  echo "=== tests ($tests)"
  timeout 300 "$tests" --gtest_filter='CudaAttention.*' > "$OUT/attention-tests.log" 2>&1 || status=1
  grep -E "^\[  (PASSED|FAILED) |FAILED  \]" "$OUT/attention-tests.log"
  for tool in memcheck racecheck synccheck; do
    if timeout 200 compute-sanitizer --tool $tool --error-exitcode 1 "$tests" --gtest_filter='CudaAttention.SanitizerSmall' \
      > "$OUT/$tool.log" 2>&1; then keep=0; else keep=1; status=1; fi
    echo "=== $tool: $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/$tool.log" | tail -1) $(grep -cE '^\[       OK' "$OUT/$tool.log") ok"
    [ "$keep" = 1 ] || rm -f "$OUT/$tool.log"  # the device tool returns few files: failures only
  done
fi
for spec in "$@"; do
  label=${spec%%=*}; rest=${spec#*=}
  IFS=@ read -r -a words <<< "$rest"
  IFS=: read -r -a parts <<< "${words[0]}"
  bin=${parts[0]}; envs=("${parts[@]:1}"); extra=("${words[@]:1}")
  echo "=== suite $label: $bin ${envs[*]:-} ${extra[*]:-}"
  t0=$SECONDS
  # shellcheck disable=SC2086
  env "${envs[@]}" "$bin" bench ${SUITE_ARGS:---suite paper --dtypes fp16} "${extra[@]}" --csv "$OUT/suite-$label.csv" \
    --commit "$label" > "$OUT/suite-$label.log" 2>&1 || status=1
  echo "    $(tail -n 1 "$OUT/suite-$label.log") ($((SECONDS - t0)) s)"
  [ -n "${KEEP_LOGS:-}" ] || rm -f "$OUT/suite-$label.log"
done
exit $status
