#include "apps/plan_check.h"

#include <algorithm>
#include <cmath>
#include <random>
#include <unordered_map>
#include <vector>

#include "core/half.h"
#include "cpu/reference.h"
#include "cuda/random_run.h"

namespace fasttree {

PlanCheckResult check_plan_on_gpu(const Plan& plan, const KvTree& tree, const AttnShape& shape, KvDType dtype, int sample,
                                  uint64_t seed, bool head_major) {
  const RandomRunResult run = cuda_run_random_inputs(plan, tree, shape, dtype, seed, head_major);
  const int64_t nq = tree.num_queries(), hq = shape.num_qo_heads;
  const int64_t q_row = hq * shape.head_dim, kv_row = static_cast<int64_t>(shape.num_kv_heads) * shape.head_dim;
  auto to_float = [&](uint16_t x) { return dtype == KvDType::kF16 ? half_to_float(x) : bf16_to_float(x); };

  std::vector<int> picked;
  std::mt19937_64 rng(seed);
  if (sample <= 0 || sample >= nq) {
    for (int i = 0; i < nq; ++i) picked.push_back(i);
  } else {
    for (int i = 0; i < sample; ++i) picked.push_back(static_cast<int>(rng() % nq));
  }
  // Compact tree: the nodes on the sampled queries' paths, slots renumbered 0..m-1.
  KvTree sub;
  std::unordered_map<int, int> node_map;
  std::vector<int32_t> old_slot;
  std::vector<int> path;
  std::vector<int32_t> slots;
  for (int qi : picked) {
    path.clear();
    for (int u = tree.query_node[qi]; u >= 0 && !node_map.count(u); u = tree.parent[u]) path.push_back(u);
    for (auto it = path.rbegin(); it != path.rend(); ++it) {
      slots.clear();
      for (int32_t s : tree.node_slots(*it)) {
        slots.push_back(static_cast<int32_t>(old_slot.size()));
        old_slot.push_back(s);
      }
      const int p = tree.parent[*it];
      node_map[*it] = sub.add_node(p >= 0 ? node_map.at(p) : -1, std::span<const int32_t>(slots));
    }
    sub.add_query(node_map.at(tree.query_node[qi]));
  }
  std::vector<float> q(picked.size() * q_row), k(old_slot.size() * kv_row), v(old_slot.size() * kv_row);
  for (size_t i = 0; i < picked.size(); ++i)
    for (int64_t j = 0; j < q_row; ++j) q[i * q_row + j] = to_float(run.q[picked[i] * q_row + j]);
  for (size_t s = 0; s < old_slot.size(); ++s)
    for (int64_t j = 0; j < kv_row; ++j) {
      k[s * kv_row + j] = to_float(run.k[old_slot[s] * kv_row + j]);
      v[s * kv_row + j] = to_float(run.v[old_slot[s] * kv_row + j]);
    }
  std::vector<float> ref(picked.size() * q_row), ref_lse(picked.size() * hq);
  reference_attention(sub, shape, q, k, v, shape.default_sm_scale(), ref, ref_lse);

  PlanCheckResult r;
  r.queries_checked = static_cast<int>(picked.size());
  for (size_t i = 0; i < picked.size(); ++i) {
    for (int64_t j = 0; j < q_row; ++j) {
      const double g = run.out[picked[i] * q_row + j], e = ref[i * q_row + j];
      r.max_abs_err = std::isnan(g) ? INFINITY : std::max(r.max_abs_err, std::fabs(g - e));
      r.max_abs_ref = std::max(r.max_abs_ref, std::fabs(e));
    }
    for (int64_t h = 0; h < hq; ++h) {
      const double g = run.lse[picked[i] * hq + h], e = ref_lse[i * hq + h];
      const double err = std::isinf(e) ? (g == e ? 0.0 : INFINITY) : std::fabs(g - e) / std::max(1.0, std::fabs(e));
      r.max_lse_err = std::isnan(g) ? INFINITY : std::max(r.max_lse_err, err);
    }
  }
  return r;
}

}  // namespace fasttree
