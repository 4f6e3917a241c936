// CUDA backend entry points (runtime API only; never links libcuda directly).
#include <cuda_runtime.h>

#include "cuda/backend.h"

namespace fasttree {

bool cuda_backend_built() { return true; }

int cuda_device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return n;
}

void cuda_attention(const Plan&, const KvTree&, const AttnShape&, KvDType, std::span<const float>,
                    std::span<const float>, std::span<const float>, float, std::span<float>,
                    std::span<float>) {
  FT_FAIL("CUDA backend not available: the tree-attention kernels are not implemented yet");
}

}  // namespace fasttree
