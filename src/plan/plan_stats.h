// Figures of a plan for reports: work items per tile class, partials per query, KV bytes the plan
// reads vs a per-request kernel, and the physical floor of DESIGN.md §6.
#pragma once
#include <array>
#include <cstdint>

#include "core/attention_shape.h"
#include "core/kv_tree.h"
#include "plan/plan.h"

namespace fasttree {

// H200 figures measured for this project (DESIGN.md §6).
inline constexpr double kH200ReadBytesPerS = 4.31e12;
inline constexpr double kH200DenseFlopsPerS = 790e12;
inline constexpr double kLaunchFloorUs = 4.0;

struct PlanStats {
  int num_vnodes = 0;
  int num_items = 0;
  std::array<int32_t, kMaxTileClasses> items_per_class{};
  int num_concat_edges = 0;   // edges the planner concatenated
  int num_partial_rows = 0;
  int num_direct_queries = 0;
  int max_partials_per_query = 0;
  double mean_partials_per_query = 0;
  int64_t plan_kv_tokens = 0;         // Σ items kv_len + priv_len: tokens the plan streams per KV head
  int64_t max_item_tokens = 0;        // the longest item (kv_len + priv_len)
  int num_folded_leaves = 0;          // private pieces (PlannerConfig::fold_max)
  int64_t private_tokens = 0;         // their tokens
  int64_t per_request_kv_tokens = 0;  // Σ queries path_len: what a per-request kernel streams
  int64_t unique_kv_tokens = 0;       // tokens stored in nodes some query reads
  int64_t sum_path_len = 0;
};

PlanStats plan_stats(const Plan& plan, const KvTree& tree);

// K and V bytes for `tokens` tokens of every KV head.
double kv_bytes(int64_t tokens, const AttnShape& shape, int dtype_bytes);

// floor = max(unique KV bytes / BW, 4*Σpath*Hq*d / FLOPS, 4 µs), in microseconds.
double floor_us(int64_t unique_kv_tokens, int64_t sum_path_len, const AttnShape& shape, int dtype_bytes);

}  // namespace fasttree
