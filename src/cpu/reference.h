// Reference attention (DESIGN.md §2): every query attends over its whole path root -> node, with
// fp64 accumulation. The ground truth every executor and kernel is compared against.
#pragma once
#include <span>

#include "core/attention_shape.h"
#include "core/kv_tree.h"

namespace fasttree {

// q   [Q, Hq, d]  (Q = tree.num_queries())
// k,v [S, Hkv, d] (S = k.size() / (Hkv * d); every slot of the tree must be < S)
// out [Q, Hq, d]  O[q,h] = softmax(q·Kᵀ · sm_scale) · V over the query's path
// lse [Q, Hq]     natural-log LSE of the scaled scores; may be empty (not written)
// GQA: qo head h reads kv head h / (Hq / Hkv). A query whose path has no tokens gets out = 0 and
// lse = -inf. Scores, exponentials and sums are computed in double (max-subtracted), then rounded.
// The tree is checked with validate_tree(tree, S) and every span size against the shape; a
// mismatch throws fasttree::Error. Queries are spread over num_threads threads (0 = all cores).
void reference_attention(const KvTree& tree, const AttnShape& shape, std::span<const float> q,
                         std::span<const float> k, std::span<const float> v, float sm_scale,
                         std::span<float> out, std::span<float> lse, int num_threads = 0);

}  // namespace fasttree
