#include "plan/per_request_plan.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

#include "core/error.h"

namespace fasttree {

namespace {
int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
}  // namespace

void build_per_request_plan(const KvTree& tree, const AttnShape& shape, const PerRequestConfig& config, Plan& plan) {
  shape.validate();
  FT_CHECK(config.num_sms > 0 && config.waves > 0 && config.min_chunk > 0 && config.kv_tile > 0,
           "per-request plan: num_sms, waves, min_chunk and kv_tile must be positive");
  const int nq = tree.num_queries();
  const int n = tree.num_nodes();
  plan.num_queries = nq;
  plan.num_qo_heads = shape.num_qo_heads;
  plan.num_kv_heads = shape.num_kv_heads;
  plan.tile_classes = {};
  plan.tile_classes[0] = TileClass{16, config.kv_tile};
  plan.num_tile_classes = 1;
  plan.node_edge.assign(n, 1);
  plan.node_vnode.assign(n, -1);

  // One vnode per query with a non-empty path: the path's non-empty nodes, root first.
  plan.vnode_node.clear();
  plan.vnode_len.clear();
  plan.vnode_seg_begin.assign(1, 0);
  plan.segments.clear();
  plan.vnode_q_begin.assign(1, 0);
  plan.vnode_queries.clear();
  int64_t total = 0;
  for (int q = 0; q < nq; ++q) {
    const int node = tree.query_node[q];
    const size_t first_seg = plan.segments.size();
    for (int u = node; u >= 0; u = tree.parent[u])
      if (tree.node_len(u) > 0) plan.segments.push_back(PlanSegment{tree.slot_begin[u], 0, static_cast<int32_t>(tree.node_len(u))});
    if (plan.segments.size() == first_seg) continue;
    std::reverse(plan.segments.begin() + static_cast<std::ptrdiff_t>(first_seg), plan.segments.end());
    int64_t tok = 0;
    for (size_t s = first_seg; s < plan.segments.size(); ++s) {
      plan.segments[s].token_begin = static_cast<int32_t>(tok);
      tok += plan.segments[s].len;
    }
    FT_CHECK(tok <= std::numeric_limits<int32_t>::max(), "per-request plan: path of query " + std::to_string(q) + " exceeds 2^31 tokens");
    plan.vnode_node.push_back(node);
    plan.vnode_len.push_back(static_cast<int32_t>(tok));
    plan.vnode_seg_begin.push_back(static_cast<int32_t>(plan.segments.size()));
    plan.vnode_queries.push_back(q);
    plan.vnode_q_begin.push_back(static_cast<int32_t>(plan.vnode_queries.size()));
    total += tok;
  }

  // Chunks of near-equal length (multiples of kv_tile) spreading the work over the SMs.
  const double work = static_cast<double>(total) * shape.num_kv_heads;
  const int64_t target = std::max<int64_t>(config.min_chunk, static_cast<int64_t>(std::ceil(work / (config.num_sms * config.waves))));
  plan.items.clear();
  plan.privates.clear();  // no folded leaves: every request reads its whole path
  plan.items_per_class = {};
  plan.query_direct.assign(nq, 0);
  plan.merge_begin.assign(nq + 1, 0);
  plan.merge_rows.clear();
  int32_t rows = 0;
  const int nv = static_cast<int>(plan.vnode_node.size());
  for (int v = 0; v < nv; ++v) {
    const int64_t len = plan.vnode_len[v];
    int64_t chunks = ceil_div(len, target);
    const int64_t chunk_len = chunks == 1 ? len : ceil_div(ceil_div(len, chunks), config.kv_tile) * config.kv_tile;
    chunks = ceil_div(len, chunk_len);
    const int32_t q = plan.vnode_queries[v];
    plan.query_direct[q] = chunks == 1;
    for (int64_t c = 0; c < chunks; ++c) {
      PlanItem it{};
      it.vnode = v;
      it.kv_begin = static_cast<int32_t>(c * chunk_len);
      it.kv_len = static_cast<int32_t>(std::min(chunk_len, len - c * chunk_len));
      it.q_begin = v;
      it.q_count = 1;
      it.tile_class = 0;
      it.out_row = chunks == 1 ? -1 : rows;
      if (chunks > 1) rows += 1;
      plan.items.push_back(it);
    }
  }
  plan.items_per_class[0] = static_cast<int32_t>(plan.items.size());
  plan.num_partial_rows = rows;
  // Merge map: the chunks of query q wrote consecutive rows; items are still in build order here.
  std::vector<int32_t>& mb = plan.merge_begin;
  for (const PlanItem& it : plan.items)
    if (it.out_row >= 0) ++mb[plan.vnode_queries[it.q_begin] + 1];
  for (int q = 0; q < nq; ++q) mb[q + 1] += mb[q];
  plan.merge_rows.resize(mb[nq]);
  int32_t* cursor = plan.merge_rows.data();
  for (const PlanItem& it : plan.items)
    if (it.out_row >= 0) *cursor++ = it.out_row;  // queries' vnodes are in query order
  std::stable_sort(plan.items.begin(), plan.items.end(),
                   [](const PlanItem& a, const PlanItem& b) { return a.kv_len > b.kv_len; });
}

}  // namespace fasttree
