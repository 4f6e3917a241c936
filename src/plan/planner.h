// FastTree planner (DESIGN.md §3): greedy edge assignment with the cost model, virtual nodes,
// context splitting and query tiles into work items (longest first), and the merge map.
//
//   Planner planner(config);
//   planner.build(tree, shape, plan);   // tree must satisfy validate_tree(); plan buffers reused
//
// build() is O(nodes + queries + items + partials) plus one sort of the items (and, for plans of at
// most a few rounds of units, five chunkings with a sort and a simulation of at most 4 x SMs x
// split_waves units each: PlannerConfig::balance_chunks), and allocates nothing once the
// planner's workspace and the plan's buffers have grown to the tree's size.
#pragma once
#include <cstdint>
#include <vector>

#include "core/attention_shape.h"
#include "core/kv_tree.h"
#include "plan/plan.h"

namespace fasttree {

// Pad(TS, N) = TS - ((N-1) mod TS + 1), Pad(TS, 0) = 0: rows (or columns) of padding when N items
// are laid out in tiles of TS.
int64_t tile_pad(int64_t ts, int64_t n);

// Index of the tile class used by a vnode with `rows` query rows (queries x g).
int choose_tile_class(const PlannerConfig& cfg, int64_t rows);
// Queries per tile of class `cls` at GQA ratio g (at least 1).
int queries_per_tile(const PlannerConfig& cfg, int cls, int g);

// The paper's matrix-multiply cost Cmm(nQ, nK) for the tile class that nQ queries select.
double cmm_cost(const PlannerConfig& cfg, int g, int64_t nq, int64_t nk);

class Planner {
 public:
  explicit Planner(PlannerConfig config = {});
  void build(const KvTree& tree, const AttnShape& shape, Plan& plan);
  const PlannerConfig& config() const { return config_; }
  PlannerConfig& config() { return config_; }

 private:
  double narrow_mode_tiles(const KvTree& tree, const AttnShape& shape) const;
  void assign_edges(const KvTree& tree, int g, Plan& plan);
  void build_vnodes(const KvTree& tree, Plan& plan);
  void build_items(int g, int num_kv_heads, Plan& plan);
  void align_segments(Plan& plan, size_t first, int32_t kv_tile);
  void chunk_vnodes(int32_t target, const Plan& plan);
  int32_t balance_chunk_target(int32_t target0, int num_kv_heads, Plan& plan);
  void choose_folds(int num_kv_heads, Plan& plan);
  void build_merge_map(Plan& plan);
  void sort_items_longest_first(std::vector<PlanItem>& items);

  PlannerConfig config_;
  PlannerConfig cfg_;  // this build's constants: config_, or its narrow-mode variant
  // Workspace (kept between builds so steady-state planning does not allocate).
  TreeTopology topo_;
  std::vector<int64_t> acc_len_;      // [n] context length of the node's potential vnode
  std::vector<int32_t> group_q_;      // [n] queries left in the node's group
  std::vector<int32_t> top_;          // [n] top node of the node's vnode context
  std::vector<int32_t> path_scratch_;
  std::vector<int8_t> vnode_cls_;        // [V] tile class
  std::vector<int32_t> vnode_tiles_;     // [V] query tiles
  std::vector<int32_t> vnode_chunk_len_; // [V] context tokens per chunk
  std::vector<int32_t> partials_;      // [Q] partial results per query
  std::vector<int32_t> own_vnode_;     // [Q] vnode at the query's node (-1: none)
  std::vector<int32_t> host_vnode_;    // [Q] nearest ancestor vnode holding the query (-1: none)
  std::vector<int32_t> fold_;          // [Q] vnode folded into the query's host item (-1: none)
  std::vector<int64_t> host_tokens_;   // [V] private tokens the vnode's items would take on
  std::vector<int32_t> cursor_;        // fill cursors (vnode query lists, merge map)
  std::vector<PlanItem> items_scratch_;
  std::vector<int32_t> unit_cost_;     // balance_chunk_target: units' costs in KV tiles
  std::vector<int64_t> slot_free_;     // balance_chunk_target: CTAs' finish times (min-heap)
  std::vector<int64_t> priv_tokens_;   // balance_chunk_target: [V] folded private tokens per host
  std::vector<PlanSegment> seg_scratch_;  // align_segments: one vnode's segments
};

}  // namespace fasttree
