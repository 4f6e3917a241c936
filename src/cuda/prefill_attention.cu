// Launcher of the tensor-core prefill attention kernel (prefill_attention.cuh). Pointers that are
// not 16-byte aligned (the kernel's cp.async / vector stores need it), and more than 65535 query
// blocks, take the simple kernel.
#include <atomic>
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/engine_ops_launch.h"
#include "cuda/prefill_attention.cuh"

namespace fasttree::cuda_detail {
namespace {

bool aligned16(const void* ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 15u) == 0; }

// Raises the kernel's dynamic shared-memory limit once per device (the attribute is per device:
// tensor-parallel ranks launch it on several GPUs of one process).
template <int D>
int prepare() {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> done[kMaxDevices] = {};
  int device = 0;
  if (const cudaError_t e = cudaGetDevice(&device); e != cudaSuccess) return static_cast<int>(e);
  if (device >= 0 && device < kMaxDevices && done[device].load(std::memory_order_acquire) != 0) return cudaSuccess;
  const cudaError_t err = cudaFuncSetAttribute(prefill_attention_kernel<D>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                               PrefillConfig<D>::kSmemBytes);
  if (err == cudaSuccess && device >= 0 && device < kMaxDevices) done[device].store(1, std::memory_order_release);
  return static_cast<int>(err);
}

template <int D>
int launch(const PrefillParams& p, CUstream_st* stream) {
  if (const int err = prepare<D>(); err != cudaSuccess) return err;
  const int blocks = p.blocks != nullptr ? p.num_blocks : (p.n + PrefillConfig<D>::kM - 1) / PrefillConfig<D>::kM;
  if (blocks > 65535) return prefill_attention_simple_launch(p, stream);  // grid.y limit: n > 4M
  const float scale_log2 = p.sm_scale * 1.4426950408889634f;
  prefill_attention_kernel<D><<<dim3(p.num_q_heads, blocks), PrefillConfig<D>::kThreads, PrefillConfig<D>::kSmemBytes,
                                 stream>>>(p, scale_log2);
  return cudaGetLastError();
}

}  // namespace

int prefill_attention_launch(const PrefillParams& p, CUstream_st* stream) {
  if (!aligned16(p.q) || !aligned16(p.k_pool) || !aligned16(p.v_pool) || !aligned16(p.out))
    return prefill_attention_simple_launch(p, stream);
  switch (p.head_dim) {
    case 64: return launch<64>(p, stream);
    case 128: return launch<128>(p, stream);
    case 256: return launch<256>(p, stream);
    default: return prefill_attention_simple_launch(p, stream);
  }
}

}  // namespace fasttree::cuda_detail
