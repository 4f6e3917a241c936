// Checks a plan's GPU result (cuda/random_run.h) against the fp64 CPU reference for a sample of
// queries. The reference runs on a compact copy of just the nodes and K/V rows those queries read,
// so the check stays cheap for trees with millions of KV rows.
#pragma once
#include <cstdint>

#include "core/attention_shape.h"
#include "core/kv_tree.h"
#include "cuda/backend.h"
#include "plan/plan.h"

namespace fasttree {

struct PlanCheckResult {
  double max_abs_err = 0;  // over the sampled queries' output rows
  double max_abs_ref = 0;  // largest |reference| over the same rows
  double max_lse_err = 0;  // max |lse - ref| / max(1, |ref|)
  int queries_checked = 0;
  double rel_err() const { return max_abs_err / (max_abs_ref > 0 ? max_abs_ref : 1.0); }
};

// sample <= 0 or >= num_queries checks every query.
PlanCheckResult check_plan_on_gpu(const Plan& plan, const KvTree& tree, const AttnShape& shape, KvDType dtype, int sample,
                                  uint64_t seed, bool head_major = false);

}  // namespace fasttree
