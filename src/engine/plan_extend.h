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
//                                        (re-plan), when it cannot be patched: a grown leaf was empty
//                                        before (no segment), its query has no vnode ending at it, the
//                                        plan does not match the tree's shape, or the planner would now
//                                        chunk a grown vnode differently: with config.split, its single
//                                        chunk grows beyond the planner's chunk target for the grown
//                                        plan (max(min_chunk, work / (num_sms * split_waves)), capped by
//                                        max_chunk), or its last chunk beyond its first chunk.
//                                        O(nodes + segments + items log items).
// The patched plan is exactly what the executors need (validate_plan accepts it), though not
// necessarily what the planner would build from scratch for the grown tree.
#pragma once
#include <cstdint>
#include <span>

#include "core/kv_tree.h"
#include "plan/plan.h"
#include "plan/planner.h"

namespace fasttree {

void grow_query_leaves(KvTree& tree, std::span<const int32_t> new_slots);

bool extend_plan(Plan& plan, const KvTree& grown, const PlannerConfig& config);

}  // namespace fasttree
