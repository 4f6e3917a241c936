// Property test: on random forests, executing the planner's plan on the CPU (cpu/executor.h, fp32
// online softmax + LSE merge) equals the fp64 reference attention (cpu/reference.h), for every
// planner ablation (edge policy greedy / all-zero / all-one, context splitting on / off).
//
// Error measure, per (query, qo head) row of the output:
//   rel = max_c |exec - ref| / max(1e-6, max_c |ref|)   must be <= 1e-5 for every row,
// and the LSE must satisfy |exec - ref| <= 1e-5 * max(1, |ref|) (both -inf for an empty path).
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "core/attention_shape.h"
#include "core/kv_tree.h"
#include "core/tree_gen.h"
#include "cpu/executor.h"
#include "cpu/reference.h"
#include "plan/plan.h"
#include "plan/planner.h"

namespace fasttree {
namespace {

constexpr double kTol = 1e-5;

std::vector<float> random_vec(size_t n, std::mt19937& rng) {
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  std::vector<float> x(n);
  for (float& e : x) e = dist(rng);
  return x;
}

struct Ablation {
  const char* name;
  EdgePolicy edges;
  bool split;
  int fold_max;  // leaf folding (PlannerConfig::fold_max)
};
constexpr std::array<Ablation, 8> kAblations{{
    {"greedy+split", EdgePolicy::kGreedy, true, 0},
    {"greedy", EdgePolicy::kGreedy, false, 0},
    {"all0+split", EdgePolicy::kAllZero, true, 0},
    {"all0", EdgePolicy::kAllZero, false, 0},
    {"all1+split", EdgePolicy::kAllOne, true, 0},
    {"all1", EdgePolicy::kAllOne, false, 0},
    {"greedy+split+fold", EdgePolicy::kGreedy, true, 64},
    {"all0+fold", EdgePolicy::kAllZero, false, kMaxFoldTokens},
}};

// Coverage counters, so the test proves it exercised what it claims to.
struct Coverage {
  int64_t split_items = 0;       // items with kv_begin > 0
  int64_t direct_queries = 0;
  int64_t merged_queries = 0;    // non-direct queries with >= 2 partial rows
  int64_t empty_paths = 0;
  int64_t internal_queries = 0;  // queries at a node with children
  int64_t multi_tile_chunks = 0; // items longer than their kv_tile
  int64_t folded_leaves = 0;     // private pieces
  std::array<int, 17> gqa_seen{};
  std::array<int, 3> dim_seen{};
};

TEST(CpuExecutorProperty, MatchesReferenceOnRandomForests) {
  constexpr int kSeeds = 200;
  constexpr std::array<int, 5> kGqa{1, 2, 4, 8, 16};
  constexpr std::array<int, 3> kDims{64, 128, 256};
  Coverage cov;
  double worst_rel = 0, worst_lse = 0;
  CpuWorkspace ws;

  for (int seed = 0; seed < kSeeds; ++seed) {
    std::mt19937 rng(1000 + seed);
    // Small forests; every 10th seed is mostly empty nodes (empty paths, empty vnodes).
    RandomForestSpec spec;
    spec.min_roots = 1;
    spec.max_roots = 3;
    spec.max_depth = 1 + static_cast<int>(rng() % 4);
    spec.max_fanout = 3;
    spec.min_len = 0;
    spec.max_len = std::array<int64_t, 3>{6, 24, 48}[rng() % 3];
    spec.empty_node_prob = seed % 10 == 0 ? 0.7 : 0.15;
    spec.max_queries_per_leaf = 3;
    spec.internal_query_prob = 0.35;
    spec.explicit_slots = seed % 2 == 1;
    spec.shuffle_queries = seed % 3 == 0;
    const KvTree tree = random_forest(spec, static_cast<uint64_t>(seed));
    const int64_t num_slots = std::max<int64_t>(1, max_slot_plus_one(tree));

    // (g, d) cover every pair; Hkv = 2 on some seeds where the row count stays small.
    const int g = kGqa[seed % 5];
    const int d = kDims[(seed / 5) % 3];
    const int hkv = (seed % 7 == 3 && g * d <= 512) ? 2 : 1;
    const AttnShape shape{g * hkv, hkv, d};
    ++cov.gqa_seen[g];
    ++cov.dim_seen[(seed / 5) % 3];

    const int nq = tree.num_queries();
    const size_t rows = static_cast<size_t>(nq) * shape.num_qo_heads;
    const std::vector<float> q = random_vec(rows * d, rng);
    const std::vector<float> k = random_vec(static_cast<size_t>(num_slots) * hkv * d, rng);
    const std::vector<float> v = random_vec(static_cast<size_t>(num_slots) * hkv * d, rng);
    const float scale = shape.default_sm_scale();

    std::vector<float> ref(rows * d), ref_lse(rows);
    reference_attention(tree, shape, q, k, v, scale, ref, ref_lse);

    TreeTopology topo;
    topo.build(tree);
    for (int qi = 0; qi < nq; ++qi) {
      cov.empty_paths += topo.path_len[tree.query_node[qi]] == 0;
      cov.internal_queries += topo.num_children(tree.query_node[qi]) > 0;
    }

    // Tile classes: the defaults, small tiles (many KV tiles per chunk), or three classes.
    PlannerConfig base;
    switch (seed % 3) {
      case 0: break;
      case 1:
        base.tile_classes = {{{32, 16}, {16, 8}, {0, 0}, {0, 0}}};
        base.num_tile_classes = 2;
        break;
      default:
        base.tile_classes = {{{16, 8}, {128, 32}, {64, 16}, {0, 0}}};
        base.num_tile_classes = 3;
        break;
    }
    base.min_chunk = 8;  // small contexts still get split
    base.num_sms = std::array<int, 3>{1, 4, 132}[seed % 3];

    for (const Ablation& ab : kAblations) {
      PlannerConfig cfg = base;
      cfg.edges = ab.edges;
      cfg.split = ab.split;
      cfg.fold_max = ab.fold_max;
      cfg.fold_min_rows = 0;  // fold wherever possible
      cfg.fold_min_waves = 0;
      Planner planner(cfg);
      Plan plan;
      planner.build(tree, shape, plan);

      std::vector<float> out(rows * d, NAN), lse(rows, NAN);  // poisoned: unwritten rows fail
      execute_plan(plan, tree, shape, q, k, v, scale, out, lse, ws);

      cov.folded_leaves += static_cast<int64_t>(plan.privates.size());
      for (const PlanItem& it : plan.items) {
        cov.split_items += it.kv_begin > 0;
        cov.multi_tile_chunks += it.kv_len > plan.tile_classes[it.tile_class].kv_tile;
      }
      for (int qi = 0; qi < nq; ++qi) {
        cov.direct_queries += plan.query_direct[qi] != 0;
        cov.merged_queries += plan.merge_begin[qi + 1] - plan.merge_begin[qi] >= 2;
      }

      for (size_t r = 0; r < rows; ++r) {
        double diff = 0, mag = 0;
        for (int c = 0; c < d; ++c) {
          const double a = out[r * d + c], b = ref[r * d + c];
          diff = std::isnan(a) ? INFINITY : std::max(diff, std::abs(a - b));
          mag = std::max(mag, std::abs(b));
        }
        const double rel = diff / std::max(1e-6, mag);
        worst_rel = std::max(worst_rel, rel);
        double lse_err;
        if (std::isinf(ref_lse[r])) {
          lse_err = (std::isinf(lse[r]) && lse[r] < 0) ? 0.0 : INFINITY;
        } else {
          lse_err = std::isnan(lse[r]) ? INFINITY
                                        : std::abs(double(lse[r]) - ref_lse[r]) / std::max(1.0, std::abs(double(ref_lse[r])));
        }
        worst_lse = std::max(worst_lse, lse_err);
        if (rel > kTol || lse_err > kTol) {
          ADD_FAILURE() << "seed " << seed << " " << ab.name << " g=" << g << " hkv=" << hkv << " d=" << d
                        << " query " << r / shape.num_qo_heads << " head " << r % shape.num_qo_heads
                        << ": rel " << rel << ", lse " << lse[r] << " vs " << ref_lse[r];
          return;
        }
      }
    }
  }
  std::printf("worst row relative error %.3g, worst lse error %.3g\n", worst_rel, worst_lse);
  std::printf("coverage: split items %lld, multi-tile chunks %lld, direct %lld, merged %lld, empty paths %lld, "
              "internal-node queries %lld, folded leaves %lld\n",
              (long long)cov.split_items, (long long)cov.multi_tile_chunks, (long long)cov.direct_queries,
              (long long)cov.merged_queries, (long long)cov.empty_paths, (long long)cov.internal_queries,
              (long long)cov.folded_leaves);
  EXPECT_GT(cov.split_items, 0);
  EXPECT_GT(cov.multi_tile_chunks, 0);
  EXPECT_GT(cov.direct_queries, 0);
  EXPECT_GT(cov.merged_queries, 0);
  EXPECT_GT(cov.empty_paths, 0);
  EXPECT_GT(cov.internal_queries, 0);
  EXPECT_GT(cov.folded_leaves, 0);
  for (int g : kGqa) EXPECT_GT(cov.gqa_seen[g], 0) << "g=" << g;
  for (int i = 0; i < 3; ++i) EXPECT_GT(cov.dim_seen[i], 0);
}

}  // namespace
}  // namespace fasttree
