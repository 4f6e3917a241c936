#!/usr/bin/env bash
# Fresh machine -> installs missing packages, builds, runs the main job: the planner and the CPU
# attention on one of the paper's trees, printing what was shared and the error vs fp64.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
scripts/build.sh
ft=build/fasttree
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
echo "== fasttree plan: paper tree levels 1,16,64 lens 1024,256,32, heads 32/8 =="
$ft plan --levels 1,16,64 --lens 1024,256,32 --heads 32/8 --head-dim 128
echo
echo "== fasttree attention (CPU plan executor) on the same tree, random Q/K/V, checked vs fp64 =="
$ft gen-tree --levels 1,16,64 --lens 1024,256,32 --out "$tmp/tree.json" --tensors "$tmp" --heads 32/8 --head-dim 128 --seed 7
$ft attention --tree "$tmp/tree.json" --q "$tmp/q.npy" --k "$tmp/k.npy" --v "$tmp/v.npy" --out "$tmp/o.npy" --lse "$tmp/lse.npy" --check
echo "wrote $(du -h "$tmp/o.npy" | cut -f1) of output; done"
echo
echo "== fasttree bench-e2e (CPU engine, tiny random model, workload D scaled down; a functional demo, the timings of a 2-layer model mean nothing) =="
$ft bench-e2e --backend cpu --preset tiny --workload D --scale small --max-new-tokens 8 --attention both --no-progress
