#include "plan/plan_validate.h"

#include <algorithm>
#include <string>
#include <vector>

#include "core/error.h"

namespace fasttree {

namespace {

std::string str(int64_t v) { return std::to_string(v); }

// One piece of one query's coverage, in KvTree::slots index space.
struct Cover {
  int32_t query;
  int64_t begin, end;
};

void check_structure(const Plan& p, const KvTree& tree) {
  const int nv = p.num_vnodes();
  const int nq = p.num_queries;
  FT_CHECK(nq == tree.num_queries(), "plan has " + str(nq) + " queries, tree has " + str(tree.num_queries()));
  FT_CHECK(p.num_kv_heads > 0 && p.num_qo_heads % p.num_kv_heads == 0, "plan: bad head counts");
  FT_CHECK(p.num_tile_classes >= 1 && p.num_tile_classes <= kMaxTileClasses, "plan: bad tile class count");
  FT_CHECK(p.vnode_len.size() == static_cast<size_t>(nv) && p.vnode_seg_begin.size() == static_cast<size_t>(nv) + 1 &&
               p.vnode_q_begin.size() == static_cast<size_t>(nv) + 1,
           "plan: vnode arrays disagree in size");
  FT_CHECK(p.query_direct.size() == static_cast<size_t>(nq) && p.merge_begin.size() == static_cast<size_t>(nq) + 1,
           "plan: per-query arrays disagree with the query count");
  for (int v = 0; v < nv; ++v) {
    FT_CHECK(p.vnode_seg_begin[v] <= p.vnode_seg_begin[v + 1] && p.vnode_q_begin[v] <= p.vnode_q_begin[v + 1],
             "vnode " + str(v) + ": CSR offsets decrease");
    int64_t tok = 0;
    for (int s = p.vnode_seg_begin[v]; s < p.vnode_seg_begin[v + 1]; ++s) {
      const PlanSegment& seg = p.segments.at(s);
      FT_CHECK(seg.len > 0 && seg.token_begin == tok, "vnode " + str(v) + ": segment " + str(s) + " is empty or not contiguous");
      FT_CHECK(seg.slot_offset >= 0 && seg.slot_offset + seg.len <= tree.num_tokens(),
               "vnode " + str(v) + ": segment " + str(s) + " lies outside the tree's slot list");
      tok += seg.len;
    }
    FT_CHECK(tok == p.vnode_len[v], "vnode " + str(v) + ": segments hold " + str(tok) + " tokens, vnode_len says " + str(p.vnode_len[v]));
  }
  FT_CHECK(p.vnode_q_begin[nv] == static_cast<int32_t>(p.vnode_queries.size()), "plan: vnode query CSR does not end at the list's end");
  for (int32_t q : p.vnode_queries) FT_CHECK(q >= 0 && q < nq, "plan: vnode query " + str(q) + " out of range");
  const int g = p.g();
  for (int i = 0; i < p.num_items(); ++i) {
    const PlanItem& it = p.items[i];
    const std::string name = "item " + str(i);
    FT_CHECK(it.vnode >= 0 && it.vnode < nv, name + ": vnode " + str(it.vnode) + " out of range");
    FT_CHECK(it.kv_len > 0 && it.kv_begin >= 0 && it.kv_begin + it.kv_len <= p.vnode_len[it.vnode],
             name + ": context chunk outside its vnode");
    FT_CHECK(it.q_count > 0 && it.q_begin >= p.vnode_q_begin[it.vnode] && it.q_begin + it.q_count <= p.vnode_q_begin[it.vnode + 1],
             name + ": query tile outside its vnode's group");
    FT_CHECK(it.tile_class >= 0 && it.tile_class < p.num_tile_classes, name + ": bad tile class");
    FT_CHECK(it.q_count <= std::max(1, p.tile_classes[it.tile_class].q_rows / g), name + ": tile holds more queries than its class allows");
    FT_CHECK(it.out_row == -1 || (it.out_row >= 0 && it.out_row + it.q_count <= p.num_partial_rows), name + ": partial rows out of range");
    FT_CHECK(it.priv_count >= 0 && it.priv_begin >= 0 && static_cast<size_t>(it.priv_begin) + it.priv_count <= p.privates.size(),
             name + ": private pieces outside the plan's list");
    int64_t tok = 0;
    for (int k = it.priv_begin; k < it.priv_begin + it.priv_count; ++k) {
      const PlanPrivate& piece = p.privates[k];
      FT_CHECK(piece.vnode >= 0 && piece.vnode < nv && piece.len == p.vnode_len[piece.vnode] && piece.token_begin == tok &&
                   piece.q_index >= 0 && piece.q_index < it.q_count && (k == it.priv_begin || p.privates[k - 1].q_index < piece.q_index),
               name + ": private piece " + str(k) + " has a bad vnode, length, offset or query index");
      tok += piece.len;
    }
    FT_CHECK(tok == it.priv_len, name + ": private pieces hold " + str(tok) + " tokens, priv_len says " + str(it.priv_len));
  }
  for (int i = 1; i < p.num_items(); ++i)
    FT_CHECK(item_tokens(p.items[i - 1]) >= item_tokens(p.items[i]), "plan: items are not ordered longest first");
}

}  // namespace

void validate_plan(const Plan& p, const KvTree& tree) {
  check_structure(p, tree);
  const int nq = p.num_queries;
  std::vector<Cover> cover;
  std::vector<int32_t> writes(nq, 0);
  std::vector<uint8_t> row_written(p.num_partial_rows, 0);
  std::vector<std::vector<int32_t>> rows_of(nq);
  for (int i = 0; i < p.num_items(); ++i) {
    const PlanItem& it = p.items[i];
    for (int j = 0; j < it.q_count; ++j) {
      const int32_t q = p.vnode_queries[it.q_begin + j];
      ++writes[q];
      if (!p.query_direct[q]) {
        FT_CHECK(it.out_row >= 0, "item " + str(i) + ": query " + str(q) + " needs a partial row but the item has none");
        const int32_t row = it.out_row + j;
        FT_CHECK(!row_written[row], "partial row " + str(row) + " is written twice");
        row_written[row] = 1;
        rows_of[q].push_back(row);
      }
      const int64_t lo = it.kv_begin, hi = it.kv_begin + it.kv_len;
      for (int s = p.vnode_seg_begin[it.vnode]; s < p.vnode_seg_begin[it.vnode + 1]; ++s) {
        const PlanSegment& seg = p.segments[s];
        const int64_t a = std::max<int64_t>(lo, seg.token_begin), b = std::min<int64_t>(hi, seg.token_begin + seg.len);
        if (a < b) cover.push_back({q, seg.slot_offset + (a - seg.token_begin), seg.slot_offset + (b - seg.token_begin)});
      }
    }
    for (int k = it.priv_begin; k < it.priv_begin + it.priv_count; ++k) {  // folded leaves: their query only
      const PlanPrivate& piece = p.privates[k];
      const int32_t q = p.vnode_queries[it.q_begin + piece.q_index];
      for (int s = p.vnode_seg_begin[piece.vnode]; s < p.vnode_seg_begin[piece.vnode + 1]; ++s)
        cover.push_back({q, p.segments[s].slot_offset, p.segments[s].slot_offset + p.segments[s].len});
    }
  }
  // Merge map: direct queries are written once and merge nothing; the others merge exactly the
  // rows written for them.
  for (int q = 0; q < nq; ++q) {
    const int32_t b = p.merge_begin[q], e = p.merge_begin[q + 1];
    FT_CHECK(b <= e && e <= static_cast<int32_t>(p.merge_rows.size()), "query " + str(q) + ": bad merge range");
    if (p.query_direct[q]) {
      FT_CHECK(writes[q] == 1 && b == e, "query " + str(q) + ": direct but written by " + str(writes[q]) + " items");
      continue;
    }
    std::vector<int32_t> merged(p.merge_rows.begin() + b, p.merge_rows.begin() + e);
    std::sort(merged.begin(), merged.end());
    std::sort(rows_of[q].begin(), rows_of[q].end());
    FT_CHECK(merged == rows_of[q], "query " + str(q) + ": merge map differs from the rows written for it");
  }
  // Coverage: the pieces of each query tile its path exactly once.
  std::sort(cover.begin(), cover.end(), [](const Cover& a, const Cover& b) {
    return a.query != b.query ? a.query < b.query : a.begin < b.begin;
  });
  std::vector<int32_t> stamp(tree.num_nodes(), -1);
  size_t k = 0;
  for (int q = 0; q < nq; ++q) {
    int64_t path_len = 0;
    for (int u = tree.query_node[q]; u >= 0; u = tree.parent[u]) {
      stamp[u] = q;
      path_len += tree.node_len(u);
    }
    int64_t covered = 0, last_end = -1;
    for (; k < cover.size() && cover[k].query == q; ++k) {
      const Cover& c = cover[k];
      FT_CHECK(c.begin >= last_end, "query " + str(q) + ": token at slot index " + str(c.begin) + " is read twice");
      const int u = static_cast<int>(std::upper_bound(tree.slot_begin.begin(), tree.slot_begin.end(), c.begin) - tree.slot_begin.begin()) - 1;
      FT_CHECK(c.end <= tree.slot_begin[u + 1] && stamp[u] == q,
               "query " + str(q) + ": reads tokens of node " + str(u) + " which is not on its path");
      covered += c.end - c.begin;
      last_end = c.end;
    }
    FT_CHECK(covered == path_len, "query " + str(q) + ": covers " + str(covered) + " of its " + str(path_len) + " path tokens");
  }
}

}  // namespace fasttree
