#include "plan/plan_stats.h"

#include <algorithm>

namespace fasttree {

PlanStats plan_stats(const Plan& plan, const KvTree& tree) {
  PlanStats s;
  s.num_vnodes = plan.num_vnodes();
  s.num_items = plan.num_items();
  s.items_per_class = plan.items_per_class;
  for (uint8_t e : plan.node_edge) s.num_concat_edges += e;
  s.num_partial_rows = plan.num_partial_rows;
  for (const PlanItem& it : plan.items) {
    s.plan_kv_tokens += item_tokens(it);
    s.max_item_tokens = std::max(s.max_item_tokens, item_tokens(it));
    s.private_tokens += it.priv_len;
  }
  s.num_folded_leaves = static_cast<int>(plan.privates.size());
  int64_t total_partials = 0;
  for (int q = 0; q < plan.num_queries; ++q) {
    const int parts = plan.query_direct[q] ? 1 : plan.merge_begin[q + 1] - plan.merge_begin[q];
    s.num_direct_queries += plan.query_direct[q];
    s.max_partials_per_query = std::max(s.max_partials_per_query, parts);
    total_partials += parts;
  }
  s.mean_partials_per_query = plan.num_queries ? static_cast<double>(total_partials) / plan.num_queries : 0.0;
  TreeTopology topo;
  topo.build(tree);
  const TreeStats ts = tree_stats(tree, topo);
  s.unique_kv_tokens = ts.unique_tokens;
  s.sum_path_len = ts.sum_path_len;
  s.per_request_kv_tokens = ts.sum_path_len;
  return s;
}

double kv_bytes(int64_t tokens, const AttnShape& shape, int dtype_bytes) {
  return 2.0 * static_cast<double>(tokens) * shape.num_kv_heads * shape.head_dim * dtype_bytes;
}

double floor_us(int64_t unique_kv_tokens, int64_t sum_path_len, const AttnShape& shape, int dtype_bytes) {
  const double bytes_us = kv_bytes(unique_kv_tokens, shape, dtype_bytes) / kH200ReadBytesPerS * 1e6;
  const double flops = 4.0 * static_cast<double>(sum_path_len) * shape.num_qo_heads * shape.head_dim;
  const double flops_us = flops / kH200DenseFlopsPerS * 1e6;
  return std::max({bytes_us, flops_us, kLaunchFloorUs});
}

}  // namespace fasttree
