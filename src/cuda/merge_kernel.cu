// Launcher of the merge kernel (merge_kernel.cuh) and the random-fill kernel used by benchmarks.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "cuda/kernels.h"
#include "cuda/merge_kernel.cuh"

namespace fasttree::cuda_detail {

namespace {

template <int D>
int launch_merge(const MergeParams& params, int grid, CUstream_st* stream, bool pdl, bool wide) {
  const auto kernel = wide ? merge_kernel_wide<D> : merge_kernel<D>;
  if (!pdl) {
    kernel<<<grid, kMergeThreads, 0, stream>>>(params);
    return cudaGetLastError();
  }
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(static_cast<unsigned>(grid));
  cfg.blockDim = dim3(kMergeThreads);
  cfg.dynamicSmemBytes = 0;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  return cudaLaunchKernelEx(&cfg, kernel, params);
}

}  // namespace

int merge_kernel_launch(int head_dim, const MergeParams& params, int grid, CUstream_st* stream, bool pdl, bool wide) {
  switch (head_dim) {
    case 64: return launch_merge<64>(params, grid, stream, pdl, wide);
    case 128: return launch_merge<128>(params, grid, stream, pdl, wide);
    case 256: return launch_merge<256>(params, grid, stream, pdl, wide);
    default: return cudaErrorInvalidValue;
  }
}

namespace {

// x[i] = uniform [-1, 1) from a 64-bit mix of (seed, i) (splitmix64 finalizer).
template <class T>
__global__ void fill_uniform_kernel(T* x, int64_t n, uint64_t seed) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    uint64_t z = seed + 0x9e3779b97f4a7c15ull * static_cast<uint64_t>(i + 1);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    const float u = static_cast<float>(z >> 40) * (1.0f / 16777216.0f);  // [0, 1)
    x[i] = static_cast<T>(2.0f * u - 1.0f);
  }
}

}  // namespace

namespace {
__global__ void empty_kernel() {}
}  // namespace

int empty_kernel_launch(int grid, CUstream_st* stream) {
  empty_kernel<<<grid, 32, 0, stream>>>();
  return cudaGetLastError();
}

int fill_uniform_launch(int dtype, void* data, int64_t n, uint64_t seed, CUstream_st* stream) {
  if (n <= 0) return cudaSuccess;
  const int grid = static_cast<int>(std::min<int64_t>((n + 255) / 256, 4096));
  if (dtype == kDTypeF16) {
    fill_uniform_kernel<<<grid, 256, 0, stream>>>(static_cast<__half*>(data), n, seed);
  } else {
    fill_uniform_kernel<<<grid, 256, 0, stream>>>(static_cast<__nv_bfloat16*>(data), n, seed);
  }
  return cudaGetLastError();
}

}  // namespace fasttree::cuda_detail
