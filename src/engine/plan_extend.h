// Decode steps without re-planning (DESIGN.md §7): between two decode steps of an unchanged batch,
// every sequence's context grows by exactly its new token, which lands in the sequence's own leaf
// node (its private tail). The KvTree is grown in place and the previous step's plan is patched
// to the grown tree instead of running the planner again.
//
//   grow_query_leaves(tree, new_slots)   appends new_slots[q] to query q's node. Every query must
//                                        sit at its own leaf (a node with no children and no other
//                                        query); throws fasttree::Error otherwise. O(tokens).
//   extend_plan(plan, grown, config)    `plan` was built by a Planner with `config` (or extended) for
//                                        the tree before the growth; patches it for `grown`: each
//                                        grown leaf's vnode gets one more context token (its last
//                                        segment and the items of its last chunk grow by one), every
//                                        segment's slot offset follows its node in the grown tree, items
//                                        are re-sorted longest first. Queries, partial rows and the merge
//                                        map are unchanged. Returns false, leaving the plan unusable
//                                        (re-plan), when it cannot be patched: the plan has folded
//                                        leaves (private pieces), a grown leaf was empty
//                                        before (no segment), its query has no vnode ending at it, the
//                                        plan does not match the tree's shape, or the planner would now
//                                        chunk a grown vnode differently: with config.split, its single
//                                        chunk grows beyond the planner's chunk target for the grown
//                                        plan (max(min_chunk, work / (num_sms * split_waves)), capped by
//                                        max_chunk), or its last chunk beyond its first chunk.
//                                        O(nodes + segments + items log items).
// The patched plan is exactly what the executors need (validate_plan accepts it), though not
// necessarily what the planner would build from scratch for the grown tree.
//
// Both take an optional PlanExtendScratch: with one kept between steps they allocate nothing once
// its buffers (and the tree's) have grown to the batch's size, apart from the tree's slot array
// growing by doubling as the sequences lengthen (the scheduler's decode loop keeps one).
#pragma once
#include <cstdint>
#include <span>
#include <vector>

#include "core/kv_tree.h"
#include "plan/plan.h"
#include "plan/planner.h"

namespace fasttree {

// Workspace of grow_query_leaves / extend_plan, reused between decode steps.
struct PlanExtendScratch {
  std::vector<int32_t> grow;            // [nodes] 1 + the node's query, 0 = none
  std::vector<int32_t> slots;           // the grown tree's slots (swapped with the tree's)
  std::vector<int64_t> slot_begin;      // [nodes + 1]
  std::vector<uint8_t> is_leaf;         // [nodes]
  std::vector<int32_t> grown_vnode;     // [vnodes] 1: the vnode ends at a grown leaf
  std::vector<int32_t> first_chunk;     // [vnodes]
  std::vector<int32_t> tiles;           // [vnodes]
  std::vector<PlanItem> grown_items, other_items;  // the re-sort's two runs
  std::vector<int32_t> grown_pos, other_pos;       // their positions before the re-sort
};

void grow_query_leaves(KvTree& tree, std::span<const int32_t> new_slots, PlanExtendScratch* scratch = nullptr);

bool extend_plan(Plan& plan, const KvTree& grown, const PlannerConfig& config, PlanExtendScratch* scratch = nullptr);

}  // namespace fasttree
