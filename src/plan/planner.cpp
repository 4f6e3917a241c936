#include "plan/planner.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

#include "core/error.h"

namespace fasttree {

int64_t tile_pad(int64_t ts, int64_t n) {
  if (n <= 0) return 0;
  return ts - ((n - 1) % ts + 1);
}

int choose_tile_class(const PlannerConfig& cfg, int64_t rows) {
  int best_fit = -1, largest = 0;
  for (int c = 0; c < cfg.num_tile_classes; ++c) {
    const int r = cfg.tile_classes[c].q_rows;
    if (r > cfg.tile_classes[largest].q_rows) largest = c;
    if (r >= rows && (best_fit < 0 || r < cfg.tile_classes[best_fit].q_rows)) best_fit = c;
  }
  return best_fit >= 0 ? best_fit : largest;
}

int queries_per_tile(const PlannerConfig& cfg, int cls, int g) {
  return std::max(1, cfg.tile_classes[cls].q_rows / g);
}

double cmm_cost(const PlannerConfig& cfg, int g, int64_t nq, int64_t nk) {
  if (nq <= 0) return 0.0;
  const int cls = choose_tile_class(cfg, nq * g);
  const int64_t tsq = queries_per_tile(cfg, cls, g);
  const int64_t tsk = cfg.tile_classes[cls].kv_tile;
  return cfg.alpha * static_cast<double>(tile_pad(tsq, nq) * g * nk) +
         cfg.beta * static_cast<double>(std::max<int64_t>(0, tsk - nk) * nq * g);
}

namespace {

void check_config(const PlannerConfig& c) {
  FT_CHECK(c.num_tile_classes >= 1 && c.num_tile_classes <= kMaxTileClasses,
           "planner: num_tile_classes must be in [1, " + std::to_string(kMaxTileClasses) + "]");
  for (int i = 0; i < c.num_tile_classes; ++i)
    FT_CHECK(c.tile_classes[i].q_rows > 0 && c.tile_classes[i].kv_tile > 0,
             "planner: tile class " + std::to_string(i) + " has a non-positive size");
  FT_CHECK(c.num_sms > 0 && c.split_waves > 0 && c.min_chunk > 0 && c.max_chunk >= 0,
           "planner: num_sms, split_waves and min_chunk must be positive, max_chunk >= 0");
  FT_CHECK(c.alpha >= 0 && c.beta >= 0 && c.gamma >= 0, "planner: alpha, beta, gamma must be >= 0");
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace

Planner::Planner(PlannerConfig config) : config_(config) { check_config(config_); }

void Planner::build(const KvTree& tree, const AttnShape& shape, Plan& plan) {
  check_config(config_);
  shape.validate();
  const int g = shape.gqa();
  topo_.build(tree);

  plan.num_queries = tree.num_queries();
  plan.num_qo_heads = shape.num_qo_heads;
  plan.num_kv_heads = shape.num_kv_heads;
  plan.tile_classes = config_.tile_classes;
  plan.num_tile_classes = config_.num_tile_classes;

  assign_edges(tree, g, plan);
  build_vnodes(tree, plan);
  build_items(g, shape.num_kv_heads, plan);
  build_merge_map(plan);
}

// Paper Alg. 1: BFS from each root; for each child decide concatenate (1) or split KV (0).
void Planner::assign_edges(const KvTree& tree, int g, Plan& plan) {
  const int n = tree.num_nodes();
  plan.node_edge.assign(n, 0);
  acc_len_.assign(n, 0);
  group_q_.assign(n, 0);
  for (int r : topo_.roots) {
    acc_len_[r] = tree.node_len(r);
    group_q_[r] = topo_.subtree_queries[r];
  }
  for (int v : topo_.bfs_order) {
    for (int c = topo_.child_begin[v]; c < topo_.child_begin[v + 1]; ++c) {
      const int l = topo_.children[c];
      const int64_t nql = topo_.subtree_queries[l];
      const int64_t len_l = tree.node_len(l);
      group_q_[l] = static_cast<int32_t>(nql);
      bool concat = false;
      if (nql > 0) {
        switch (config_.edges) {
          case EdgePolicy::kAllZero: concat = false; break;
          case EdgePolicy::kAllOne: concat = true; break;
          case EdgePolicy::kGreedy: {
            const int64_t len_v = acc_len_[v];
            if (len_v == 0) {  // nothing to share: concatenating is free
              concat = true;
              break;
            }
            const int64_t nq_curr = group_q_[v];
            const double split_q = cmm_cost(config_, g, nq_curr - nql, len_v) + cmm_cost(config_, g, nql, len_l + len_v);
            const double split_kv = cmm_cost(config_, g, nq_curr, len_v) + cmm_cost(config_, g, nql, len_l) +
                                    config_.gamma * static_cast<double>(nql);
            concat = split_kv >= split_q;
            break;
          }
        }
      }
      if (concat) {
        plan.node_edge[l] = 1;
        group_q_[v] -= static_cast<int32_t>(nql);
        acc_len_[l] = len_l + acc_len_[v];
      } else {
        acc_len_[l] = len_l;
      }
    }
  }
}

void Planner::build_vnodes(const KvTree& tree, Plan& plan) {
  const int n = tree.num_nodes();
  // Top of each node's context: follow concatenated edges upwards.
  top_.resize(n);
  for (int v : topo_.bfs_order) {
    const int p = tree.parent[v];
    top_[v] = (p >= 0 && plan.node_edge[v]) ? top_[p] : v;
  }
  // DFS preorder makes every subtree's queries one contiguous range of pre_queries_.
  preorder_.clear();
  pre_queries_.clear();
  pre_qbegin_.resize(n);
  dfs_stack_.clear();
  for (auto it = topo_.roots.rbegin(); it != topo_.roots.rend(); ++it) dfs_stack_.push_back(*it);
  while (!dfs_stack_.empty()) {
    const int v = dfs_stack_.back();
    dfs_stack_.pop_back();
    preorder_.push_back(v);
    pre_qbegin_[v] = static_cast<int32_t>(pre_queries_.size());
    for (int i = topo_.query_begin[v]; i < topo_.query_begin[v + 1]; ++i) pre_queries_.push_back(topo_.node_queries[i]);
    for (int c = topo_.child_begin[v + 1] - 1; c >= topo_.child_begin[v]; --c) dfs_stack_.push_back(topo_.children[c]);
  }

  plan.vnode_node.clear();
  plan.vnode_len.clear();
  plan.vnode_seg_begin.assign(1, 0);
  plan.segments.clear();
  plan.vnode_q_begin.assign(1, 0);
  plan.vnode_queries.clear();
  plan.node_vnode.assign(n, -1);
  for (int v : preorder_) {
    if (group_q_[v] <= 0 || acc_len_[v] <= 0) continue;
    FT_CHECK(acc_len_[v] <= std::numeric_limits<int32_t>::max(), "planner: context of node " + std::to_string(v) + " exceeds 2^31 tokens");
    plan.node_vnode[v] = plan.num_vnodes();
    plan.vnode_node.push_back(v);
    plan.vnode_len.push_back(static_cast<int32_t>(acc_len_[v]));
    path_scratch_.clear();
    for (int u = v;; u = tree.parent[u]) {
      path_scratch_.push_back(u);
      if (u == top_[v]) break;
    }
    int32_t tok = 0;
    for (auto it = path_scratch_.rbegin(); it != path_scratch_.rend(); ++it) {
      const int u = *it;
      const int64_t len = tree.node_len(u);
      if (len == 0) continue;
      plan.segments.push_back(PlanSegment{tree.slot_begin[u], tok, static_cast<int32_t>(len)});
      tok += static_cast<int32_t>(len);
    }
    plan.vnode_seg_begin.push_back(static_cast<int32_t>(plan.segments.size()));
    for (int i = topo_.query_begin[v]; i < topo_.query_begin[v + 1]; ++i) plan.vnode_queries.push_back(topo_.node_queries[i]);
    for (int c = topo_.child_begin[v]; c < topo_.child_begin[v + 1]; ++c) {
      const int l = topo_.children[c];
      if (plan.node_edge[l]) continue;
      const int32_t b = pre_qbegin_[l];
      plan.vnode_queries.insert(plan.vnode_queries.end(), pre_queries_.begin() + b,
                                pre_queries_.begin() + b + topo_.subtree_queries[l]);
    }
    plan.vnode_q_begin.push_back(static_cast<int32_t>(plan.vnode_queries.size()));
  }
}

void Planner::build_items(int g, int num_kv_heads, Plan& plan) {
  const int nv = plan.num_vnodes();
  // Total tile-tokens of work, to size the context chunks.
  double work = 0;
  for (int v = 0; v < nv; ++v) {
    const int64_t nq = plan.vnode_q_begin[v + 1] - plan.vnode_q_begin[v];
    const int cls = choose_tile_class(config_, nq * g);
    work += static_cast<double>(ceil_div(nq, queries_per_tile(config_, cls, g))) * plan.vnode_len[v];
  }
  work *= num_kv_heads;
  int64_t target = std::numeric_limits<int32_t>::max();
  if (config_.split) {
    target = std::max<int64_t>(config_.min_chunk,
                               static_cast<int64_t>(std::ceil(work / (config_.num_sms * config_.split_waves))));
    if (config_.max_chunk > 0) target = std::min(target, config_.max_chunk);
  }

  vnode_chunks_.resize(nv);
  partials_.assign(plan.num_queries, 0);
  for (int v = 0; v < nv; ++v) {
    const int64_t len = plan.vnode_len[v];
    int64_t chunks = ceil_div(len, target);
    if (chunks > 1) {
      const int64_t nq = plan.vnode_q_begin[v + 1] - plan.vnode_q_begin[v];
      const int64_t kv_tile = config_.tile_classes[choose_tile_class(config_, nq * g)].kv_tile;
      const int64_t chunk_len = ceil_div(ceil_div(len, chunks), kv_tile) * kv_tile;
      chunks = ceil_div(len, chunk_len);
    }
    vnode_chunks_[v] = static_cast<int32_t>(chunks);
    for (int i = plan.vnode_q_begin[v]; i < plan.vnode_q_begin[v + 1]; ++i) partials_[plan.vnode_queries[i]] += static_cast<int32_t>(chunks);
  }
  plan.query_direct.resize(plan.num_queries);
  for (int q = 0; q < plan.num_queries; ++q) plan.query_direct[q] = partials_[q] == 1;

  plan.items.clear();
  plan.items_per_class.fill(0);
  int32_t rows = 0;
  for (int v = 0; v < nv; ++v) {
    const int64_t len = plan.vnode_len[v];
    const int32_t qb = plan.vnode_q_begin[v];
    const int64_t nq = plan.vnode_q_begin[v + 1] - qb;
    const int cls = choose_tile_class(config_, nq * g);
    const int64_t tiles = ceil_div(nq, queries_per_tile(config_, cls, g));
    const int64_t chunks = vnode_chunks_[v];
    const int64_t kv_tile = config_.tile_classes[cls].kv_tile;
    const int64_t chunk_len = chunks == 1 ? len : ceil_div(ceil_div(len, chunks), kv_tile) * kv_tile;
    for (int64_t c = 0; c < chunks; ++c) {
      const int64_t kv_begin = c * chunk_len;
      const int64_t kv_len = std::min(chunk_len, len - kv_begin);
      int64_t q = 0;
      for (int64_t t = 0; t < tiles; ++t) {  // tiles of near-equal size
        const int64_t count = nq / tiles + (t < nq % tiles ? 1 : 0);
        bool all_direct = true;
        for (int64_t i = 0; i < count; ++i) all_direct &= plan.query_direct[plan.vnode_queries[qb + q + i]] != 0;
        PlanItem item{};
        item.vnode = v;
        item.kv_begin = static_cast<int32_t>(kv_begin);
        item.kv_len = static_cast<int32_t>(kv_len);
        item.q_begin = static_cast<int32_t>(qb + q);
        item.q_count = static_cast<int32_t>(count);
        item.tile_class = cls;
        item.out_row = all_direct ? -1 : rows;
        if (!all_direct) rows += static_cast<int32_t>(count);
        plan.items.push_back(item);
        ++plan.items_per_class[cls];
        q += count;
      }
    }
  }
  plan.num_partial_rows = rows;
}

void Planner::build_merge_map(Plan& plan) {
  const int nq = plan.num_queries;
  plan.merge_begin.assign(nq + 1, 0);
  for (int q = 0; q < nq; ++q) plan.merge_begin[q + 1] = plan.merge_begin[q] + (plan.query_direct[q] ? 0 : partials_[q]);
  plan.merge_rows.resize(plan.merge_begin[nq]);
  cursor_.assign(plan.merge_begin.begin(), plan.merge_begin.end() - 1);
  for (const PlanItem& it : plan.items) {
    if (it.out_row < 0) continue;
    for (int i = 0; i < it.q_count; ++i) {
      const int32_t q = plan.vnode_queries[it.q_begin + i];
      if (!plan.query_direct[q]) plan.merge_rows[cursor_[q]++] = it.out_row + i;
    }
  }
  std::sort(plan.items.begin(), plan.items.end(), [](const PlanItem& a, const PlanItem& b) {
    if (a.kv_len != b.kv_len) return a.kv_len > b.kv_len;
    if (a.vnode != b.vnode) return a.vnode < b.vnode;
    if (a.kv_begin != b.kv_begin) return a.kv_begin < b.kv_begin;
    return a.q_begin < b.q_begin;
  });
}

}  // namespace fasttree
