// Built when nvcc is not found: the CUDA backend reports itself as unavailable.
#include "cuda/backend.h"

#include <string>

#include "core/error.h"

namespace fasttree {

bool cuda_backend_built() { return false; }
int cuda_device_count() { return 0; }
void cuda_set_device(int device) {
  FT_FAIL("CUDA device " + std::to_string(device) + ": CUDA backend not available (built without nvcc)");
}

void cuda_attention(const Plan&, const KvTree&, const AttnShape&, KvDType, std::span<const float>,
                    std::span<const float>, std::span<const float>, float, std::span<float>,
                    std::span<float>) {
  FT_FAIL("CUDA backend not available: this binary was built without nvcc");
}

void cuda_attention(const Plan&, const KvTree&, const AttnShape&, KvDType, std::span<const float>,
                    std::span<const float>, std::span<const float>, float, std::span<float>,
                    std::span<float>, const CudaRunOptions&) {
  FT_FAIL("CUDA backend not available: this binary was built without nvcc");
}

void cuda_attention_per_request(const KvTree&, const AttnShape&, KvDType, std::span<const float>,
                                std::span<const float>, std::span<const float>, float, std::span<float>,
                                std::span<float>, const CudaRunOptions&) {
  FT_FAIL("CUDA backend not available: this binary was built without nvcc");
}

CudaTiming cuda_time_plan(const Plan&, const KvTree&, const AttnShape&, KvDType, const CudaTimingOptions&) {
  FT_FAIL("CUDA backend not available: this binary was built without nvcc");
}

bool cuda_trace_built() { return false; }

CudaTiming cuda_time_empty_launch(int, const CudaTimingOptions&) {
  FT_FAIL("CUDA backend not available: this binary was built without nvcc");
}

}  // namespace fasttree
