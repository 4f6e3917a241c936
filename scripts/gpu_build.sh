#!/usr/bin/env bash
# Builds here (no GPU needed) the binaries that run on the GPU machine: sm_90a, static cudart,
# static libstdc++/libgcc, into build-gpu/ (or $BUILD_DIR; carry it to the device and run
# scripts/gpu_run.sh).
# Shared libraries allowed besides libc's: cuBLAS (libcublas.so.13, libcublasLt.so.13, which pull
# in libgcc_s) and NCCL (libnccl.so.2, when CMake found it in the toolkit; it pulls in libstdc++), which the toolkit has no
# static builds of; the binaries carry an rpath to /usr/local/cuda/lib64 (and the toolkit's library
# folder), where the GPU machine's CUDA 13 toolkit keeps them (else set LD_LIBRARY_PATH).
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${BUILD_DIR:-build-gpu}
# Extra arguments go to cmake, e.g. an A/B variant: BUILD_DIR=build-gpu-b scripts/gpu_build.sh
# -DCMAKE_CUDA_FLAGS=-DFT_TREE_WGMMA=1 (cmake keeps them in the build folder's cache).
BUILD_DIR=$BUILD_DIR scripts/build.sh -DFASTTREE_STATIC_RUNTIME=ON -DCMAKE_CUDA_ARCHITECTURES=90a "$@"
for b in fasttree fasttree_tests; do  # planner_bench needs the shared libbenchmark: it stays here
  ldd "$BUILD_DIR/$b" >/dev/null  # fails (and stops the script) when the binary is missing
  if ldd "$BUILD_DIR/$b" | grep -vE "linux-vdso|libc\.so|libm\.so|ld-linux|libpthread|libdl|librt|libcublas\.so|libcublasLt\.so|libgcc_s\.so|libstdc\+\+\.so|libnccl\.so" | grep -q "=>"; then
    echo "$BUILD_DIR/$b links libraries the GPU machine lacks:"; ldd "$BUILD_DIR/$b"; exit 1
  fi
  # libstdc++ / libgcc_s may only come in through NCCL or cuBLAS, never as our own direct dependency.
  if readelf -d "$BUILD_DIR/$b" | grep NEEDED | grep -qE "libstdc\+\+|libgcc_s"; then
    echo "$BUILD_DIR/$b needs the shared libstdc++/libgcc_s directly (static runtime expected)"; exit 1
  fi
done
echo "$BUILD_DIR ready"
