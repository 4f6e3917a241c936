#include "plan/planner.h"

#include <algorithm>
#include <cmath>
#include <functional>
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

namespace {

// The cost model with the tile classes pre-sorted by rows, so the greedy pass evaluates Cmm with
// a few compares and one modulo.
struct CostModel {
  double alpha, beta;
  int64_t g;
  int n = 0;
  int64_t rows[kMaxTileClasses], tsq[kMaxTileClasses], tsk[kMaxTileClasses];
  uint32_t tsq_mask[kMaxTileClasses];  // tsq - 1 when tsq is a power of two (no division), else 0

  CostModel(const PlannerConfig& cfg, int gqa) : alpha(cfg.alpha), beta(cfg.beta), g(gqa) {
    int order[kMaxTileClasses];
    for (int c = 0; c < cfg.num_tile_classes; ++c) {  // insertion sort by rows
      int i = n++;
      for (; i > 0 && cfg.tile_classes[order[i - 1]].q_rows > cfg.tile_classes[c].q_rows; --i) order[i] = order[i - 1];
      order[i] = c;
    }
    for (int i = 0; i < n; ++i) {
      rows[i] = cfg.tile_classes[order[i]].q_rows;
      tsq[i] = queries_per_tile(cfg, order[i], gqa);
      tsk[i] = cfg.tile_classes[order[i]].kv_tile;
      tsq_mask[i] = (tsq[i] & (tsq[i] - 1)) == 0 ? static_cast<uint32_t>(tsq[i] - 1) : 0;
    }
  }
  int cls(int64_t nq) const {
    const int64_t r = nq * g;
    for (int i = 0; i < n - 1; ++i)
      if (rows[i] >= r) return i;
    return n - 1;
  }
  // Query tiles of a group of nq queries.
  int64_t tiles(int64_t nq) const {
    if (nq <= 0) return 0;
    const int64_t t = tsq[cls(nq)];
    return (nq + t - 1) / t;
  }
  double cmm(int64_t nq, int64_t nk) const {
    if (nq <= 0) return 0.0;
    const int c = cls(nq);
    const uint32_t m = static_cast<uint32_t>(nq - 1);
    const int64_t rem = tsq_mask[c] || tsq[c] == 1 ? (m & tsq_mask[c]) : m % static_cast<uint32_t>(tsq[c]);
    const int64_t pad = tsq[c] - (rem + 1);
    const int64_t kv_pad = tsk[c] > nk ? tsk[c] - nk : 0;
    return alpha * static_cast<double>(pad * g * nk) + beta * static_cast<double>(kv_pad * nq * g);
  }
};

// Remembers the last Cmm evaluated at one call site.
struct CmmMemo {
  int64_t nq = -1, nk = -1;
  double value = 0;
  double get(const CostModel& cost, int64_t q, int64_t k) {
    if (q != nq || k != nk) {
      nq = q;
      nk = k;
      value = cost.cmm(q, k);
    }
    return value;
  }
};

}  // namespace

double cmm_cost(const PlannerConfig& cfg, int g, int64_t nq, int64_t nk) { return CostModel(cfg, g).cmm(nq, nk); }

namespace {

void check_config(const PlannerConfig& c) {
  FT_CHECK(c.num_tile_classes >= 1 && c.num_tile_classes <= kMaxTileClasses,
           "planner: num_tile_classes must be in [1, " + std::to_string(kMaxTileClasses) + "]");
  for (int i = 0; i < c.num_tile_classes; ++i)
    FT_CHECK(c.tile_classes[i].q_rows > 0 && c.tile_classes[i].kv_tile > 0,
             "planner: tile class " + std::to_string(i) + " has a non-positive size");
  FT_CHECK(c.num_sms > 0 && c.split_waves > 0 && c.min_chunk > 0 && c.max_chunk >= 0,
           "planner: num_sms, split_waves and min_chunk must be positive, max_chunk >= 0");
  FT_CHECK(c.alpha >= 0 && c.beta >= 0 && c.gamma >= 0 && c.delta >= 0, "planner: alpha, beta, gamma, delta must be >= 0");
  FT_CHECK(c.fold_max >= 0 && c.fold_max <= kMaxFoldTokens,
           "planner: fold_max must be in [0, " + std::to_string(kMaxFoldTokens) + "], got " + std::to_string(c.fold_max));
  FT_CHECK(c.fold_min_rows >= 0 && c.fold_min_waves >= 0 && c.fold_narrow_tokens >= 0,
           "planner: fold_min_rows, fold_min_waves and fold_narrow_tokens must be >= 0");
  FT_CHECK(c.narrow_rows >= 1 && c.narrow_max_path >= 0 && c.narrow_max_waves >= 0 && c.narrow_split_max_waves >= 0,
           "planner: narrow_rows must be >= 1, narrow_max_path, narrow_max_waves and narrow_split_max_waves >= 0");
  FT_CHECK(c.mid_class_rows >= 0 && c.mid_class_min_gqa >= 1, "planner: mid_class_rows must be >= 0, mid_class_min_gqa >= 1");
  FT_CHECK(c.narrow_wide_rows >= 0 && c.narrow_wide_max_gqa >= 0 && c.narrow_wide_min_waves >= 0,
           "planner: narrow_wide_rows, narrow_wide_max_gqa and narrow_wide_min_waves must be >= 0");
}


}  // namespace

Planner::Planner(PlannerConfig config) : config_(config) { check_config(config_); }

void Planner::build(const KvTree& tree, const AttnShape& shape, Plan& plan) {
  check_config(config_);
  shape.validate();
  const int g = shape.gqa();
  topo_.build(tree);

  cfg_ = config_;
  if (config_.mid_class_rows > 0 && g >= config_.mid_class_min_gqa && cfg_.num_tile_classes < kMaxTileClasses) {
    bool have = false;
    for (int i = 0; i < cfg_.num_tile_classes; ++i) have = have || cfg_.tile_classes[i].q_rows == config_.mid_class_rows;
    if (!have) cfg_.tile_classes[cfg_.num_tile_classes++] = TileClass{config_.mid_class_rows, kDefaultKvTile};
  }
  const double narrow_tiles = narrow_mode_tiles(tree, shape);
  if (narrow_tiles >= 0) {
    // Wide tiles where they still fill the SMs (PlannerConfig::narrow_wide_rows).
    int32_t rows = config_.narrow_rows;
    double tiles = narrow_tiles;
    const double wide_tiles = narrow_tiles * config_.narrow_rows / std::max(1, config_.narrow_wide_rows);
    if (config_.narrow_wide_rows > rows && g <= config_.narrow_wide_max_gqa &&
        wide_tiles >= config_.narrow_wide_min_waves * config_.num_sms) {
      rows = config_.narrow_wide_rows;
      tiles = wide_tiles;
    }
    cfg_.tile_classes = {{{rows, kDefaultKvTile}, {0, 0}, {0, 0}, {0, 0}}};
    cfg_.num_tile_classes = 1;
    cfg_.fold_min_waves = 0;
    // A round of tiles that already occupies most SMs: splitting would add partial rows and a
    // merge for little gain.
    cfg_.split = config_.split && tiles < config_.narrow_split_max_waves * config_.num_sms;
  }
  plan.num_queries = tree.num_queries();
  plan.num_qo_heads = shape.num_qo_heads;
  plan.num_kv_heads = shape.num_kv_heads;
  plan.tile_classes = cfg_.tile_classes;
  plan.num_tile_classes = cfg_.num_tile_classes;

  assign_edges(tree, g, plan);
  build_vnodes(tree, plan);
  build_items(g, shape.num_kv_heads, plan);
  build_merge_map(plan);
}

// PlannerConfig's narrow mode (small batches of short paths): the query rows in narrow_rows-row
// tiles when it applies, else -1.
double Planner::narrow_mode_tiles(const KvTree& tree, const AttnShape& shape) const {
  const PlannerConfig& c = config_;
  if (c.edges != EdgePolicy::kGreedy || c.narrow_max_path <= 0 || shape.gqa() > c.narrow_rows) return -1;
  const int64_t nq = tree.num_queries();
  const double tiles = static_cast<double>(nq) * shape.num_qo_heads / c.narrow_rows;
  if (nq == 0 || tiles > c.narrow_max_waves * c.num_sms) return -1;
  for (int32_t node : tree.query_node)
    if (topo_.path_len[node] > c.narrow_max_path) return -1;
  return tiles;
}

// Paper Alg. 1: BFS from each root; for each child decide concatenate (1) or split KV (0).
void Planner::assign_edges(const KvTree& tree, int g, Plan& plan) {
  const int n = tree.num_nodes();
  const CostModel cost(cfg_, g);
  CmmMemo memo[4];
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
        switch (cfg_.edges) {
          case EdgePolicy::kAllZero: concat = false; break;
          case EdgePolicy::kAllOne: concat = true; break;
          case EdgePolicy::kGreedy: {
            const int64_t len_v = acc_len_[v];
            if (len_v == 0) {  // nothing to share: concatenating is free
              concat = true;
              break;
            }
            const int64_t nq_curr = group_q_[v];
            // Siblings usually repeat the same arguments (same group size, same lengths): memoized.
            double split_q = memo[0].get(cost, nq_curr - nql, len_v) + memo[1].get(cost, nql, len_l + len_v);
            if (cfg_.delta > 0) split_q += cfg_.delta * static_cast<double>(len_v * cost.tiles(nql));
            const double split_kv = memo[2].get(cost, nq_curr, len_v) + memo[3].get(cost, nql, len_l) +
                                    cfg_.gamma * static_cast<double>(nql);
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
  const int nq = tree.num_queries();
  // Top of each node's context: follow concatenated edges upwards.
  top_.resize(n);
  for (int v : topo_.bfs_order) {
    const int p = tree.parent[v];
    top_[v] = (p >= 0 && plan.node_edge[v]) ? top_[p] : v;
  }
  // PlannerConfig::align_segments: the KV tile length all tile classes share (0: none, no reorder).
  int32_t align = 0;
  if (cfg_.align_segments) {
    align = cfg_.tile_classes[0].kv_tile;
    for (int c = 1; c < cfg_.num_tile_classes; ++c) align = cfg_.tile_classes[c].kv_tile == align ? align : 0;
  }
  // Vnodes in node order; their query lists are laid out by a counting sort.
  plan.node_vnode.resize(n);
  plan.vnode_node.clear();
  plan.vnode_len.clear();
  plan.vnode_seg_begin.assign(1, 0);
  plan.segments.clear();
  plan.vnode_q_begin.assign(1, 0);
  for (int v = 0; v < n; ++v) {
    if (group_q_[v] <= 0 || acc_len_[v] <= 0) {
      plan.node_vnode[v] = -1;
      continue;
    }
    FT_CHECK(acc_len_[v] <= std::numeric_limits<int32_t>::max(), "planner: context of node " + std::to_string(v) + " exceeds 2^31 tokens");
    plan.node_vnode[v] = plan.num_vnodes();
    plan.vnode_node.push_back(v);
    plan.vnode_len.push_back(static_cast<int32_t>(acc_len_[v]));
    plan.vnode_q_begin.push_back(plan.vnode_q_begin.back() + group_q_[v]);
    path_scratch_.clear();
    for (int u = v;; u = tree.parent[u]) {
      path_scratch_.push_back(u);
      if (u == top_[v]) break;
    }
    int32_t tok = 0;
    const size_t first_seg = plan.segments.size();
    for (auto it = path_scratch_.rbegin(); it != path_scratch_.rend(); ++it) {
      const int u = *it;
      const int64_t len = tree.node_len(u);
      if (len == 0) continue;
      plan.segments.push_back(PlanSegment{tree.slot_begin[u], tok, static_cast<int32_t>(len)});
      tok += static_cast<int32_t>(len);
    }
    if (align > 0) align_segments(plan, first_seg, align);
    plan.vnode_seg_begin.push_back(static_cast<int32_t>(plan.segments.size()));
  }
  // Query q is in the group of its own node and of every ancestor a whose edge towards q is 0.
  plan.vnode_queries.resize(plan.vnode_q_begin.back());
  // Also each query's own vnode (the one at its node) and its nearest ancestor vnode (leaf folding).
  cursor_.assign(plan.vnode_q_begin.begin(), plan.vnode_q_begin.end() - 1);
  own_vnode_.assign(nq, -1);
  host_vnode_.assign(nq, -1);
  for (int q = 0; q < nq; ++q) {
    int u = tree.query_node[q];
    int vn = plan.node_vnode[u];
    own_vnode_[q] = vn;
    if (vn >= 0) plan.vnode_queries[cursor_[vn]++] = q;
    for (int p = tree.parent[u]; p >= 0; u = p, p = tree.parent[p]) {
      if (plan.node_edge[u]) continue;
      vn = plan.node_vnode[p];
      if (vn >= 0) {
        plan.vnode_queries[cursor_[vn]++] = q;
        if (host_vnode_[q] < 0) host_vnode_[q] = vn;
      }
    }
  }
}

void Planner::build_items(int g, int num_kv_heads, Plan& plan) {
  const int nv = plan.num_vnodes();
  // Per vnode: tile class and query tiles; the total tile-tokens of work sizes the chunks.
  // (Divisions are avoided on the common paths: they dominate planning time otherwise.)
  vnode_cls_.resize(nv);
  vnode_tiles_.resize(nv);
  double work = 0;
  for (int v = 0; v < nv; ++v) {
    const int32_t nq = plan.vnode_q_begin[v + 1] - plan.vnode_q_begin[v];
    const int cls = choose_tile_class(cfg_, static_cast<int64_t>(nq) * g);
    const int32_t qpt = queries_per_tile(cfg_, cls, g);
    const int32_t tiles = nq <= qpt ? 1 : (nq + qpt - 1) / qpt;
    vnode_cls_[v] = static_cast<int8_t>(cls);
    vnode_tiles_[v] = tiles;
    work += static_cast<double>(tiles) * plan.vnode_len[v];
  }
  work *= num_kv_heads;
  int32_t target = std::numeric_limits<int32_t>::max();
  if (cfg_.split) {
    int64_t t = std::max<int64_t>(cfg_.min_chunk, static_cast<int64_t>(std::ceil(work / (cfg_.num_sms * cfg_.split_waves))));
    if (cfg_.max_chunk > 0) t = std::min(t, cfg_.max_chunk);
    target = static_cast<int32_t>(std::min<int64_t>(t, target));
  }
  // balance_chunk_target leaves the chunks and folds of the target it returns in place.
  if (!(cfg_.split && cfg_.balance_chunks && balance_chunk_target(target, num_kv_heads, plan) >= 0)) {
    chunk_vnodes(target, plan);
    choose_folds(num_kv_heads, plan);
  }
  plan.query_direct.resize(plan.num_queries);
  for (int q = 0; q < plan.num_queries; ++q) plan.query_direct[q] = partials_[q] == 1;

  plan.items.clear();
  plan.privates.clear();
  plan.items_per_class.fill(0);
  int32_t rows = 0;
  for (int v = 0; v < nv; ++v) {
    const int32_t len = plan.vnode_len[v];
    const int32_t qb = plan.vnode_q_begin[v];
    const int32_t nq = plan.vnode_q_begin[v + 1] - qb;
    if (nq == 1 && fold_[plan.vnode_queries[qb]] == v) continue;  // folded into its query's host item
    const int32_t tiles = vnode_tiles_[v];
    const int32_t base = tiles == 1 ? nq : nq / tiles, extra = tiles == 1 ? 0 : nq - base * tiles;
    const int32_t chunk_len = vnode_chunk_len_[v];
    for (int32_t kv_begin = 0; kv_begin < len; kv_begin += chunk_len) {
      const bool last_chunk = kv_begin + chunk_len >= len;
      int32_t q = qb;
      for (int32_t t = 0; t < tiles; ++t) {  // tiles of near-equal size
        const int32_t count = base + (t < extra ? 1 : 0);
        bool all_direct = true;
        for (int32_t i = 0; i < count; ++i) all_direct &= plan.query_direct[plan.vnode_queries[q + i]] != 0;
        PlanItem item{};
        item.vnode = v;
        item.kv_begin = kv_begin;
        item.kv_len = std::min(chunk_len, len - kv_begin);
        item.q_begin = q;
        item.q_count = count;
        item.tile_class = vnode_cls_[v];
        item.out_row = all_direct ? -1 : rows;
        item.priv_begin = static_cast<int32_t>(plan.privates.size());
        if (last_chunk && cfg_.fold_max > 0) {
          for (int32_t i = 0; i < count; ++i) {
            const int32_t qi = plan.vnode_queries[q + i];
            const int32_t f = fold_[qi];
            if (f < 0 || host_vnode_[qi] != v) continue;
            plan.privates.push_back(PlanPrivate{f, i, item.priv_len, plan.vnode_len[f]});
            item.priv_len += plan.vnode_len[f];
            ++item.priv_count;
          }
        }
        if (!all_direct) rows += count;
        plan.items.push_back(item);
        q += count;
      }
    }
    plan.items_per_class[vnode_cls_[v]] += tiles * ((len + chunk_len - 1) / chunk_len);
  }
  plan.num_partial_rows = rows;
}

// PlannerConfig::align_segments: a vnode's segments [first, end) reordered so that those of a whole
// number of KV tiles come first (path order kept within each group) and token offsets renumbered.
// Attention over a vnode's context does not depend on its token order, and a tile that straddles
// two segments (two KV runs) costs the kernel's producer 6-7x a tile inside one run (TMA boxes per
// 8-row unit instead of one copy per 64 rows; PERF_NOTES.md session 17): `8 | 256 | 256` puts both
// 256-token segments off the tile grid, `256 | 256 | 8` none.
void Planner::align_segments(Plan& plan, size_t first, int32_t kv_tile) {
  seg_scratch_.assign(plan.segments.begin() + static_cast<std::ptrdiff_t>(first), plan.segments.end());
  size_t out = first;
  int32_t tok = 0;
  for (int pass = 0; pass < 2; ++pass) {  // a stable partition without std::stable_partition's buffer
    for (const PlanSegment& seg : seg_scratch_) {
      if ((seg.len % kv_tile == 0) != (pass == 0)) continue;
      plan.segments[out++] = PlanSegment{seg.slot_offset, tok, seg.len};
      tok += seg.len;
    }
  }
}

// Every vnode's chunk length for a chunk target (vnodes longer than it: even chunks, rounded up to
// whole KV tiles) and each query's partial results before folding.
void Planner::chunk_vnodes(int32_t target, const Plan& plan) {
  const int nv = plan.num_vnodes();
  vnode_chunk_len_.resize(nv);
  partials_.assign(plan.num_queries, 0);
  for (int v = 0; v < nv; ++v) {
    const int32_t len = plan.vnode_len[v];
    int32_t chunks = 1, chunk_len = len;
    if (len > target) {
      const int32_t kv_tile = cfg_.tile_classes[vnode_cls_[v]].kv_tile;
      chunks = (len + target - 1) / target;
      chunk_len = ((len + chunks - 1) / chunks + kv_tile - 1) / kv_tile * kv_tile;
      chunks = (len + chunk_len - 1) / chunk_len;
    }
    vnode_chunk_len_[v] = chunk_len;
    for (int i = plan.vnode_q_begin[v]; i < plan.vnode_q_begin[v + 1]; ++i) partials_[plan.vnode_queries[i]] += chunks;
  }
}

// PlannerConfig::balance_chunks: the chunk target among target0 x kBalanceFactors whose units
// finish first when the kernel's persistent CTAs (num_sms x split_waves) take them longest first,
// each costing its KV tiles plus kUnitStartTiles (a unit's start-up and epilogue). Evaluated only
// for plans of at most kBalanceMaxWaves rounds of units, where a round's remainder is a large share
// of the time; a candidate must finish strictly first to replace target0 (ties going to longer
// chunks made `1 16 64 / 1024 256 32` 32/32 10 % slower: its root became one 16-tile unit whose
// 64-row tiles cost more than the model's). Folded leaves are counted in
// their host's tiles (spread evenly over its query tiles). Returns the chosen target with its
// chunks and folds (chunk_vnodes, choose_folds) in place, or -1 with nothing computed.
int32_t Planner::balance_chunk_target(int32_t target0, int num_kv_heads, Plan& plan) {
  constexpr double kBalanceFactors[] = {1.0, 0.75, 1.25, 1.5, 2.0};
  constexpr int32_t kUnitStartTiles = 1;
  constexpr int kBalanceMaxWaves = 4;
  const int slots = static_cast<int>(std::lround(cfg_.num_sms * cfg_.split_waves));
  const int nv = plan.num_vnodes();
  if (slots <= 0) return -1;
  int32_t best = target0, last = -1;
  int64_t best_span = std::numeric_limits<int64_t>::max();
  for (double f : kBalanceFactors) {
    int64_t t = std::max<int64_t>(cfg_.min_chunk, std::llround(target0 * f));
    if (cfg_.max_chunk > 0) t = std::min(t, cfg_.max_chunk);
    const int32_t target = static_cast<int32_t>(std::min<int64_t>(t, std::numeric_limits<int32_t>::max()));
    if (f != 1.0 && target == target0) continue;
    chunk_vnodes(target, plan);
    choose_folds(num_kv_heads, plan);
    last = target;
    priv_tokens_.assign(nv, 0);  // private tokens of the leaves actually folded, by host vnode
    for (int q = 0; q < plan.num_queries && cfg_.fold_max > 0; ++q)
      if (fold_[q] >= 0) priv_tokens_[host_vnode_[q]] += plan.vnode_len[fold_[q]];
    unit_cost_.clear();
    bool too_many = false;
    for (int v = 0; v < nv && !too_many; ++v) {
      const int32_t qb = plan.vnode_q_begin[v];
      if (plan.vnode_q_begin[v + 1] - qb == 1 && fold_[plan.vnode_queries[qb]] == v) continue;  // folded
      const int32_t len = plan.vnode_len[v], chunk_len = vnode_chunk_len_[v], tiles = vnode_tiles_[v];
      const int32_t kv_tile = cfg_.tile_classes[vnode_cls_[v]].kv_tile;
      const int64_t priv = priv_tokens_[v] / tiles;
      for (int32_t kv_begin = 0; kv_begin < len; kv_begin += chunk_len) {
        const int64_t tokens = std::min(chunk_len, len - kv_begin) + (kv_begin + chunk_len >= len ? priv : 0);
        const int32_t cost = static_cast<int32_t>((tokens + kv_tile - 1) / kv_tile) + kUnitStartTiles;
        if (static_cast<int64_t>(unit_cost_.size()) + int64_t{tiles} * num_kv_heads > int64_t{kBalanceMaxWaves} * slots) {
          too_many = true;
          break;
        }
        unit_cost_.insert(unit_cost_.end(), static_cast<size_t>(tiles) * num_kv_heads, cost);
      }
    }
    if (too_many) {
      if (f == 1.0) return target0;  // a large plan: rounds are many, the remainder is small (state: target0's)
      continue;
    }
    std::sort(unit_cost_.begin(), unit_cost_.end(), std::greater<>());
    // Longest first onto the earliest-free CTA (min-heap of finish times).
    slot_free_.assign(std::min<size_t>(slots, unit_cost_.size()), 0);
    int64_t span = 0;
    for (int32_t c : unit_cost_) {
      std::pop_heap(slot_free_.begin(), slot_free_.end(), std::greater<>());
      slot_free_.back() += c;
      span = std::max(span, slot_free_.back());
      std::push_heap(slot_free_.begin(), slot_free_.end(), std::greater<>());
    }
    if (span < best_span) {  // ties keep the earlier candidate: target0 first
      best_span = span;
      best = target;
    }
  }
  if (last != best) {  // the state of the last candidate evaluated: redo the winner's
    chunk_vnodes(best, plan);
    choose_folds(num_kv_heads, plan);
  }
  return best;
}

// Leaf folding (PlannerConfig::fold_max): fold_[q] = the vnode folded into query q's host item
// (-1: none). A folded vnode gets no items; its query has one partial result fewer. Candidates:
// one-query vnodes at their query's own node, one chunk of at most fold_max tokens, with a host
// (the query's nearest ancestor vnode). Kept under the guards of PlannerConfig (tile rows, private
// tokens per narrow tile, units left).
void Planner::choose_folds(int num_kv_heads, Plan& plan) {
  const int nv = plan.num_vnodes();
  fold_.assign(plan.num_queries, -1);
  if (cfg_.fold_max <= 0) return;
  int64_t items = 0, folded = 0;
  host_tokens_.assign(nv, 0);  // private tokens each host vnode would take on
  for (int v = 0; v < nv; ++v) {
    items += static_cast<int64_t>(vnode_tiles_[v]) * ((plan.vnode_len[v] + vnode_chunk_len_[v] - 1) / vnode_chunk_len_[v]);
    if (plan.vnode_q_begin[v + 1] - plan.vnode_q_begin[v] != 1 || plan.vnode_len[v] > cfg_.fold_max ||
        vnode_chunk_len_[v] < plan.vnode_len[v])
      continue;
    const int32_t q = plan.vnode_queries[plan.vnode_q_begin[v]];
    if (own_vnode_[q] != v || host_vnode_[q] < 0) continue;
    fold_[q] = v;
    host_tokens_[host_vnode_[q]] += plan.vnode_len[v];
  }
  // Narrow tiles (<= fold_min_rows rows) keep their folds only with >= fold_narrow_tokens private
  // tokens per tile on average.
  for (int q = 0; q < plan.num_queries; ++q) {
    if (fold_[q] < 0) continue;
    const int32_t host = host_vnode_[q];
    if (cfg_.tile_classes[vnode_cls_[host]].q_rows <= cfg_.fold_min_rows &&
        host_tokens_[host] < static_cast<int64_t>(cfg_.fold_narrow_tokens) * vnode_tiles_[host]) {
      fold_[q] = -1;
      continue;
    }
    ++folded;
  }
  if (static_cast<double>(items - folded) * num_kv_heads < cfg_.fold_min_waves * cfg_.num_sms) {
    fold_.assign(plan.num_queries, -1);  // too few units would be left: no folding
    return;
  }
  for (int q = 0; q < plan.num_queries; ++q) partials_[q] -= fold_[q] >= 0 ? 1 : 0;
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
  sort_items_longest_first(plan.items);
}

// Stable LSD radix sort on kv_len + priv_len (item_tokens), descending: ties keep creation order (vnode, chunk, tile).
// Only the bytes that occur in the largest kv_len are sorted on.
void Planner::sort_items_longest_first(std::vector<PlanItem>& items) {
  int32_t max_len = 0;
  for (const PlanItem& it : items) max_len = std::max(max_len, it.kv_len + it.priv_len);
  items_scratch_.resize(items.size());
  PlanItem* src = items.data();
  PlanItem* dst = items_scratch_.data();
  const size_t n = items.size();
  for (int shift = 0; shift < 32 && (max_len >> shift) > 0; shift += 8) {
    uint32_t count[257] = {};
    for (size_t i = 0; i < n; ++i) ++count[255 - (((src[i].kv_len + src[i].priv_len) >> shift) & 0xff) + 1];
    for (int b = 0; b < 256; ++b) count[b + 1] += count[b];
    for (size_t i = 0; i < n; ++i) dst[count[255 - (((src[i].kv_len + src[i].priv_len) >> shift) & 0xff)]++] = src[i];
    std::swap(src, dst);
  }
  if (src != items.data()) std::copy(src, src + n, items.data());
}

}  // namespace fasttree
