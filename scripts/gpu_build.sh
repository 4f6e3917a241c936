#!/usr/bin/env bash
# Builds here (no GPU needed) the binaries that run on the GPU machine: sm_90a, static cudart,
# static libstdc++/libgcc, into build-gpu/ (carry it to the device and run scripts/gpu_run.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${BUILD_DIR:-build-gpu} scripts/build.sh -DFASTTREE_STATIC_RUNTIME=ON -DCMAKE_CUDA_ARCHITECTURES=90a
for b in fasttree fasttree_tests; do  # planner_bench needs the shared libbenchmark: it stays here
  if ldd "build-gpu/$b" | grep -vE "linux-vdso|libc\.so|libm\.so|ld-linux|libpthread|libdl|librt" | grep -q "=>"; then
    echo "build-gpu/$b links libraries the GPU machine lacks:"; ldd "build-gpu/$b"; exit 1
  fi
done
echo "build-gpu ready"
