#include "cpu/executor.h"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>

#include "core/error.h"
#include "cpu/parallel.h"
#include "cpu/softmax_state.h"

namespace fasttree {

namespace {

std::string str(int64_t x) { return std::to_string(x); }

// Checks a CSR offsets array: size n+1, starts at 0, non-decreasing, ends at `total`.
void check_csr(const std::vector<int32_t>& begin, size_t n, size_t total, const char* name) {
  FT_CHECK(begin.size() == n + 1, std::string("plan.") + name + " has " + str(begin.size()) +
                                      " entries, expected " + str(static_cast<int64_t>(n) + 1));
  FT_CHECK(begin[0] == 0, std::string("plan.") + name + "[0] is " + str(begin[0]) + ", expected 0");
  for (size_t i = 0; i < n; ++i)
    FT_CHECK(begin[i + 1] >= begin[i], std::string("plan.") + name + " decreases at " + str(i));
  FT_CHECK(static_cast<size_t>(begin[n]) == total, std::string("plan.") + name + " ends at " +
                                                       str(begin[n]) + ", expected " + str(total));
}

// Everything execute_plan relies on, checked before anything is written.
void validate(const Plan& plan, const KvTree& tree, const AttnShape& shape, std::span<const float> q,
              std::span<const float> k, std::span<const float> v, std::span<float> out, std::span<float> lse,
              CpuWorkspace& ws) {
  shape.validate();
  const int64_t nq = tree.num_queries();
  const int64_t hq = shape.num_qo_heads, hkv = shape.num_kv_heads, d = shape.head_dim;
  FT_CHECK(plan.num_qo_heads == shape.num_qo_heads && plan.num_kv_heads == shape.num_kv_heads,
           "plan was built for " + str(plan.num_qo_heads) + "/" + str(plan.num_kv_heads) +
               " qo/kv heads, shape has " + str(hq) + "/" + str(hkv));
  FT_CHECK(plan.num_queries == nq, "plan has " + str(plan.num_queries) + " queries, tree has " + str(nq));

  FT_CHECK(q.size() == static_cast<size_t>(nq * hq * d),
           "execute_plan: q has " + str(q.size()) + " floats, expected num_queries*Hq*d = " + str(nq * hq * d));
  FT_CHECK(out.size() == static_cast<size_t>(nq * hq * d), "execute_plan: out has " + str(out.size()) +
                                                               " floats, expected num_queries*Hq*d = " +
                                                               str(nq * hq * d));
  FT_CHECK(lse.empty() || lse.size() == static_cast<size_t>(nq * hq),
           "execute_plan: lse has " + str(lse.size()) + " floats, expected 0 or num_queries*Hq = " + str(nq * hq));
  FT_CHECK(k.size() % static_cast<size_t>(hkv * d) == 0,
           "execute_plan: k has " + str(k.size()) + " floats, not a multiple of Hkv*d = " + str(hkv * d));
  FT_CHECK(v.size() == k.size(),
           "execute_plan: v has " + str(v.size()) + " floats but k has " + str(k.size()));
  const int64_t num_slots = static_cast<int64_t>(k.size()) / (hkv * d);

  FT_CHECK(plan.num_tile_classes >= 1 && plan.num_tile_classes <= kMaxTileClasses,
           "plan.num_tile_classes " + str(plan.num_tile_classes) + " out of range [1, " +
               str(kMaxTileClasses) + "]");

  // Virtual nodes and their segments.
  const size_t nv = plan.vnode_node.size();
  FT_CHECK(plan.vnode_len.size() == nv,
           "plan.vnode_len has " + str(plan.vnode_len.size()) + " entries, expected " + str(nv));
  check_csr(plan.vnode_seg_begin, nv, plan.segments.size(), "vnode_seg_begin");
  check_csr(plan.vnode_q_begin, nv, plan.vnode_queries.size(), "vnode_q_begin");
  for (size_t i = 0; i < plan.vnode_queries.size(); ++i)
    FT_CHECK(plan.vnode_queries[i] >= 0 && plan.vnode_queries[i] < nq,
             "plan.vnode_queries[" + str(i) + "] = " + str(plan.vnode_queries[i]) + " is not a query");
  for (size_t vn = 0; vn < nv; ++vn) {
    int64_t t = 0;
    for (int32_t s = plan.vnode_seg_begin[vn]; s < plan.vnode_seg_begin[vn + 1]; ++s) {
      const PlanSegment& seg = plan.segments[s];
      const std::string where = "vnode " + str(vn) + " segment " + str(s);
      FT_CHECK(seg.len > 0, where + ": empty segment");
      FT_CHECK(seg.token_begin == t, where + ": starts at context token " + str(seg.token_begin) +
                                         ", expected " + str(t) + " (segments must tile the context)");
      FT_CHECK(seg.slot_offset >= 0 && seg.slot_offset + seg.len <= tree.num_tokens(),
               where + ": tree.slots[" + str(seg.slot_offset) + ", +" + str(seg.len) + ") out of range [0, " +
                   str(tree.num_tokens()) + ")");
      for (int32_t j = 0; j < seg.len; ++j) {
        const int32_t slot = tree.slots[seg.slot_offset + j];
        FT_CHECK(slot >= 0 && slot < num_slots, where + ": slot " + str(slot) + " out of range [0, " +
                                                    str(num_slots) + ") of the KV pool");
      }
      t += seg.len;
    }
    FT_CHECK(t == plan.vnode_len[vn], "vnode " + str(vn) + ": segments cover " + str(t) +
                                          " tokens, vnode_len is " + str(plan.vnode_len[vn]));
  }

  // Merge map: every listed row belongs to exactly one (non-direct) query.
  const int64_t rows = plan.num_partial_rows;
  FT_CHECK(rows >= 0, "plan.num_partial_rows is negative (" + str(rows) + ")");
  FT_CHECK(plan.query_direct.size() == static_cast<size_t>(nq),
           "plan.query_direct has " + str(plan.query_direct.size()) + " entries, expected " + str(nq));
  check_csr(plan.merge_begin, static_cast<size_t>(nq), plan.merge_rows.size(), "merge_begin");
  ws.row_owner.assign(static_cast<size_t>(rows), -1);
  ws.row_writes.assign(static_cast<size_t>(rows), 0);
  ws.direct_writes.assign(static_cast<size_t>(nq), 0);
  for (int64_t qi = 0; qi < nq; ++qi) {
    FT_CHECK(!plan.query_direct[qi] || plan.merge_begin[qi + 1] == plan.merge_begin[qi],
             "query " + str(qi) + " is direct but has merge rows");
    for (int32_t i = plan.merge_begin[qi]; i < plan.merge_begin[qi + 1]; ++i) {
      const int32_t r = plan.merge_rows[i];
      FT_CHECK(r >= 0 && r < rows, "query " + str(qi) + ": merge row " + str(r) + " out of range [0, " +
                                       str(rows) + ")");
      FT_CHECK(ws.row_owner[r] < 0, "partial row " + str(r) + " is listed for query " + str(ws.row_owner[r]) +
                                        " and again for query " + str(qi));
      ws.row_owner[r] = static_cast<int32_t>(qi);
    }
  }

  // Items.
  for (size_t it = 0; it < plan.items.size(); ++it) {
    const PlanItem& item = plan.items[it];
    const std::string where = "item " + str(it);
    FT_CHECK(item.vnode >= 0 && static_cast<size_t>(item.vnode) < nv,
             where + ": vnode " + str(item.vnode) + " out of range [0, " + str(nv) + ")");
    FT_CHECK(item.kv_len > 0 && item.kv_begin >= 0 &&
                 static_cast<int64_t>(item.kv_begin) + item.kv_len <= plan.vnode_len[item.vnode],
             where + ": chunk [" + str(item.kv_begin) + ", +" + str(item.kv_len) + ") outside vnode " +
                 str(item.vnode) + "'s " + str(plan.vnode_len[item.vnode]) + " context tokens");
    const int32_t qb = plan.vnode_q_begin[item.vnode], qe = plan.vnode_q_begin[item.vnode + 1];
    FT_CHECK(item.q_count > 0 && item.q_begin >= qb && static_cast<int64_t>(item.q_begin) + item.q_count <= qe,
             where + ": query tile [" + str(item.q_begin) + ", +" + str(item.q_count) + ") outside vnode " +
                 str(item.vnode) + "'s queries [" + str(qb) + ", " + str(qe) + ")");
    FT_CHECK(item.tile_class >= 0 && item.tile_class < plan.num_tile_classes,
             where + ": tile class " + str(item.tile_class) + " out of range [0, " + str(plan.num_tile_classes) + ")");
    FT_CHECK(plan.tile_classes[item.tile_class].kv_tile > 0,
             where + ": tile class " + str(item.tile_class) + " has kv_tile " +
                 str(plan.tile_classes[item.tile_class].kv_tile));
    FT_CHECK(item.priv_count >= 0 && item.priv_begin >= 0 &&
                 static_cast<size_t>(item.priv_begin) + item.priv_count <= plan.privates.size(),
             where + ": private pieces [" + str(item.priv_begin) + ", +" + str(item.priv_count) + ") outside plan.privates (" +
                 str(plan.privates.size()) + ")");
    int64_t priv_tokens = 0;
    for (int32_t pi = item.priv_begin; pi < item.priv_begin + item.priv_count; ++pi) {
      const PlanPrivate& piece = plan.privates[pi];
      FT_CHECK(piece.vnode >= 0 && static_cast<size_t>(piece.vnode) < nv && piece.len == plan.vnode_len[piece.vnode] &&
                   piece.q_index >= 0 && piece.q_index < item.q_count && piece.token_begin == priv_tokens,
               where + ": private piece " + str(pi) + " has a bad vnode, length, query index or offset");
      priv_tokens += piece.len;
    }
    FT_CHECK(priv_tokens == item.priv_len, where + ": private pieces hold " + str(priv_tokens) + " tokens, priv_len is " +
                                               str(item.priv_len));
    for (int32_t i = 0; i < item.q_count; ++i) {
      const int32_t qi = plan.vnode_queries[item.q_begin + i];
      if (plan.query_direct[qi]) {
        ++ws.direct_writes[qi];
        continue;
      }
      const int64_t r = static_cast<int64_t>(item.out_row) + i;
      FT_CHECK(r >= 0 && r < rows, where + ": query " + str(qi) + " writes partial row " + str(r) +
                                       " out of range [0, " + str(rows) + ")");
      FT_CHECK(ws.row_owner[r] == qi, where + ": query " + str(qi) + " writes partial row " + str(r) +
                                          ", which the merge map gives to " +
                                          (ws.row_owner[r] < 0 ? std::string("no query")
                                                               : "query " + str(ws.row_owner[r])));
      ++ws.row_writes[r];
    }
  }
  for (int64_t qi = 0; qi < nq; ++qi)
    FT_CHECK(!plan.query_direct[qi] || ws.direct_writes[qi] == 1,
             "direct query " + str(qi) + " is written by " + str(ws.direct_writes[qi]) + " items, expected 1");
  for (int64_t r = 0; r < rows; ++r)
    FT_CHECK(ws.row_owner[r] < 0 || ws.row_writes[r] == 1,
             "partial row " + str(r) + " of query " + str(ws.row_owner[r]) + " is written by " +
                 str(ws.row_writes[r]) + " items, expected 1");
}

}  // namespace

void execute_plan(const Plan& plan, const KvTree& tree, const AttnShape& shape, std::span<const float> q,
                  std::span<const float> k, std::span<const float> v, float sm_scale, std::span<float> out,
                  std::span<float> lse, CpuWorkspace& ws, int num_threads) {
  validate(plan, tree, shape, q, k, v, out, lse, ws);
  const int64_t hq = shape.num_qo_heads, hkv = shape.num_kv_heads, d = shape.head_dim;
  const int g = shape.gqa();
  const int64_t rows = plan.num_partial_rows;
  ws.partial.resize(static_cast<size_t>(rows * hq * d));
  ws.partial_lse.resize(static_cast<size_t>(rows * hq));
  float* partial = ws.partial.data();
  float* partial_lse = ws.partial_lse.data();

  // Phase 1: (item, kv head) tasks; items come longest first, so tasks are handed out in order.
  const int64_t num_tasks = static_cast<int64_t>(plan.items.size()) * hkv;
  parallel_for(
      num_tasks,
      [&](int64_t task) {
        const PlanItem& item = plan.items[task / hkv];
        const int64_t kvh = task % hkv;
        const int kv_tile = plan.tile_classes[item.tile_class].kv_tile;
        const int64_t nrows = static_cast<int64_t>(item.q_count) * g;  // row r = query r / g, head r % g

        std::vector<float> acc(static_cast<size_t>(nrows * d));
        std::vector<SoftmaxState> states;
        states.reserve(static_cast<size_t>(nrows));
        for (int64_t r = 0; r < nrows; ++r) states.emplace_back(std::span<float>(acc.data() + r * d, d));
        std::vector<const float*> qrows(static_cast<size_t>(nrows));
        for (int64_t r = 0; r < nrows; ++r) {
          const int64_t qi = plan.vnode_queries[item.q_begin + r / g];
          const int64_t h = kvh * g + r % g;
          qrows[r] = q.data() + (qi * hq + h) * d;
        }
        std::vector<const float*> krows(kv_tile), vrows(kv_tile);
        std::vector<float> scores(kv_tile);
        // Rows [r_begin, r_end) attend to the n gathered token rows (krows, vrows).
        auto attend = [&](int64_t r_begin, int64_t r_end, int n) {
          for (int64_t r = r_begin; r < r_end; ++r) {
            const float* qr = qrows[r];
            for (int j = 0; j < n; ++j) {
              float dot = 0.0f;
              for (int64_t c = 0; c < d; ++c) dot += qr[c] * krows[j][c];
              scores[j] = dot * sm_scale;
            }
            states[r].update(std::span<const float>(scores.data(), n), [&](size_t j) { return vrows[j]; });
          }
        };

        // Segment cursor at the chunk's first token.
        const PlanSegment* seg_first = plan.segments.data() + plan.vnode_seg_begin[item.vnode];
        const PlanSegment* seg_last = plan.segments.data() + plan.vnode_seg_begin[item.vnode + 1];
        const PlanSegment* seg =
            std::upper_bound(seg_first, seg_last, item.kv_begin,
                             [](int32_t t, const PlanSegment& s) { return t < s.token_begin; }) -
            1;
        int64_t seg_pos = item.kv_begin - seg->token_begin;

        for (int64_t t0 = 0; t0 < item.kv_len; t0 += kv_tile) {
          const int n = static_cast<int>(std::min<int64_t>(kv_tile, item.kv_len - t0));
          for (int j = 0; j < n; ++j) {  // gather the tile's token rows through the slot list
            if (seg_pos == seg->len) {
              ++seg;
              seg_pos = 0;
            }
            const int64_t slot = tree.slots[seg->slot_offset + seg_pos++];
            krows[j] = k.data() + (slot * hkv + kvh) * d;
            vrows[j] = v.data() + (slot * hkv + kvh) * d;
          }
          attend(0, nrows, n);
        }

        // Private pieces: each piece's vnode context, for the g rows of its query only.
        for (int32_t pi = item.priv_begin; pi < item.priv_begin + item.priv_count; ++pi) {
          const PlanPrivate& piece = plan.privates[pi];
          std::vector<int64_t> piece_slots;
          piece_slots.reserve(static_cast<size_t>(piece.len));
          for (int32_t s = plan.vnode_seg_begin[piece.vnode]; s < plan.vnode_seg_begin[piece.vnode + 1]; ++s)
            for (int32_t j = 0; j < plan.segments[s].len; ++j) piece_slots.push_back(tree.slots[plan.segments[s].slot_offset + j]);
          for (size_t t0 = 0; t0 < piece_slots.size(); t0 += static_cast<size_t>(kv_tile)) {
            const int n = static_cast<int>(std::min<size_t>(static_cast<size_t>(kv_tile), piece_slots.size() - t0));
            for (int j = 0; j < n; ++j) {
              krows[j] = k.data() + (piece_slots[t0 + j] * hkv + kvh) * d;
              vrows[j] = v.data() + (piece_slots[t0 + j] * hkv + kvh) * d;
            }
            attend(int64_t{piece.q_index} * g, int64_t{piece.q_index + 1} * g, n);
          }
        }

        for (int64_t r = 0; r < nrows; ++r) {
          const int64_t i = r / g;
          const int64_t qi = plan.vnode_queries[item.q_begin + i];
          const int64_t h = kvh * g + r % g;
          if (plan.query_direct[qi]) {
            states[r].normalize_into(out.subspan((qi * hq + h) * d, d));
            if (!lse.empty()) lse[qi * hq + h] = states[r].lse();
          } else {
            const int64_t row = item.out_row + i;
            states[r].normalize_into(std::span<float>(partial + (row * hq + h) * d, d));
            partial_lse[row * hq + h] = states[r].lse();
          }
        }
      },
      num_threads);

  // Phase 2: merge the partial rows of every non-direct query.
  parallel_for(
      plan.num_queries,
      [&](int64_t qi) {
        if (plan.query_direct[qi]) return;
        std::vector<float> acc(static_cast<size_t>(d));
        for (int64_t h = 0; h < hq; ++h) {
          SoftmaxState state(acc);
          for (int32_t i = plan.merge_begin[qi]; i < plan.merge_begin[qi + 1]; ++i) {
            const int64_t row = plan.merge_rows[i];
            state.merge_partial(partial_lse[row * hq + h],
                                std::span<const float>(partial + (row * hq + h) * d, d));
          }
          state.normalize_into(out.subspan((qi * hq + h) * d, d));
          if (!lse.empty()) lse[qi * hq + h] = state.lse();
        }
      },
      num_threads);
}

void execute_plan(const Plan& plan, const KvTree& tree, const AttnShape& shape, std::span<const float> q,
                  std::span<const float> k, std::span<const float> v, float sm_scale, std::span<float> out,
                  std::span<float> lse, int num_threads) {
  CpuWorkspace ws;
  execute_plan(plan, tree, shape, q, k, v, sm_scale, out, lse, ws, num_threads);
}

}  // namespace fasttree
