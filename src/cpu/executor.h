// CPU executor of a Plan (DESIGN.md §3-4): runs the plan exactly as the GPU kernels do, in fp32,
// so that tests can prove a plan's semantics without a GPU.
//
// Phase 1, for every work item and every KV head (items x num_kv_heads independent tasks): the
// item's q_count queries x g qo heads (the rows of the tile) stream the context chunk
// [kv_begin, kv_begin + kv_len) of their vnode in KV tiles of the item's tile class (kv_tile
// tokens, the last tile possibly partial), with an fp32 online softmax (SoftmaxState). Context
// token t maps to a slot through the vnode's segments: segment s covers context tokens
// [token_begin, token_begin + len) and its j-th token is tree.slots[slot_offset + j]. Each row is
// then normalized and written to partial row out_row + i (fp32 [Hq, d] + LSE [Hq]), or, when the
// query is direct, straight to out / lse.
// Phase 2, per non-direct query: its partial rows plan.merge_rows[merge_begin[q], merge_begin[q+1])
// are combined with max-subtracted LSE weights; a query with no rows (empty path) gets out = 0,
// lse = -inf, and an empty partial (lse = -inf) contributes nothing (never NaN).
//
// The plan is validated against the tree, the shape and the spans before anything is written
// (heads, query count, every index in range, vnode segments tiling the context, every slot < S,
// every direct query written by exactly one item, every merge row written by exactly one item for
// the query that owns it); a violation throws fasttree::Error naming the offending item/row/query.
#pragma once
#include <span>
#include <vector>

#include "core/attention_shape.h"
#include "core/kv_tree.h"
#include "plan/plan.h"

namespace fasttree {

// Buffers reused across execute_plan calls: they grow to the largest plan seen and are never
// shrunk, so repeated calls with a workspace allocate nothing but per-task scratch.
struct CpuWorkspace {
  std::vector<float> partial;          // [num_partial_rows, Hq, d] normalized partial outputs
  std::vector<float> partial_lse;      // [num_partial_rows, Hq] natural-log LSE of each partial
  std::vector<int32_t> row_owner;      // [num_partial_rows] validation: query owning each row
  std::vector<int32_t> row_writes;     // [num_partial_rows] validation: items writing each row
  std::vector<int32_t> direct_writes;  // [Q] validation: items writing each direct query
};

// q [Q, Hq, d], k/v [S, Hkv, d], out [Q, Hq, d], lse [Q, Hq] or empty (not written).
// Q = tree.num_queries() = plan.num_queries. num_threads: 0 = all hardware threads.
void execute_plan(const Plan& plan, const KvTree& tree, const AttnShape& shape, std::span<const float> q,
                  std::span<const float> k, std::span<const float> v, float sm_scale, std::span<float> out,
                  std::span<float> lse, CpuWorkspace& workspace, int num_threads = 0);

// Same, with a workspace allocated for this call only.
void execute_plan(const Plan& plan, const KvTree& tree, const AttnShape& shape, std::span<const float> q,
                  std::span<const float> k, std::span<const float> v, float sm_scale, std::span<float> out,
                  std::span<float> lse, int num_threads = 0);

}  // namespace fasttree
