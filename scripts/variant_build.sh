#!/usr/bin/env bash
# Builds an A/B variant of the fasttree binary that differs from BUILD's only in one tree-kernel
# translation unit, without a second full CUDA build (2-core machines: one TU ~2 min, a full CUDA
# rebuild ~10 min):
#   bash scripts/variant_build.sh BUILD LABEL SRC_ROOT [NVCC_ARGS...]
# compiles src/cuda/tree_attention_f16_d128.cu (TU=... to pick another) from SRC_ROOT/src (e.g. a
# patched copy of the tree, or this one with -DMACRO=VALUE in NVCC_ARGS) with BUILD's compile
# command, swaps it into a copy of BUILD's libfasttree_cuda.a, relinks fasttree with BUILD's link
# command and writes gpu-bin/LABEL/fasttree.gz (scripts/gpu_unpack.sh unpacks it on the device).
set -euo pipefail
build=$(realpath "$1"); label=$2; src=$(realpath "$3"); shift 3
tu=${TU:-tree_attention_f16_d128.cu}
repo=$(realpath "$(dirname "$0")/..")
work=$(mktemp -d)
cmd=$(python3 - "$build" "$tu" <<'PY'
import json, sys
for e in json.load(open(sys.argv[1] + '/compile_commands.json')):
    if e['file'].endswith('/' + sys.argv[2]): print(e['command']); break
PY
)
[ -n "$cmd" ] || { echo "no compile command for $tu in $build" >&2; exit 1; }
cmd=${cmd//-I$repo\/src/-I$src\/src}
cmd=${cmd//$repo\/src\/cuda\/$tu/$src\/src\/cuda\/$tu}
cmd=${cmd/ -o CMakeFiles*/ -o $work/$tu.o}
(cd "$build" && eval "$cmd $*")
cp "$build/libfasttree_cuda.a" "$work/libfasttree_cuda.a"
ar r "$work/libfasttree_cuda.a" "$work/$tu.o"
link=$(cd "$build" && ninja -t commands fasttree | tail -n 1)
link=${link//libfasttree_cuda.a/$work\/libfasttree_cuda.a}
link=${link/-o fasttree /-o $work\/fasttree }
(cd "$build" && eval "$link")
mkdir -p "$repo/gpu-bin/$label"
gzip -c "$work/fasttree" > "$repo/gpu-bin/$label/fasttree.gz"
rm -rf "$work"
echo "gpu-bin/$label/fasttree.gz"
