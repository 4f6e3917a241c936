// CPU reference attention (cpu/reference.h) and the CPU plan executor (cpu/executor.h) on small
// hand-built trees and plans.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "core/attention_shape.h"
#include "core/error.h"
#include "core/kv_tree.h"
#include "cpu/executor.h"
#include "cpu/reference.h"
#include "cpu/softmax_state.h"
#include "plan/plan.h"

namespace fasttree {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

std::vector<float> random_vec(size_t n, std::mt19937& rng) {
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  std::vector<float> x(n);
  for (float& e : x) e = dist(rng);
  return x;
}

// Tensors of one attention call with random contents.
struct Inputs {
  std::vector<float> q, k, v;
  Inputs(const KvTree& tree, const AttnShape& s, int64_t num_slots, uint32_t seed) {
    std::mt19937 rng(seed);
    q = random_vec(static_cast<size_t>(tree.num_queries()) * s.num_qo_heads * s.head_dim, rng);
    k = random_vec(static_cast<size_t>(num_slots) * s.num_kv_heads * s.head_dim, rng);
    v = random_vec(static_cast<size_t>(num_slots) * s.num_kv_heads * s.head_dim, rng);
  }
};

// Independent naive attention, written without the reference's structure: explicit path walk from
// the leaf upwards, no max subtraction (inputs are small), long double throughout.
void naive_attention(const KvTree& tree, const AttnShape& s, const std::vector<float>& q,
                     const std::vector<float>& k, const std::vector<float>& v, float sm_scale,
                     std::vector<double>& out, std::vector<double>& lse) {
  const int hq = s.num_qo_heads, hkv = s.num_kv_heads, d = s.head_dim;
  out.assign(static_cast<size_t>(tree.num_queries()) * hq * d, 0.0);
  lse.assign(static_cast<size_t>(tree.num_queries()) * hq, 0.0);
  for (int qi = 0; qi < tree.num_queries(); ++qi) {
    std::vector<int32_t> slots;  // order does not matter for softmax attention
    for (int n = tree.query_node[qi]; n >= 0; n = tree.parent[n])
      for (int32_t sl : tree.node_slots(n)) slots.push_back(sl);
    for (int h = 0; h < hq; ++h) {
      const int kh = h / (hq / hkv);
      long double z = 0;
      std::vector<long double> o(d, 0);
      for (int32_t sl : slots) {
        long double dot = 0;
        for (int c = 0; c < d; ++c)
          dot += static_cast<long double>(q[(qi * hq + h) * d + c]) * k[(sl * hkv + kh) * d + c];
        const long double w = std::exp(dot * sm_scale);
        z += w;
        for (int c = 0; c < d; ++c) o[c] += w * v[(sl * hkv + kh) * d + c];
      }
      for (int c = 0; c < d; ++c) out[(qi * hq + h) * d + c] = slots.empty() ? 0.0 : double(o[c] / z);
      lse[qi * hq + h] = slots.empty() ? -std::numeric_limits<double>::infinity() : double(std::log(z));
    }
  }
}

// Max over (query, head) rows of max_c |a - b| / max(1e-6, max_c |ref|): the relative error used by
// every comparison in this file.
template <class A, class B>
double max_row_rel_error(const std::vector<A>& got, const std::vector<B>& ref, int64_t d) {
  EXPECT_EQ(got.size(), ref.size());
  double worst = 0;
  for (size_t r = 0; r * d < ref.size(); ++r) {
    double diff = 0, mag = 0;
    for (int64_t c = 0; c < d; ++c) {
      const double a = got[r * d + c], b = ref[r * d + c];
      diff = std::isnan(a) || std::isnan(b) ? INFINITY : std::max(diff, std::abs(a - b));
      mag = std::max(mag, std::abs(b));
    }
    worst = std::max(worst, diff / std::max(1e-6, mag));
  }
  return worst;
}

// LSE: |a - b| <= tol * max(1, |b|), with -inf == -inf.
template <class A, class B>
void expect_lse_near(const std::vector<A>& got, const std::vector<B>& ref, double tol) {
  ASSERT_EQ(got.size(), ref.size());
  for (size_t i = 0; i < ref.size(); ++i) {
    if (std::isinf(ref[i])) {
      EXPECT_TRUE(std::isinf(got[i]) && got[i] < 0) << "lse[" << i << "] = " << got[i];
    } else {
      EXPECT_NEAR(got[i], ref[i], tol * std::max(1.0, std::abs(double(ref[i])))) << "lse[" << i << "]";
    }
  }
}

// ------------------------------------------------------------------------------------------------
// Reference

// 1 query, 2 tokens, d = 2, sm_scale = ln 3: q = (1, 0), k0 = (1, 0), k1 = (0, 1) give scores
// (ln 3, 0), weights (3/4, 1/4); v0 = (1, 2), v1 = (3, 4) give out = (1.5, 2.5), lse = ln(3 + 1).
TEST(CpuReference, HandComputedTwoTokens) {
  KvTree tree;
  tree.add_node(-1, 2);
  tree.add_query(0);
  AttnShape s{1, 1, 2};
  std::vector<float> q{1, 0}, k{1, 0, 0, 1}, v{1, 2, 3, 4}, out(2), lse(1);
  reference_attention(tree, s, q, k, v, std::log(3.0f), out, lse);
  EXPECT_NEAR(out[0], 1.5f, 1e-6f);
  EXPECT_NEAR(out[1], 2.5f, 1e-6f);
  EXPECT_NEAR(lse[0], std::log(4.0f), 1e-6f);
}

TEST(CpuReference, MatchesNaiveOnSmallTree) {
  // Root (5 tokens) -> {node 1 (3), node 2 (0 tokens) -> node 3 (4)}; queries at leaves, at the
  // root and at the empty internal node. Explicit, shuffled slots in a pool larger than the tree.
  KvTree tree;
  std::vector<int32_t> perm(20);
  for (int i = 0; i < 20; ++i) perm[i] = (i * 7 + 3) % 20;
  tree.add_node(-1, std::span<const int32_t>(perm.data(), 5));
  tree.add_node(0, std::span<const int32_t>(perm.data() + 5, 3));
  tree.add_node(0, std::span<const int32_t>());
  tree.add_node(2, std::span<const int32_t>(perm.data() + 8, 4));
  for (int n : {1, 3, 0, 2, 3}) tree.add_query(n);
  for (AttnShape s : {AttnShape{4, 4, 8}, AttnShape{8, 2, 16}, AttnShape{8, 1, 4}}) {
    Inputs in(tree, s, 20, 11);
    const float scale = s.default_sm_scale();
    std::vector<float> out(in.q.size()), lse(tree.num_queries() * s.num_qo_heads);
    reference_attention(tree, s, in.q, in.k, in.v, scale, out, lse);
    std::vector<double> nout, nlse;
    naive_attention(tree, s, in.q, in.k, in.v, scale, nout, nlse);
    EXPECT_LE(max_row_rel_error(out, nout, s.head_dim), 1e-6);
    expect_lse_near(lse, nlse, 1e-6);
  }
}

// With one token on the path, softmax is exactly that token, so out[q, h] is V[slot, h / g]
// bit-for-bit: checks the GQA head mapping independently of the arithmetic.
TEST(CpuReference, GqaHeadMapping) {
  KvTree tree;
  tree.add_node(-1, std::vector<int32_t>{2});
  tree.add_node(-1, std::vector<int32_t>{0});
  tree.add_query(0);
  tree.add_query(1);
  AttnShape s{8, 2, 4};  // g = 4: heads 0-3 -> kv head 0, heads 4-7 -> kv head 1
  Inputs in(tree, s, 3, 5);
  std::vector<float> out(in.q.size()), lse(2 * 8);
  reference_attention(tree, s, in.q, in.k, in.v, 0.3f, out, lse);
  const int slot_of[2] = {2, 0};
  for (int qi = 0; qi < 2; ++qi)
    for (int h = 0; h < 8; ++h)
      for (int c = 0; c < 4; ++c)
        EXPECT_EQ(out[(qi * 8 + h) * 4 + c], in.v[(slot_of[qi] * 2 + h / 4) * 4 + c]) << qi << " " << h;
  // LSE of one token is its scaled score.
  for (int qi = 0; qi < 2; ++qi)
    for (int h = 0; h < 8; ++h) {
      double dot = 0;
      for (int c = 0; c < 4; ++c) dot += double(in.q[(qi * 8 + h) * 4 + c]) * in.k[(slot_of[qi] * 2 + h / 4) * 4 + c];
      EXPECT_NEAR(lse[qi * 8 + h], dot * 0.3, 1e-6);
    }
}

TEST(CpuReference, EmptyPathGivesZerosAndNegInf) {
  KvTree tree;
  tree.add_node(-1, 0);  // empty root
  tree.add_node(0, 0);   // empty child
  tree.add_node(-1, 3);  // a normal root
  tree.add_query(1);
  tree.add_query(2);
  tree.add_query(0);
  AttnShape s{4, 2, 8};
  Inputs in(tree, s, 3, 9);
  std::vector<float> out(in.q.size(), NAN), lse(3 * 4, NAN);
  reference_attention(tree, s, in.q, in.k, in.v, s.default_sm_scale(), out, lse);
  for (int qi : {0, 2})
    for (int h = 0; h < 4; ++h) {
      EXPECT_EQ(lse[qi * 4 + h], -kInf);
      for (int c = 0; c < 8; ++c) EXPECT_EQ(out[(qi * 4 + h) * 8 + c], 0.0f);
    }
  for (int h = 0; h < 4; ++h) EXPECT_TRUE(std::isfinite(lse[4 + h]));
  // lse may be omitted.
  std::vector<float> out2(in.q.size());
  reference_attention(tree, s, in.q, in.k, in.v, s.default_sm_scale(), out2, {});
  EXPECT_EQ(out, out2);
}

// Large scores (|s| ~ 100) would overflow exp without max subtraction; LSE must still be
// log Σ exp(s) = m + log Σ exp(s - m).
TEST(CpuReference, LseIsStableForLargeScores) {
  KvTree tree;
  tree.add_node(-1, 3);
  tree.add_query(0);
  AttnShape s{1, 1, 1};
  std::vector<float> q{1}, k{100, 99, -50}, v{1, -1, 7}, out(1), lse(1);
  reference_attention(tree, s, q, k, v, 1.0f, out, lse);
  const double z = 1 + std::exp(-1.0) + std::exp(-150.0);
  EXPECT_NEAR(lse[0], 100 + std::log(z), 1e-4);
  EXPECT_NEAR(out[0], (1 - std::exp(-1.0) + 7 * std::exp(-150.0)) / z, 1e-6);
}

TEST(CpuReference, ThreadCountDoesNotChangeResult) {
  KvTree tree;
  tree.add_node(-1, 40);
  for (int i = 0; i < 6; ++i) tree.add_node(0, 5 + i);
  for (int i = 1; i <= 6; ++i) tree.add_query(i);
  AttnShape s{4, 2, 16};
  Inputs in(tree, s, tree.num_tokens(), 3);
  std::vector<float> a(in.q.size()), b(in.q.size()), la(24), lb(24);
  reference_attention(tree, s, in.q, in.k, in.v, s.default_sm_scale(), a, la, 1);
  reference_attention(tree, s, in.q, in.k, in.v, s.default_sm_scale(), b, lb, 4);
  EXPECT_EQ(a, b);
  EXPECT_EQ(la, lb);
}

TEST(CpuReference, BadSpansThrow) {
  KvTree tree;
  tree.add_node(-1, 3);
  tree.add_query(0);
  AttnShape s{4, 2, 8};
  Inputs in(tree, s, 3, 1);
  std::vector<float> out(in.q.size()), lse(4);
  const float sc = 0.5f;
  std::vector<float> shortq(in.q.begin(), in.q.end() - 1);
  EXPECT_THROW(reference_attention(tree, s, shortq, in.k, in.v, sc, out, lse), Error);
  std::vector<float> oddk(in.k.begin(), in.k.end() - 1);
  EXPECT_THROW(reference_attention(tree, s, in.q, oddk, oddk, sc, out, lse), Error);
  std::vector<float> shortv(in.v.begin(), in.v.end() - 16);
  EXPECT_THROW(reference_attention(tree, s, in.q, in.k, shortv, sc, out, lse), Error);
  std::vector<float> badout(out.size() + 1), badlse(3);
  EXPECT_THROW(reference_attention(tree, s, in.q, in.k, in.v, sc, badout, lse), Error);
  EXPECT_THROW(reference_attention(tree, s, in.q, in.k, in.v, sc, out, badlse), Error);
  // A pool of 2 slots while the tree uses slot 2.
  std::vector<float> k2(in.k.begin(), in.k.begin() + 2 * 2 * 8);
  EXPECT_THROW(reference_attention(tree, s, in.q, k2, k2, sc, out, lse), Error);
  // Hq not a multiple of Hkv.
  AttnShape bad{4, 3, 8};
  EXPECT_THROW(reference_attention(tree, bad, in.q, in.k, in.v, sc, out, lse), Error);
  // A query at a missing node.
  KvTree t2 = tree;
  t2.query_node[0] = 5;
  EXPECT_THROW(reference_attention(t2, s, in.q, in.k, in.v, sc, out, lse), Error);
}

// ------------------------------------------------------------------------------------------------
// SoftmaxState

TEST(CpuExecutor, SoftmaxStateGuardsEmpty) {
  std::vector<float> acc(2), other{5, 6}, o(2);
  SoftmaxState st(acc);
  EXPECT_EQ(st.lse(), -kInf);
  st.normalize_into(o);
  EXPECT_EQ(o, (std::vector<float>{0, 0}));
  st.merge_partial(-kInf, other);  // empty partial into empty state
  EXPECT_EQ(st.lse(), -kInf);
  st.normalize_into(o);
  EXPECT_FALSE(std::isnan(o[0]) || std::isnan(o[1]));
  const std::vector<float> scores{-kInf, -kInf};
  st.update(scores, [&](size_t) { return other.data(); });  // fully masked tile
  EXPECT_EQ(st.lse(), -kInf);
  st.merge_partial(std::log(2.0f), other);
  st.merge_partial(-kInf, std::vector<float>{NAN, NAN});  // an empty partial's row is never read
  EXPECT_NEAR(st.lse(), std::log(2.0f), 1e-6f);
  st.normalize_into(o);
  EXPECT_EQ(o, other);
  // Merging two equal-weight partials averages them: lse grows by ln 2.
  st.merge_partial(std::log(2.0f), std::vector<float>{1, 2});
  st.normalize_into(o);
  EXPECT_NEAR(o[0], 3.0f, 1e-6f);
  EXPECT_NEAR(o[1], 4.0f, 1e-6f);
  EXPECT_NEAR(st.lse(), std::log(4.0f), 1e-6f);
}

// ------------------------------------------------------------------------------------------------
// Executor on hand-built plans

// A plan under construction: vnodes with their segments, queries and items.
struct PlanBuilder {
  Plan p;
  PlanBuilder(int nq, const AttnShape& s, int kv_tile) {
    p.num_queries = nq;
    p.num_qo_heads = s.num_qo_heads;
    p.num_kv_heads = s.num_kv_heads;
    p.tile_classes[0] = {64, kv_tile};
    p.tile_classes[1] = {16, 3};
    p.num_tile_classes = 2;
    p.vnode_seg_begin = {0};
    p.vnode_q_begin = {0};
    p.query_direct.assign(nq, 0);
  }
  // nodes: tree nodes of the vnode's context, root -> leaf.
  int add_vnode(const KvTree& tree, std::vector<int> nodes, std::vector<int> queries) {
    int32_t t = 0;
    for (int n : nodes) {
      if (tree.node_len(n) == 0) continue;
      p.segments.push_back({tree.slot_begin[n], t, static_cast<int32_t>(tree.node_len(n))});
      t += static_cast<int32_t>(tree.node_len(n));
    }
    p.vnode_node.push_back(nodes.back());
    p.vnode_len.push_back(t);
    p.vnode_seg_begin.push_back(static_cast<int32_t>(p.segments.size()));
    p.vnode_queries.insert(p.vnode_queries.end(), queries.begin(), queries.end());
    p.vnode_q_begin.push_back(static_cast<int32_t>(p.vnode_queries.size()));
    return p.num_vnodes() - 1;
  }
  void add_item(int vnode, int kv_begin, int kv_len, int q_begin, int q_count, int out_row, int cls = 0) {
    p.items.push_back({vnode, kv_begin, kv_len, q_begin, q_count, cls, out_row, 0});
  }
  // rows[q]: partial rows of each query (empty for direct queries).
  void set_merge(const std::vector<std::vector<int>>& rows, int num_rows) {
    p.num_partial_rows = num_rows;
    p.merge_begin = {0};
    p.merge_rows.clear();
    for (const auto& r : rows) {
      p.merge_rows.insert(p.merge_rows.end(), r.begin(), r.end());
      p.merge_begin.push_back(static_cast<int32_t>(p.merge_rows.size()));
    }
  }
};

// Runs the executor (output poisoned with NaN) and the reference; expects agreement to 1e-5.
void expect_executor_matches_reference(const Plan& plan, const KvTree& tree, const AttnShape& s,
                                       int64_t num_slots, uint32_t seed, int threads = 0) {
  Inputs in(tree, s, num_slots, seed);
  const float scale = s.default_sm_scale();
  const size_t nrows = static_cast<size_t>(tree.num_queries()) * s.num_qo_heads;
  std::vector<float> ref(in.q.size()), ref_lse(nrows);
  reference_attention(tree, s, in.q, in.k, in.v, scale, ref, ref_lse);
  std::vector<float> out(in.q.size(), NAN), lse(nrows, NAN);
  execute_plan(plan, tree, s, in.q, in.k, in.v, scale, out, lse, threads);
  EXPECT_LE(max_row_rel_error(out, ref, s.head_dim), 1e-5);
  expect_lse_near(lse, ref_lse, 1e-5);
}

// Root (5 tokens, shuffled slots) with two leaves (3 and 4 tokens); query 0 at leaf 1, query 1 at
// leaf 2. The root vnode serves both queries (split KV: edge 0), each leaf vnode its own query;
// both queries are non-direct and merge a root partial with a leaf partial. kv_tile 2 makes every
// chunk several tiles with a partial last tile.
TEST(CpuExecutor, RootAndLeafVnodes) {
  KvTree tree;
  tree.add_node(-1, std::vector<int32_t>{9, 3, 7, 0, 11});
  tree.add_node(0, std::vector<int32_t>{1, 5, 2});
  tree.add_node(0, std::vector<int32_t>{4, 10, 6, 8});
  tree.add_query(1);
  tree.add_query(2);
  for (AttnShape s : {AttnShape{4, 2, 8}, AttnShape{2, 2, 16}, AttnShape{8, 1, 64}}) {
    PlanBuilder b(2, s, 2);
    const int v0 = b.add_vnode(tree, {0}, {0, 1});
    const int v1 = b.add_vnode(tree, {1}, {0});
    const int v2 = b.add_vnode(tree, {2}, {1});
    b.add_item(v2, 0, 4, 3, 1, 3);
    b.add_item(v0, 0, 5, 0, 2, 0);
    b.add_item(v1, 0, 3, 2, 1, 2, 1);  // tile class 1: kv_tile 3
    b.set_merge({{0, 2}, {1, 3}}, 4);
    expect_executor_matches_reference(b.p, tree, s, 12, 21);
    expect_executor_matches_reference(b.p, tree, s, 12, 22, 1);
  }
}

// Direct queries: query 0 at the leaf reads root + leaf in one vnode (edge 1, two segments) and one
// item; query 1 at the root has its own vnode and item. Both are written straight to the output.
TEST(CpuExecutor, DirectQueries) {
  KvTree tree;
  tree.add_node(-1, 4);
  tree.add_node(0, 3);
  tree.add_query(1);
  tree.add_query(0);
  AttnShape s{8, 2, 32};
  PlanBuilder b(2, s, 2);
  const int v0 = b.add_vnode(tree, {0, 1}, {0});
  const int v1 = b.add_vnode(tree, {0}, {1});
  b.add_item(v0, 0, 7, 0, 1, 0);
  b.add_item(v1, 0, 4, 1, 1, 0);
  b.p.query_direct = {1, 1};
  b.set_merge({{}, {}}, 0);
  expect_executor_matches_reference(b.p, tree, s, tree.num_tokens(), 31);
}

// One vnode (root 4 tokens + leaf 5 tokens, edge 1) serving 3 queries, its context split into two
// chunks [0, 6) and [6, 9) — the boundary falls inside the leaf's segment — and its queries into
// tiles of 2 and 1. Each query merges its two chunk partials. A fourth query at the root is direct.
TEST(CpuExecutor, SplitChunksAndQueryTiles) {
  KvTree tree;
  tree.add_node(-1, std::vector<int32_t>{20, 21, 5, 6});
  tree.add_node(0, std::vector<int32_t>{1, 9, 2, 14, 3});
  tree.add_query(1);
  tree.add_query(1);
  tree.add_query(0);
  tree.add_query(1);
  for (AttnShape s : {AttnShape{2, 1, 8}, AttnShape{4, 4, 128}}) {
    PlanBuilder b(4, s, 4);
    const int v0 = b.add_vnode(tree, {0, 1}, {0, 1, 3});
    const int v1 = b.add_vnode(tree, {0}, {2});
    b.add_item(v0, 0, 6, 0, 2, 0);  // queries 0, 1 -> rows 0, 1
    b.add_item(v0, 0, 6, 2, 1, 2);  // query 3 -> row 2
    b.add_item(v0, 6, 3, 0, 2, 3);  // rows 3, 4
    b.add_item(v1, 0, 4, 3, 1, 0, 1);
    b.add_item(v0, 6, 3, 2, 1, 5, 1);  // row 5
    b.p.query_direct = {0, 0, 1, 0};
    b.set_merge({{0, 3}, {4, 1}, {}, {5, 2}}, 6);
    expect_executor_matches_reference(b.p, tree, s, 22, 41);
  }
}

// A query whose path has no tokens is non-direct with no merge rows: out = 0, lse = -inf.
TEST(CpuExecutor, EmptyPathQuery) {
  KvTree tree;
  tree.add_node(-1, 0);
  tree.add_node(-1, 3);
  tree.add_query(0);
  tree.add_query(1);
  AttnShape s{4, 2, 8};
  PlanBuilder b(2, s, 64);
  const int v0 = b.add_vnode(tree, {1}, {1});
  b.add_item(v0, 0, 3, 0, 1, 0);
  b.p.query_direct = {0, 1};
  b.set_merge({{}, {}}, 0);
  expect_executor_matches_reference(b.p, tree, s, 3, 51);
  Inputs in(tree, s, 3, 52);
  std::vector<float> out(in.q.size(), NAN), lse(8, NAN);
  execute_plan(b.p, tree, s, in.q, in.k, in.v, 0.5f, out, lse);
  for (int h = 0; h < 4; ++h) {
    EXPECT_EQ(lse[h], -kInf);
    for (int c = 0; c < 8; ++c) EXPECT_EQ(out[h * 8 + c], 0.0f);
  }
}

TEST(CpuExecutor, WorkspaceIsReusedAcrossPlans) {
  KvTree tree;
  tree.add_node(-1, 6);
  tree.add_node(0, 2);
  tree.add_query(1);
  tree.add_query(1);
  AttnShape s{2, 2, 8};
  CpuWorkspace ws;
  Inputs in(tree, s, 8, 61);
  std::vector<float> ref(in.q.size()), out(in.q.size());
  reference_attention(tree, s, in.q, in.k, in.v, 0.25f, ref, {});
  // Plan A: split into 3 chunks (6 partial rows); plan B: one direct item per query.
  PlanBuilder a(2, s, 2);
  const int va = a.add_vnode(tree, {0, 1}, {0, 1});
  a.add_item(va, 0, 3, 0, 2, 0);
  a.add_item(va, 3, 3, 0, 2, 2);
  a.add_item(va, 6, 2, 0, 2, 4);
  a.set_merge({{0, 2, 4}, {1, 3, 5}}, 6);
  PlanBuilder b(2, s, 2);
  const int vb = b.add_vnode(tree, {0, 1}, {0, 1});
  b.add_item(vb, 0, 8, 0, 2, 0);
  b.p.query_direct = {1, 1};
  b.set_merge({{}, {}}, 0);
  for (const Plan* p : {&a.p, &b.p, &a.p}) {
    std::fill(out.begin(), out.end(), NAN);
    execute_plan(*p, tree, s, in.q, in.k, in.v, 0.25f, out, {}, ws, 2);
    EXPECT_LE(max_row_rel_error(out, ref, s.head_dim), 1e-5);
  }
}

TEST(CpuExecutor, BadPlansAndSpansThrow) {
  KvTree tree;
  tree.add_node(-1, 4);
  tree.add_node(0, 3);
  tree.add_query(1);
  tree.add_query(1);
  AttnShape s{4, 2, 8};
  PlanBuilder b(2, s, 2);
  const int v0 = b.add_vnode(tree, {0}, {0, 1});
  const int v1 = b.add_vnode(tree, {1}, {0, 1});
  b.add_item(v0, 0, 4, 0, 2, 0);
  b.add_item(v1, 0, 3, 2, 2, 2);
  b.set_merge({{0, 2}, {1, 3}}, 4);
  const Plan good = b.p;
  Inputs in(tree, s, 7, 71);
  std::vector<float> out(in.q.size()), lse(8);
  auto run = [&](const Plan& p) { execute_plan(p, tree, s, in.q, in.k, in.v, 0.5f, out, lse); };
  ASSERT_NO_THROW(run(good));

  auto expect_bad = [&](auto mutate) {
    Plan p = good;
    mutate(p);
    EXPECT_THROW(run(p), Error);
  };
  expect_bad([](Plan& p) { p.num_qo_heads = 8; });
  expect_bad([](Plan& p) { p.num_kv_heads = 4; });
  expect_bad([](Plan& p) { p.num_queries = 3; });
  expect_bad([](Plan& p) { p.items[0].vnode = 2; });
  expect_bad([](Plan& p) { p.items[0].vnode = -1; });
  expect_bad([](Plan& p) { p.items[1].kv_len = 4; });         // past the vnode's context
  expect_bad([](Plan& p) { p.items[1].kv_len = 0; });
  expect_bad([](Plan& p) { p.items[0].q_count = 3; });        // past the vnode's queries
  expect_bad([](Plan& p) { p.items[0].tile_class = 2; });
  expect_bad([](Plan& p) { p.tile_classes[0].kv_tile = 0; });
  expect_bad([](Plan& p) { p.items[1].out_row = 4; });        // rows 4, 5 out of range
  expect_bad([](Plan& p) { p.items[1].out_row = 0; });        // writes rows owned by other queries
  expect_bad([](Plan& p) { p.items.pop_back(); });            // rows 2, 3 never written
  expect_bad([](Plan& p) { p.items.push_back(p.items[0]); }); // rows 0, 1 written twice
  expect_bad([](Plan& p) { p.merge_rows[3] = 2; });           // row 2 listed twice
  expect_bad([](Plan& p) { p.merge_begin.pop_back(); });
  expect_bad([](Plan& p) { p.query_direct[0] = 1; });         // direct with merge rows
  expect_bad([](Plan& p) { p.segments[1].slot_offset = 5; }); // past tree.slots
  expect_bad([](Plan& p) { p.segments[1].token_begin = 1; }); // segments do not tile the context
  expect_bad([](Plan& p) { p.vnode_len[0] = 5; });
  expect_bad([](Plan& p) { p.vnode_queries[0] = 2; });
  expect_bad([](Plan& p) { p.vnode_q_begin[1] = 1; });        // item 0 tile leaves the vnode
  expect_bad([](Plan& p) { p.num_tile_classes = 0; });
  // Private pieces (folded leaves) that do not fit their item.
  auto with_piece = [](Plan& p, PlanPrivate piece, int32_t len) {
    p.privates.push_back(piece);
    p.items[0].priv_begin = 0;
    p.items[0].priv_count = 1;
    p.items[0].priv_len = len;
  };
  expect_bad([&](Plan& p) { with_piece(p, PlanPrivate{2, 0, 0, 3}, 3); });  // no such vnode
  expect_bad([&](Plan& p) { with_piece(p, PlanPrivate{1, 2, 0, 3}, 3); });  // query index past the tile
  expect_bad([&](Plan& p) { with_piece(p, PlanPrivate{1, 0, 0, 2}, 2); });  // length is not the vnode's
  expect_bad([&](Plan& p) { with_piece(p, PlanPrivate{1, 0, 1, 3}, 3); });  // does not start the region
  expect_bad([&](Plan& p) { with_piece(p, PlanPrivate{1, 0, 0, 3}, 4); });  // priv_len disagrees
  expect_bad([](Plan& p) { p.items[0].priv_count = 1; });                  // past plan.privates
  {  // direct query never written
    Plan p = good;
    p.query_direct = {1, 1};
    p.merge_begin = {0, 0, 0};
    p.merge_rows.clear();
    p.items.clear();
    EXPECT_THROW(run(p), Error);
  }

  // Spans.
  std::vector<float> shortq(in.q.begin(), in.q.end() - 1), badout(out.size() - 1), badlse(7);
  EXPECT_THROW(execute_plan(good, tree, s, shortq, in.k, in.v, 0.5f, out, lse), Error);
  EXPECT_THROW(execute_plan(good, tree, s, in.q, in.k, in.v, 0.5f, badout, lse), Error);
  EXPECT_THROW(execute_plan(good, tree, s, in.q, in.k, in.v, 0.5f, out, badlse), Error);
  std::vector<float> oddk(in.k.begin(), in.k.end() - 1);
  EXPECT_THROW(execute_plan(good, tree, s, in.q, oddk, oddk, 0.5f, out, lse), Error);
  std::vector<float> shortv(in.v.begin(), in.v.end() - 16);
  EXPECT_THROW(execute_plan(good, tree, s, in.q, in.k, shortv, 0.5f, out, lse), Error);
  std::vector<float> k6(in.k.begin(), in.k.begin() + 6 * 16);  // slot 6 missing from the pool
  EXPECT_THROW(execute_plan(good, tree, s, in.q, k6, k6, 0.5f, out, lse), Error);
  // Shape mismatch with the plan.
  EXPECT_THROW(execute_plan(good, tree, AttnShape{4, 4, 8}, in.q, in.k, in.v, 0.5f, out, lse), Error);
  EXPECT_THROW(execute_plan(good, tree, AttnShape{4, 3, 8}, in.q, in.k, in.v, 0.5f, out, lse), Error);
}

}  // namespace
}  // namespace fasttree
