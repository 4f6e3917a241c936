// Host-side entry points of the CUDA layer. Includes no CUDA header, so apps and tests can call
// it whether or not the CUDA backend was built (without nvcc these report "not built").
#pragma once
#include <span>

#include "core/attention_shape.h"
#include "core/kv_tree.h"
#include "plan/plan.h"

namespace fasttree {

enum class KvDType { kF16, kBF16 };

// True when this binary contains the CUDA backend (built with nvcc).
bool cuda_backend_built();
// Number of usable CUDA devices; 0 when none is present or the backend was not built.
int cuda_device_count();

// Runs the plan on the GPU. Inputs are host fp32 arrays converted to `dtype` for the device;
// shapes as in core/attention_shape.h. Throws fasttree::Error when the backend is not available.
void cuda_attention(const Plan& plan, const KvTree& tree, const AttnShape& shape, KvDType dtype,
                    std::span<const float> q, std::span<const float> k, std::span<const float> v,
                    float sm_scale, std::span<float> out, std::span<float> lse);

}  // namespace fasttree
