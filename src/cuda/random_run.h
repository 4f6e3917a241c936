// Runs a plan once on inputs generated on the GPU (uniform [-1, 1) in the device dtype) with
// NaN-poisoned outputs and workspace, and copies inputs and outputs back for checking on the CPU
// (apps/plan_check.h compares them with the fp64 reference). No CUDA header here.
#pragma once
#include <cstdint>
#include <vector>

#include "core/attention_shape.h"
#include "core/kv_tree.h"
#include "cuda/backend.h"
#include "plan/plan.h"

namespace fasttree {

struct RandomRunResult {
  int64_t num_slots = 0;
  std::vector<uint16_t> q, k, v;  // [Q, Hq, d], [S, Hkv, d], [S, Hkv, d] in the device dtype
  std::vector<float> out, lse;    // [Q, Hq, d], [Q, Hq]
};

// Throws when no CUDA device is usable. head_major: the kernels read K/V pools laid out [Hkv, S, d]
// (KvLayout::kHeadMajor); the result's k and v are converted back to [S, Hkv, d].
RandomRunResult cuda_run_random_inputs(const Plan& plan, const KvTree& tree, const AttnShape& shape, KvDType dtype,
                                       uint64_t seed, bool head_major = false);

}  // namespace fasttree
