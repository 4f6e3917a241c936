#include "engine/plan_extend.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "core/error.h"

namespace fasttree {

void grow_query_leaves(KvTree& tree, std::span<const int32_t> new_slots, PlanExtendScratch* scratch) {
  PlanExtendScratch local;
  PlanExtendScratch& w = scratch != nullptr ? *scratch : local;
  const int n = tree.num_nodes();
  const int nq = tree.num_queries();
  FT_CHECK(static_cast<int>(new_slots.size()) == nq, "grow_query_leaves: " + std::to_string(new_slots.size()) +
                                                         " new slots for " + std::to_string(nq) + " queries");
  std::vector<int32_t>& grow = w.grow;  // per node: 1 + index of its query, 0 = none
  grow.assign(static_cast<size_t>(n), 0);
  for (int q = 0; q < nq; ++q) {
    const int v = tree.query_node[q];
    FT_CHECK(v >= 0 && v < n, "grow_query_leaves: query " + std::to_string(q) + " at missing node " + std::to_string(v));
    FT_CHECK(grow[v] == 0, "grow_query_leaves: queries " + std::to_string(grow[v] - 1) + " and " + std::to_string(q) +
                               " share node " + std::to_string(v));
    grow[v] = q + 1;
  }
  for (int v = 0; v < n; ++v) {
    const int p = tree.parent[v];
    FT_CHECK(p < 0 || grow[p] == 0, "grow_query_leaves: query " + std::to_string(p >= 0 ? grow[p] - 1 : 0) +
                                        "'s node " + std::to_string(p) + " is not a leaf (node " + std::to_string(v) +
                                        " is its child)");
  }
  std::vector<int32_t>& slots = w.slots;
  slots.clear();
  const size_t need = tree.slots.size() + static_cast<size_t>(nq);
  if (slots.capacity() < need) slots.reserve(std::max(need, 2 * slots.capacity()));  // geometric: few regrowths
  std::vector<int64_t>& begin = w.slot_begin;
  begin.assign(static_cast<size_t>(n) + 1, 0);
  for (int v = 0; v < n; ++v) {
    begin[v] = static_cast<int64_t>(slots.size());
    const auto s = tree.node_slots(v);
    slots.insert(slots.end(), s.begin(), s.end());
    if (grow[v] > 0) slots.push_back(new_slots[static_cast<size_t>(grow[v] - 1)]);
  }
  begin[n] = static_cast<int64_t>(slots.size());
  tree.slots.swap(slots);  // the old arrays stay in the scratch for the next step
  tree.slot_begin.swap(begin);
}

bool extend_plan(Plan& plan, const KvTree& grown, const PlannerConfig& config, PlanExtendScratch* scratch) {
  PlanExtendScratch local;
  PlanExtendScratch& w = scratch != nullptr ? *scratch : local;
  const int n = grown.num_nodes();
  const int nq = grown.num_queries();
  const int nv = plan.num_vnodes();
  if (plan.num_queries != nq || static_cast<int>(plan.node_vnode.size()) != n ||
      static_cast<int>(plan.vnode_len.size()) != nv || static_cast<int>(plan.vnode_seg_begin.size()) != nv + 1)
    return false;
  if (!plan.privates.empty()) return false;  // folded leaves (PlannerConfig::fold_max): re-plan
  std::vector<uint8_t>& is_leaf = w.is_leaf;
  is_leaf.assign(static_cast<size_t>(n), 0);
  std::vector<int32_t>& grown_vnode = w.grown_vnode;  // 1: the vnode ends at a grown leaf
  grown_vnode.assign(static_cast<size_t>(nv), 0);
  for (int q = 0; q < nq; ++q) {
    const int v = grown.query_node[q];
    if (v < 0 || v >= n) return false;
    is_leaf[v] = 1;
  }
  for (int v = 0; v < n; ++v) {
    if (!is_leaf[v]) continue;
    const int vn = plan.node_vnode[v];
    if (vn < 0 || vn >= nv || plan.vnode_node[vn] != v) return false;
    grown_vnode[vn] = 1;
  }
  // Segments: walk each vnode's path upwards from its node, skipping empty nodes, matching its
  // segments from the last one back.
  for (int vn = 0; vn < nv; ++vn) {
    const int32_t sb = plan.vnode_seg_begin[vn], se = plan.vnode_seg_begin[vn + 1];
    if (sb < 0 || se < sb || se > static_cast<int32_t>(plan.segments.size())) return false;
    int u = plan.vnode_node[vn];
    if (u < 0 || u >= n) return false;
    for (int32_t s = se - 1; s >= sb; --s) {
      while (u >= 0 && grown.node_len(u) - (is_leaf[u] ? 1 : 0) == 0) u = grown.parent[u];
      if (u < 0) return false;
      PlanSegment& seg = plan.segments[s];
      const int64_t old_len = grown.node_len(u) - (is_leaf[u] ? 1 : 0);
      if (seg.len != old_len) return false;
      seg.slot_offset = grown.slot_begin[u];
      u = grown.parent[u];
    }
    if (grown_vnode[vn]) {
      if (se == sb) return false;  // the leaf was empty: it has no segment yet
      PlanSegment& last = plan.segments[se - 1];
      if (last.slot_offset != grown.slot_begin[plan.vnode_node[vn]]) return false;
      last.len += 1;
    }
  }
  // Items: the last chunk of every grown vnode gets the new token, unless the planner would chunk
  // the grown vnode differently (Planner::build_items: chunk target from the total work). The
  // target checked is the split_waves one; a plan whose chunks PlannerConfig::balance_chunks
  // chose otherwise keeps them while they fit it, and is balanced again at its next re-plan.
  std::vector<int32_t>& first_chunk = w.first_chunk;
  std::vector<int32_t>& tiles = w.tiles;
  first_chunk.assign(static_cast<size_t>(nv), 0);
  tiles.assign(static_cast<size_t>(nv), 0);
  for (const PlanItem& it : plan.items) {
    if (it.vnode < 0 || it.vnode >= nv) return false;
    if (it.kv_begin == 0) {
      first_chunk[it.vnode] = it.kv_len;
      ++tiles[it.vnode];
    }
  }
  if (config.split) {
    double work = 0;
    for (int vn = 0; vn < nv; ++vn) work += static_cast<double>(tiles[vn]) * (plan.vnode_len[vn] + grown_vnode[vn]);
    work *= plan.num_kv_heads;
    int64_t target = std::max<int64_t>(config.min_chunk,
                                       static_cast<int64_t>(std::ceil(work / (config.num_sms * config.split_waves))));
    if (config.max_chunk > 0) target = std::min(target, config.max_chunk);
    for (const PlanItem& it : plan.items) {
      if (!grown_vnode[it.vnode] || it.kv_begin + it.kv_len != plan.vnode_len[it.vnode]) continue;
      const int64_t len = int64_t{it.kv_len} + 1;
      if (it.kv_begin == 0 ? len > target : len > first_chunk[it.vnode]) return false;
    }
  }
  // The items were sorted longest first (as the planner and earlier extensions leave them); the grown ones (one token longer) and the others are each
  // still sorted, so a merge of the two runs, ties in their old order, re-sorts them exactly as a
  // stable sort would, without its temporary buffer.
  w.grown_items.clear(), w.other_items.clear(), w.grown_pos.clear(), w.other_pos.clear();
  for (size_t i = 0; i < plan.items.size(); ++i) {
    PlanItem it = plan.items[i];
    if (grown_vnode[it.vnode] && it.kv_begin + it.kv_len == plan.vnode_len[it.vnode]) {
      it.kv_len += 1;
      w.grown_items.push_back(it);
      w.grown_pos.push_back(static_cast<int32_t>(i));
    } else {
      w.other_items.push_back(it);
      w.other_pos.push_back(static_cast<int32_t>(i));
    }
  }
  size_t a = 0, b = 0, out = 0;
  while (a < w.grown_items.size() || b < w.other_items.size()) {
    bool take_grown = b == w.other_items.size();
    if (a < w.grown_items.size() && b < w.other_items.size()) {
      const int32_t la = w.grown_items[a].kv_len, lb = w.other_items[b].kv_len;
      take_grown = la > lb || (la == lb && w.grown_pos[a] < w.other_pos[b]);
    }
    plan.items[out++] = take_grown ? w.grown_items[a++] : w.other_items[b++];
  }
  for (int vn = 0; vn < nv; ++vn) plan.vnode_len[vn] += grown_vnode[vn];
  return true;
}

}  // namespace fasttree
