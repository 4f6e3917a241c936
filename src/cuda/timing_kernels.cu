// Kernels of the timing harness (cuda/timing.cpp): an empty kernel (the cost of a launch), the
// L2 flush by reads, and the deterministic random fill of benchmark inputs.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "cuda/kernels.h"

namespace fasttree::cuda_detail {

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

__global__ void empty_kernel() {}

// One thread sleeps until `ns` nanoseconds of %globaltimer have passed.
__global__ void delay_kernel(int64_t ns) {
  uint64_t t0, t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  do {
    __nanosleep(10000);
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  } while (static_cast<int64_t>(t - t0) < ns);
}

// Reads n 16-byte words once (grid-stride). The store happens only if the XOR of everything read
// equals a fixed 128-bit constant; it keeps the loads alive.
__global__ void read_flush_kernel(const uint4* __restrict__ data, int64_t n, uint4* sink) {
  uint4 acc = make_uint4(0, 0, 0, 0);
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const uint4 x = data[i];
    acc.x ^= x.x;
    acc.y ^= x.y;
    acc.z ^= x.z;
    acc.w ^= x.w;
  }
  if (acc.x == 0x9e3779b9u && acc.y == 0x7f4a7c15u && acc.z == 0x85ebca6bu && acc.w == 0xc2b2ae35u) *sink = acc;
}

}  // namespace

int delay_kernel_launch(int64_t ns, CUstream_st* stream) {
  if (ns < 0 || ns > int64_t{10} * 1000 * 1000 * 1000) return cudaErrorInvalidValue;
  delay_kernel<<<1, 1, 0, stream>>>(ns);
  return cudaGetLastError();
}

int read_flush_launch(const void* data, int64_t bytes, void* sink, int grid, CUstream_st* stream) {
  if (bytes < 16 || bytes % 16 != 0 || grid < 1) return cudaErrorInvalidValue;
  read_flush_kernel<<<grid, 512, 0, stream>>>(static_cast<const uint4*>(data), bytes / 16, static_cast<uint4*>(sink));
  return cudaGetLastError();
}

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
