// CUDA tree attention (cuda/tree_attention.h through the host entry points of cuda/backend.h)
// against the fp64 CPU reference (cpu/reference.h). Every GPU test skips itself when no CUDA device
// is present, so CI without a GPU passes.
//
// Inputs are uniform in [-1, 1] and rounded to the device dtype BEFORE the reference is computed,
// so the only differences are fp32 accumulation and the rounding of P to the dtype for P·V.
// Device outputs (and the partial workspace) are poisoned with NaN before each run, so an unwritten
// element fails. Every check runs several launch modes (run_and_check).
// Tolerances (absolute, outputs are averages of values in [-1, 1], |O| <= 1):
//   out: max |gpu - ref| <= 5e-3 (fp16: P carries 11 bits) or 2e-2 (bf16: 8 bits)
//   lse: |gpu - ref| <= 1e-3 * max(1, |ref|) (P rounding does not enter the LSE); -inf == -inf.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <sstream>
#include <random>
#include <string>
#include <vector>

#include "core/attention_shape.h"
#include "core/half.h"
#include "core/kv_tree.h"
#include "core/tree_gen.h"
#include "cpu/executor.h"
#include "cpu/reference.h"
#include "cuda/backend.h"
#include "cuda/merge_choice.h"
#include "cuda/rotation_rule.h"
#include "cuda/tile_slots.h"
#if FASTTREE_HAVE_CUDA
#include "cuda/tree_attention.h"
#endif
#include "plan/per_request_plan.h"
#include "plan/plan.h"
#include "plan/plan_stats.h"
#include "plan/plan_validate.h"
#include "plan/planner.h"

namespace fasttree {
namespace {

#define SKIP_WITHOUT_GPU() \
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device"

double out_tol(KvDType t) { return t == KvDType::kF16 ? 5e-3 : 2e-2; }
const char* dtype_name(KvDType t) { return t == KvDType::kF16 ? "f16" : "bf16"; }

float round_to(float x, KvDType t) {
  return t == KvDType::kF16 ? half_to_float(float_to_half(x)) : bf16_to_float(float_to_bf16(x));
}

std::vector<float> random_rounded(size_t n, KvDType t, std::mt19937& rng) {
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  std::vector<float> x(n);
  for (float& e : x) e = round_to(dist(rng), t);
  return x;
}

struct Tensors {
  std::vector<float> q, k, v;
  Tensors(const KvTree& tree, const AttnShape& s, KvDType t, uint32_t seed) {
    std::mt19937 rng(seed);
    const int64_t slots = std::max<int64_t>(1, max_slot_plus_one(tree));
    q = random_rounded(static_cast<size_t>(tree.num_queries()) * s.num_qo_heads * s.head_dim, t, rng);
    k = random_rounded(static_cast<size_t>(slots) * s.num_kv_heads * s.head_dim, t, rng);
    v = random_rounded(static_cast<size_t>(slots) * s.num_kv_heads * s.head_dim, t, rng);
  }
};

struct Errors {
  double out = 0;  // max abs error of O
  double lse = 0;  // max |Δlse| / max(1, |ref|)
};

// Compares a GPU result with the reference; NaN anywhere counts as an infinite error.
Errors compare(const std::vector<float>& out, const std::vector<float>& lse, const std::vector<float>& ref_out,
               const std::vector<float>& ref_lse) {
  Errors e;
  for (size_t i = 0; i < ref_out.size(); ++i) {
    const double d = std::isnan(out[i]) ? INFINITY : std::abs(double(out[i]) - ref_out[i]);
    e.out = std::max(e.out, d);
  }
  for (size_t i = 0; i < ref_lse.size(); ++i) {
    double d;
    if (std::isinf(ref_lse[i])) {
      d = (std::isinf(lse[i]) && lse[i] < 0) ? 0.0 : INFINITY;
    } else {
      d = std::isnan(lse[i]) ? INFINITY : std::abs(double(lse[i]) - ref_lse[i]) / std::max(1.0, std::abs(double(ref_lse[i])));
    }
    e.lse = std::max(e.lse, d);
  }
  return e;
}

struct Reference {
  std::vector<float> out, lse;
  Reference(const KvTree& tree, const AttnShape& s, const Tensors& x, float scale) {
    out.assign(x.q.size(), 0.0f);
    lse.assign(static_cast<size_t>(tree.num_queries()) * s.num_qo_heads, 0.0f);
    reference_attention(tree, s, x.q, x.k, x.v, scale, out, lse);
  }
};

// Runs `plan` on the GPU (poisoned outputs) in each launch mode below and checks each against the
// reference; returns the worst errors.
Errors run_and_check(const Plan& plan, const KvTree& tree, const AttnShape& s, KvDType t, const Tensors& x,
                     const Reference& ref, float scale, const std::string& what, CudaRunOptions opt = {}) {
  opt.poison_outputs = true;
  Errors worst;
  // Every mode but 1 loads full K/V tiles by TMA. Modes: the main kernel alone with the lane-group
  // merge kernel (0); merge launch without and with the warp-per-unit path (every block of <= 16
  // rows on it, any chunk length, so multi-chunk units and run-window moves are covered too), the
  // latter with the cp.async-staged warp kernel (2) and the register one (4).
  // Mode 3: head-major K/V pools ([Hkv, S, d]): the main kernel and, at d <= 128, the staged warp path
  // with a ring of 3 jobs and 3 warps per CTA (modes 2: 2 jobs, 2 warps). Modes 1 and 3 merge with
  // the wide merge kernel (one CTA per job), modes 2 and 4 with the lane-group one.
  for (int mode = 0; mode < 5; ++mode) {
    const bool warp_mode = mode == 2 || mode == 4;
    if (warp_mode && s.head_dim > 128) continue;  // the warp path has no d = 256 kernel
    opt.warp_unit_max_kv = warp_mode || (mode == 3 && s.head_dim <= 128) ? (1 << 30) : 0;
    opt.warp_unit_min_units = 0;
    opt.warp_overlap = 1;  // the warp kernel beside the main kernel (side stream)
    opt.warp_staged = mode == 4 ? 0 : 1;
    opt.warp_stages = mode == 3 ? 3 : 2;
    opt.warp_cta_warps = mode == 3 ? 3 : 2;
    opt.kv_head_major = mode == 3;
    opt.merge_wide = mode == 1 || mode == 3 ? 1 : 0;
    // Full single-run K/V tiles by TMA (required: the H200 has it) except in mode 1, which keeps
    // the main kernel's cp.async path for them covered.
    opt.use_tma = mode == 1 ? 0 : 1;
    opt.require_tma = mode != 1;
    // Both tree-kernel variants at d = 128 and every GQA ratio: the 3-stage one (Q read from
    // global memory) in modes 0, 2, 4, the 2-stage one (Q staged in shared memory) in 1 and 3.
    opt.deep_ring = mode == 1 || mode == 3 ? 0 : 1;
    const char* tag = mode == 0   ? " [main kernel + merge launch]"
                      : mode == 1 ? " [wide merge launch]"
                      : mode == 2 ? " [staged warp-per-unit + merge launch]"
                      : mode == 3 ? " [head-major K/V, wide merge]"
                                  : " [register warp-per-unit + merge launch]";
    std::vector<float> out(x.q.size(), NAN), lse(ref.lse.size(), NAN);
    cuda_attention(plan, tree, s, t, x.q, x.k, x.v, scale, out, lse, opt);
    const Errors e = compare(out, lse, ref.out, ref.lse);
    EXPECT_LE(e.out, out_tol(t)) << what << tag;
    EXPECT_LE(e.lse, 1e-3) << what << tag;
    worst.out = std::max(worst.out, e.out);
    worst.lse = std::max(worst.lse, e.lse);
  }
  return worst;
}

struct PlanVariant {
  const char* name;
  EdgePolicy edges;
  bool split;
  int num_sms;     // small values force context splitting on small trees
  int64_t min_chunk;
  int fold_max = 0;  // leaf folding: private pieces, tiles with per-row column masks
};
constexpr PlanVariant kVariants[] = {
    {"greedy", EdgePolicy::kGreedy, true, 132, 256},
    {"all0", EdgePolicy::kAllZero, true, 132, 256},
    {"nosplit", EdgePolicy::kGreedy, false, 132, 256},
    {"greedy+chunks", EdgePolicy::kGreedy, true, 4, 64},
    {"all1+chunks", EdgePolicy::kAllOne, true, 4, 16},
    {"greedy+fold", EdgePolicy::kGreedy, true, 132, 256, 64},
    {"all0+chunks+fold", EdgePolicy::kAllZero, true, 4, 64, kMaxFoldTokens},
};
constexpr const PlanVariant& kFoldVariant = kVariants[6];

Plan make_plan(const KvTree& tree, const AttnShape& s, const PlanVariant& v, PlannerConfig cfg = {}) {
  cfg.edges = v.edges;
  cfg.split = v.split;
  cfg.num_sms = v.num_sms;
  cfg.min_chunk = v.min_chunk;
  cfg.fold_max = v.fold_max;
  cfg.fold_min_rows = 0;  // fold wherever possible: 16-, 32- and 64-row blocks, small plans
  cfg.fold_min_waves = 0;
  cfg.narrow_max_path = 0;  // the variants keep their tile classes (narrow mode: PlannerNarrow tests)
  Planner planner(cfg);
  Plan plan;
  planner.build(tree, s, plan);
  return plan;
}

AttnShape shape_for_gqa(int g, int d) {
  switch (g) {
    case 1: return AttnShape{4, 4, d};
    case 2: return AttnShape{4, 2, d};
    case 4: return AttnShape{8, 2, d};
    case 8: return AttnShape{8, 1, d};
    case 16: return AttnShape{16, 1, d};
    default: return AttnShape{g, 1, d};
  }
}

// Every (head_dim, dtype, GQA) on its own random forest (internal-node queries, empty nodes,
// explicit shuffled slots on odd seeds), under every plan variant.
TEST(CudaAttention, RandomForestsAllShapes) {
  SKIP_WITHOUT_GPU();
  double worst[2] = {0, 0};
  int combo = 0;
  for (int d : {64, 128, 256}) {
    for (KvDType t : {KvDType::kF16, KvDType::kBF16}) {
      for (int g : {1, 2, 4, 8, 16}) {
        RandomForestSpec spec;
        spec.max_roots = 2;
        spec.max_depth = 4;
        spec.max_fanout = 3;
        spec.max_len = 90;
        spec.empty_node_prob = 0.15;
        spec.internal_query_prob = 0.3;
        spec.max_queries_per_leaf = 3;
        spec.explicit_slots = combo % 2 == 1;
        spec.shuffle_queries = combo % 3 == 2;
        const KvTree tree = random_forest(spec, 1000 + combo);
        const AttnShape s = shape_for_gqa(g, d);
        const Tensors x(tree, s, t, 7 + combo);
        const float scale = s.default_sm_scale();
        const Reference ref(tree, s, x, scale);
        for (const PlanVariant& v : kVariants) {
          const Plan plan = make_plan(tree, s, v);
          const std::string what = std::string(dtype_name(t)) + " d=" + std::to_string(d) + " g=" + std::to_string(g) +
                                   " " + v.name + " seed " + std::to_string(1000 + combo);
          const Errors e = run_and_check(plan, tree, s, t, x, ref, scale, what);
          worst[t == KvDType::kBF16] = std::max(worst[t == KvDType::kBF16], e.out);
        }
        ++combo;
      }
    }
  }
  std::printf("[ info ] worst max-abs error: f16 %.2e, bf16 %.2e\n", worst[0], worst[1]);
}

// A small case per (head_dim, dtype) with merges, 16/32/64-row tiles and a multi-tile chunk: the
// subset scripts/gpu_check.sh runs under compute-sanitizer (memcheck, racecheck).
TEST(CudaAttention, SanitizerSmall) {
  SKIP_WITHOUT_GPU();
  RandomForestSpec spec;
  spec.max_roots = 1;
  spec.max_depth = 3;
  spec.max_fanout = 3;
  spec.max_len = 100;
  spec.internal_query_prob = 0.5;
  spec.explicit_slots = true;
  const KvTree tree = random_forest(spec, 11);
  // Folded leaves (private pieces in 16-, 32- and 64-row blocks, tiles mixing shared and private
  // columns): every leaf of 10 tokens rides in its parent's item.
  const KvTree levels = tree_from_levels(std::vector<int64_t>{1, 2, 8}, std::vector<int64_t>{70, 20, 10});
  // A 64-row block over a 300-token root, unsplit: full middle tiles in a row (the 3-stage kernel's
  // pipelined path at d = 128, GQA < 8, its P passed through shared memory).
  const KvTree runs = tree_from_levels(std::vector<int64_t>{1, 20}, std::vector<int64_t>{300, 8});
  for (int d : {64, 128, 256}) {
    for (KvDType t : {KvDType::kF16, KvDType::kBF16}) {
      const AttnShape s{8, 2, d};
      const Tensors x(runs, s, t, 5);
      const Reference ref(runs, s, x, s.default_sm_scale());
      run_and_check(make_plan(runs, s, kVariants[2]), runs, s, t, x, ref, s.default_sm_scale(),
                    std::string("sanitizer runs ") + dtype_name(t) + " d=" + std::to_string(d));
    }
    for (KvDType t : {KvDType::kF16, KvDType::kBF16}) {
      for (const AttnShape s : {AttnShape{2, 2, d}, AttnShape{16, 1, d}}) {
        const Tensors x(tree, s, t, 3);
        const Reference ref(tree, s, x, s.default_sm_scale());
        run_and_check(make_plan(tree, s, kVariants[3]), tree, s, t, x, ref, s.default_sm_scale(),
                      std::string("sanitizer ") + dtype_name(t) + " d=" + std::to_string(d));
        const Tensors xl(levels, s, t, 4);
        const Reference refl(levels, s, xl, s.default_sm_scale());
        const Plan plan = make_plan(levels, s, kFoldVariant);
        EXPECT_EQ(plan.privates.size(), 8u);
        run_and_check(plan, levels, s, t, xl, refl, s.default_sm_scale(),
                      std::string("sanitizer folded ") + dtype_name(t) + " d=" + std::to_string(d));
      }
    }
  }
}

// The paper's level trees (scaled down), GQA 1 / 4 / 16, d = 128.
TEST(CudaAttention, LevelTrees) {
  SKIP_WITHOUT_GPU();
  struct Levels {
    std::vector<int64_t> counts, lens;
  };
  const Levels trees[] = {{{1, 10}, {1000, 100}}, {{1, 4, 16}, {300, 64, 20}}, {{1, 2, 4, 8, 16}, {16, 16, 16, 16, 16}},
                          {{1, 64}, {256, 32}}};
  int i = 0;
  for (const Levels& lv : trees) {
    const KvTree tree = tree_from_levels(lv.counts, lv.lens);
    for (const AttnShape s : {AttnShape{8, 8, 128}, AttnShape{16, 4, 128}, AttnShape{16, 1, 128}}) {
      for (KvDType t : {KvDType::kF16, KvDType::kBF16}) {
        const Tensors x(tree, s, t, 100 + i++);
        const float scale = s.default_sm_scale();
        const Reference ref(tree, s, x, scale);
        for (const PlanVariant& v : {kVariants[0], kVariants[1], kVariants[2], kVariants[5], kFoldVariant}) {
          run_and_check(make_plan(tree, s, v), tree, s, t, x, ref, scale,
                        std::string("levels tree ") + std::to_string(&lv - trees) + " g=" + std::to_string(s.gqa()) +
                            " " + dtype_name(t) + " " + v.name);
        }
      }
    }
  }
}

// A deep chain (vnodes of more than 32 segments: the kernel's segment window must slide), a wide
// fan-out of tiny leaves, 1-token nodes, and a large sm_scale (scores far above exp's range).
TEST(CudaAttention, DeepWideAndLargeScores) {
  SKIP_WITHOUT_GPU();
  KvTree deep;
  int prev = -1;
  for (int i = 0; i < 80; ++i) {
    prev = deep.add_node(prev, i % 7 == 3 ? 0 : 1 + (i * 5) % 9);
    if (i % 11 == 10) deep.add_query(prev);
  }
  deep.add_query(prev);
  KvTree wide;
  wide.add_node(-1, 500);
  for (int i = 0; i < 300; ++i) wide.add_query(wide.add_node(0, 1 + i % 4));
  wide.add_query(0);
  for (KvDType t : {KvDType::kF16, KvDType::kBF16}) {
    for (const KvTree* tree : {&deep, &wide}) {
      const AttnShape s{8, 2, 128};
      const Tensors x(*tree, s, t, 5);
      for (float scale : {s.default_sm_scale(), 2.0f}) {
        const Reference ref(*tree, s, x, scale);
        for (const PlanVariant& v : kVariants) {
          run_and_check(make_plan(*tree, s, v), *tree, s, t, x, ref, scale,
                        std::string(tree == &deep ? "deep" : "wide") + " " + dtype_name(t) + " " + v.name +
                            " scale " + std::to_string(scale));
        }
      }
    }
  }
}

// Queries on empty paths (O = 0, LSE = -inf), and a plan with no work item at all.
TEST(CudaAttention, EmptyPathsAndEmptyPlan) {
  SKIP_WITHOUT_GPU();
  KvTree tree;
  tree.add_node(-1, 0);
  tree.add_node(0, 0);
  tree.add_node(-1, 40);
  tree.add_node(2, 0);
  for (int n : {1, 2, 0, 3, 1}) tree.add_query(n);
  KvTree empty;
  empty.add_node(-1, 0);
  empty.add_query(0);
  empty.add_query(0);
  for (const KvTree* tr : {&tree, &empty}) {
    const AttnShape s{4, 2, 64};
    const Tensors x(*tr, s, KvDType::kF16, 3);
    const Reference ref(*tr, s, x, s.default_sm_scale());
    for (const PlanVariant& v : kVariants)
      run_and_check(make_plan(*tr, s, v), *tr, s, KvDType::kF16, x, ref, s.default_sm_scale(), v.name);
  }
}

// GQA 32 (32-row tiles of one query), and tile classes above 64 rows (several 64-row blocks per item).
TEST(CudaAttention, TileRowsBeyondClasses) {
  SKIP_WITHOUT_GPU();
  RandomForestSpec spec;
  spec.max_depth = 3;
  spec.max_fanout = 6;
  spec.max_len = 150;
  spec.max_queries_per_leaf = 4;
  const KvTree tree = random_forest(spec, 77);
  for (KvDType t : {KvDType::kF16, KvDType::kBF16}) {
    {
      const AttnShape s{32, 1, 128};
      const Tensors x(tree, s, t, 9);
      const Reference ref(tree, s, x, s.default_sm_scale());
      for (const PlanVariant& v : kVariants) run_and_check(make_plan(tree, s, v), tree, s, t, x, ref, s.default_sm_scale(), v.name);
    }
    {
      const AttnShape s{16, 1, 64};
      PlannerConfig cfg;
      cfg.tile_classes = {{{128, 64}, {48, 32}, {0, 0}, {0, 0}}};  // 8 queries = 128 rows; 3 queries = 48 rows
      const Tensors x(tree, s, t, 10);
      const Reference ref(tree, s, x, s.default_sm_scale());
      for (const PlanVariant& v : kVariants)
        run_and_check(make_plan(tree, s, v, cfg), tree, s, t, x, ref, s.default_sm_scale(), std::string("128-row ") + v.name);
    }
  }
}

// KV slots in shuffled 16-token pages (the kernel's slot runs break every page, tiles cross runs),
// and a chain of 150 tiny nodes with a gap after each node's slots (one run per node: vnodes of
// more than 32 runs, so the kernel's run window slides).
TEST(CudaAttention, PagedAndFragmentedSlots) {
  SKIP_WITHOUT_GPU();
  KvTree levels = tree_from_levels(std::vector<int64_t>{1, 6, 18}, std::vector<int64_t>{300, 70, 25});
  {
    const int64_t pages = (max_slot_plus_one(levels) + 15) / 16;
    std::vector<int32_t> perm(pages);
    for (int64_t i = 0; i < pages; ++i) perm[i] = static_cast<int32_t>(i);
    std::mt19937 rng(42);
    std::shuffle(perm.begin(), perm.end(), rng);
    for (int32_t& slot : levels.slots) slot = perm[slot / 16] * 16 + slot % 16;
  }
  KvTree chain;
  int prev = -1;
  int32_t next_slot = 0;
  auto gapped = [&](int parent, int len) {
    std::vector<int32_t> sl(len);
    for (int32_t& x : sl) x = next_slot++;
    ++next_slot;  // gap
    return chain.add_node(parent, sl);
  };
  for (int i = 0; i < 150; ++i) prev = gapped(prev, 1 + i % 3);
  for (int i = 0; i < 5; ++i) chain.add_query(gapped(prev, 10 + i));
  for (const KvTree* tree : {&levels, &chain}) {
    for (const AttnShape s : {AttnShape{8, 8, 128}, AttnShape{16, 1, 64}}) {
      const Tensors x(*tree, s, KvDType::kF16, 31);
      const Reference ref(*tree, s, x, s.default_sm_scale());
      for (const PlanVariant& v : kVariants)
        run_and_check(make_plan(*tree, s, v), *tree, s, KvDType::kF16, x, ref, s.default_sm_scale(),
                      std::string(tree == &levels ? "paged " : "fragmented ") + v.name);
    }
  }
}

// Graph replay and the static scheduler give bit-identical results (every unit is computed the same
// way whichever CTA runs it); repeated launches re-poison the outputs first, so they also prove
// that the kernels leave their counters ready for the next launch.
TEST(CudaAttention, GraphReplayAndSchedulersAgree) {
  SKIP_WITHOUT_GPU();
  const KvTree tree = tree_from_levels(std::vector<int64_t>{1, 8, 32}, std::vector<int64_t>{700, 90, 17});
  const AttnShape s{16, 4, 128};
  const Tensors x(tree, s, KvDType::kBF16, 21);
  const float scale = s.default_sm_scale();
  const Reference ref(tree, s, x, scale);
  const Plan plan = make_plan(tree, s, kVariants[3]);
  std::vector<float> base(x.q.size()), base_lse(ref.lse.size());
  CudaRunOptions plain;
  plain.poison_outputs = true;
  plain.warp_unit_max_kv = 0;  // the main kernel only (the warp path is checked below)
  cuda_attention(plan, tree, s, KvDType::kBF16, x.q, x.k, x.v, scale, base, base_lse, plain);
  EXPECT_LE(compare(base, base_lse, ref.out, ref.lse).out, out_tol(KvDType::kBF16));
  CudaRunOptions graph = plain;
  graph.use_graph = true;
  graph.repeats = 3;
  CudaRunOptions round_robin = plain;
  round_robin.atomic_scheduler = false;
  round_robin.repeats = 2;
  CudaRunOptions plain_repeat = plain;
  plain_repeat.repeats = 3;
  for (const CudaRunOptions& opt : {graph, round_robin, plain_repeat}) {
    std::vector<float> out(x.q.size(), NAN), lse(ref.lse.size(), NAN);
    cuda_attention(plan, tree, s, KvDType::kBF16, x.q, x.k, x.v, scale, out, lse, opt);
    EXPECT_EQ(out, base);
    EXPECT_EQ(lse, base_lse);
  }
  // Warp-per-unit path under graph replay and plain repeats (its units take a second kernel),
  // beside the main kernel on a forked side stream (a graph with two parallel branches joined
  // before the merge) and serialized before it: every unit is computed the same way either way,
  // so all four runs are bit-identical.
  std::vector<float> warp_base, warp_base_lse;
  for (const int overlap : {1, 0}) {
    for (const bool use_graph : {true, false}) {
      CudaRunOptions warp = use_graph ? graph : plain_repeat;
      warp.warp_unit_max_kv = 1 << 30;
      warp.warp_unit_min_units = 0;
      warp.warp_overlap = overlap;
      warp.warp_staged = 1;
      const std::string tag = std::string("warp-per-unit") + (overlap ? " overlapped" : " serialized") +
                              (use_graph ? " graph" : " repeats");
      std::vector<float> out(x.q.size(), NAN), lse(ref.lse.size(), NAN);
      cuda_attention(plan, tree, s, KvDType::kBF16, x.q, x.k, x.v, scale, out, lse, warp);
      const Errors e = compare(out, lse, ref.out, ref.lse);
      EXPECT_LE(e.out, out_tol(KvDType::kBF16)) << tag;
      EXPECT_LE(e.lse, 1e-3) << tag;
      if (warp_base.empty()) {
        warp_base = out;
        warp_base_lse = lse;
      } else {
        EXPECT_EQ(out, warp_base) << tag;
        EXPECT_EQ(lse, warp_base_lse) << tag;
      }
    }
  }
  // The 2- and 3-stage tree kernels (Q staged in shared memory or read from global memory) run
  // the same arithmetic on the same Q bits: bit-identical, under graph replay too.
  for (const int deep : {0, 1}) {
    CudaRunOptions opt = graph;
    opt.deep_ring = deep;
    std::vector<float> out(x.q.size(), NAN), lse(ref.lse.size(), NAN);
    cuda_attention(plan, tree, s, KvDType::kBF16, x.q, x.k, x.v, scale, out, lse, opt);
    EXPECT_EQ(out, base) << "deep_ring " << deep;
    EXPECT_EQ(lse, base_lse) << "deep_ring " << deep;
  }
  // The plan's units take the full persistent grid or one CTA per SM (CudaTreeAttentionOptions::
  // fit_grid; each unit is computed alike on either): bit-identical, for a plan of few units too.
  const Plan small = make_plan(tree, s, kVariants[0]);
  std::vector<float> small_base;
  for (const int fit : {0, 1}) {
    for (const Plan* pl : {&plan, &small}) {
      CudaRunOptions opt = graph;
      opt.fit_grid = fit;
      std::vector<float> out(x.q.size(), NAN), lse(ref.lse.size(), NAN);
      cuda_attention(*pl, tree, s, KvDType::kBF16, x.q, x.k, x.v, scale, out, lse, opt);
      if (pl == &plan) {
        EXPECT_EQ(out, base) << "fit_grid " << fit;
        EXPECT_EQ(lse, base_lse) << "fit_grid " << fit;
      } else {
        EXPECT_LE(compare(out, lse, ref.out, ref.lse).out, out_tol(KvDType::kBF16)) << "fit_grid " << fit;
        if (small_base.empty()) small_base = out;
        EXPECT_EQ(out, small_base) << "fit_grid " << fit;
      }
    }
  }
  // lse may be omitted.
  std::vector<float> out(x.q.size(), NAN);
  cuda_attention(plan, tree, s, KvDType::kBF16, x.q, x.k, x.v, scale, out, {}, plain);
  EXPECT_EQ(out, base);
}

// Q by TMA (BlockDesc kQRunBit: blocks of whole consecutive queries, in the kernels that stage Q in
// shared memory) against the producer's cp.async copies: bit-identical, at every head dim and at
// GQA 1-16 on the 2-stage kernel, on a level tree (a node's queries are consecutive ids: the TMA
// path) and on the same tree with its query ids shuffled (no block of more than one query
// qualifies: the cp.async path), with folded leaves too, under graph replay.
TEST(CudaAttention, QByTmaMatchesCpAsync) {
  SKIP_WITHOUT_GPU();
  std::mt19937 rng(5);
  int seed = 60;
  for (const int d : {64, 128, 256}) {
    for (const int g : {1, 4, 8, 16}) {
      const AttnShape s = shape_for_gqa(g, d);
      for (const bool shuffled : {false, true}) {
        KvTree tree = tree_from_levels(std::vector<int64_t>{1, 4, 24}, std::vector<int64_t>{150, 40, 21});
        if (shuffled) std::shuffle(tree.query_node.begin(), tree.query_node.end(), rng);
        const Tensors x(tree, s, KvDType::kF16, seed++);
        const float scale = s.default_sm_scale();
        const Reference ref(tree, s, x, scale);
        for (const PlanVariant& v : {kVariants[0], kFoldVariant}) {
          const Plan plan = make_plan(tree, s, v);
          const std::string what = std::string(v.name) + " d=" + std::to_string(d) + " g=" + std::to_string(g) +
                                   (shuffled ? " shuffled" : "");
          std::vector<float> outs[2], lses[2];
          for (const int tma_q : {0, 1}) {
            CudaRunOptions opt;
            opt.poison_outputs = true;
            opt.use_graph = true;
            opt.repeats = 2;
            opt.deep_ring = 0;
            opt.use_tma = 1;
            opt.require_tma = true;
            opt.use_tma_q = tma_q;
            opt.require_tma_q = tma_q == 1;
            opt.warp_unit_max_kv = 0;  // every block on the main kernel
            outs[tma_q].assign(x.q.size(), NAN);
            lses[tma_q].assign(ref.lse.size(), NAN);
            cuda_attention(plan, tree, s, KvDType::kF16, x.q, x.k, x.v, scale, outs[tma_q], lses[tma_q], opt);
            const Errors e = compare(outs[tma_q], lses[tma_q], ref.out, ref.lse);
            EXPECT_LE(e.out, out_tol(KvDType::kF16)) << what << " tma_q " << tma_q;
            EXPECT_LE(e.lse, 1e-3) << what << " tma_q " << tma_q;
          }
          EXPECT_EQ(outs[1], outs[0]) << what;
          EXPECT_EQ(lses[1], lses[0]) << what;
        }
      }
    }
  }
}

#if FASTTREE_HAVE_CUDA
// The Q maps span the uploaded plan's queries, so a graph captured for one query count must not be
// replayed for another: with Q by TMA, an upload of a different query count changes graph_epoch();
// without it (and with the same launch sequence) it does not.
TEST(CudaAttention, QueryCountChangesTheGraphEpochWithQByTma) {
  SKIP_WITHOUT_GPU();
  const AttnShape s{16, 1, 128};
  const KvTree a = tree_from_levels(std::vector<int64_t>{1, 8}, std::vector<int64_t>{100, 20});
  KvTree b = a;
  b.add_query(0);  // one more query, at the root
  const Plan pa = make_plan(a, s, kVariants[0]), pb = make_plan(b, s, kVariants[0]);
  for (const int tma_q : {0, 1}) {
    CudaTreeAttentionOptions opt;
    opt.deep_ring = 0;
    opt.use_tma = 1;
    opt.use_tma_q = tma_q;
    opt.warp_unit_max_kv = 0;
    CudaTreeAttention att(s, KvDType::kF16, 0.0f, opt);
    att.upload(pa, a);
    const uint64_t e0 = att.graph_epoch();
    att.upload(pa, a);
    EXPECT_EQ(att.graph_epoch(), e0) << "tma_q " << tma_q;
    att.upload(pb, b);
    if (tma_q == 1) {
      EXPECT_NE(att.graph_epoch(), e0);
    } else {
      EXPECT_EQ(att.graph_epoch(), e0);
    }
  }
}
#endif

// The per-request baseline (no sharing) on random forests and a level tree.
TEST(CudaAttention, PerRequestBaseline) {
  SKIP_WITHOUT_GPU();
  RandomForestSpec spec;
  spec.max_len = 300;
  spec.internal_query_prob = 0.3;
  const KvTree forest = random_forest(spec, 5);
  const KvTree levels = tree_from_levels(std::vector<int64_t>{1, 10}, std::vector<int64_t>{3000, 200});
  int i = 0;
  for (const KvTree* tree : {&forest, &levels}) {
    for (KvDType t : {KvDType::kF16, KvDType::kBF16}) {
      for (const AttnShape s : {AttnShape{4, 4, 64}, AttnShape{16, 2, 128}, AttnShape{16, 1, 256}}) {
        const Tensors x(*tree, s, t, 50 + i++);
        const float scale = s.default_sm_scale();
        const Reference ref(*tree, s, x, scale);
        std::vector<float> out(x.q.size(), NAN), lse(ref.lse.size(), NAN);
        CudaRunOptions opt;
        opt.poison_outputs = true;
        cuda_attention_per_request(*tree, s, t, x.q, x.k, x.v, scale, out, lse, opt);
        const Errors e = compare(out, lse, ref.out, ref.lse);
        EXPECT_LE(e.out, out_tol(t)) << dtype_name(t) << " d=" << s.head_dim;
        EXPECT_LE(e.lse, 1e-3) << dtype_name(t) << " d=" << s.head_dim;
      }
    }
  }
}

// CPU-only: blocks of 17-32 rows take 2 row groups except in the 3-stage kernel (no 2-group path),
// where they run as 64-row tiles; always enough groups for the rows.
TEST(CudaAttention, RowGroups) {
  for (const bool wide_only : {false, true}) {
    for (int rows = 1; rows <= cuda_detail::kMaxBlockRows; ++rows) {
      const int g = cuda_detail::row_groups_of(rows, wide_only);
      EXPECT_GE(16 * g, rows) << rows << " rows, wide_only " << wide_only;
      EXPECT_EQ(g, rows <= 16 ? 1 : (rows <= 32 && !wide_only ? 2 : 4)) << rows << " rows, wide_only " << wide_only;
      // A smallest class (FT_MIN_ROW_GROUPS) only ever raises the class, never below the rows.
      EXPECT_EQ(cuda_detail::row_groups_of(rows, wide_only, 4), 4);
      EXPECT_EQ(cuda_detail::row_groups_of(rows, wide_only, 2), std::max(g, 2));
      EXPECT_EQ(cuda_detail::row_groups_of(rows, wide_only, 1), g);
    }
  }
  for (int v : {-1, 0, 3, 5, 8}) EXPECT_FALSE(cuda_detail::valid_min_row_groups(v)) << v;
  for (int v : {1, 2, 4}) EXPECT_TRUE(cuda_detail::valid_min_row_groups(v)) << v;
}

// CPU-only: the merge-kernel rule on the suite's shapes (grid = 8 CTAs on each of 132 SMs, d = 128):
// many jobs of few rows stay on the lane-group kernel, few jobs of many rows go wide; degenerate
// inputs never divide by zero.
TEST(CudaAttention, MergeKernelChoice) {
  using cuda_detail::prefer_wide_merge;
  const int64_t grid = 132 * 8;
  EXPECT_FALSE(prefer_wide_merge(1024 * 32, 1024 * 4, 1024, grid, 128));  // deep 32/32 trees: 4 rows per job
  EXPECT_FALSE(prefer_wide_merge(64 * 16, 64 * 2, 64, grid, 128));       // 2 rows per job
  EXPECT_TRUE(prefer_wide_merge(64 * 16, 64 * 11, 64, grid, 128));       // `1 16 64` 16/1: 11 rows per job
  EXPECT_TRUE(prefer_wide_merge(10 * 16, 10 * 36, 10, grid, 128));       // `1 10` 16/1: 36 rows per job
  EXPECT_TRUE(prefer_wide_merge(10 * 32, 10 * 18, 10, grid, 64));
  // More rows per job never moves a small job count back to the lane-group kernel.
  bool wide = false;
  for (int64_t r = 1; r <= 4096; ++r) {
    const bool w = prefer_wide_merge(160, 10 * r, 10, grid, 128);
    EXPECT_TRUE(w || !wide) << r << " rows per job";
    wide = w;
  }
  EXPECT_TRUE(wide);
  for (int d : {0, 4, 2048}) EXPECT_FALSE(prefer_wide_merge(100, 1000, 10, grid, d));
  EXPECT_FALSE(prefer_wide_merge(0, 0, 0, grid, 128));
  EXPECT_FALSE(prefer_wide_merge(100, 1000, 10, 0, 128));
}

// CPU-only: the tile table (BlockRecord::tile_slot / tile_box) against a token -> (slot, run) map
// built independently. A full tile whose tokens sit on consecutive slots of one run gets its first
// slot (the producer's 64-row TMA box is exactly the tile); otherwise, for the first
// kRecordBoxTiles such tiles in order, a tile whose every 8-row unit lies in one run gets a box
// entry holding each unit's first slot (-1 past the count); everything else, and anything beyond
// kv_len, past kRecordTiles or past int32 slots, gets -1.
TEST(CudaAttention, TileSlotsFromRuns) {
  using cuda_detail::BlockRecord;
  using cuda_detail::DeviceRun;
  constexpr int kN = cuda_detail::kKvTile;
  std::mt19937 rng(7);
  int boxed_tiles = 0, short_units = 0;
  for (int trial = 0; trial < 300; ++trial) {
    std::vector<DeviceRun> runs;
    std::vector<int64_t> tok_slot, tok_run;
    const int64_t base = trial % 10 == 9 ? int64_t{INT32_MAX} - 3000 : int64_t(rng() % 100000);
    int64_t slot = base;
    while (tok_slot.size() < 3000) {
      const int len = trial % 3 == 0   ? 1 + int(rng() % 20)
                      : trial % 3 == 1 ? 8 * (1 + int(rng() % 12)) - (rng() % 8 == 0 ? int(rng() % 8) : 0)
                                       : 1 + int(rng() % 300);
      if (rng() % 4 != 0) slot += 1 + rng() % 5000;  // else the run continues the previous one's slots
      runs.push_back(DeviceRun{slot, static_cast<int32_t>(tok_slot.size()), len});
      for (int i = 0; i < len; ++i) {
        tok_slot.push_back(slot + i);
        tok_run.push_back(static_cast<int64_t>(runs.size()) - 1);
      }
      slot += len;
    }
    const int ntok = static_cast<int>(tok_slot.size());
    BlockRecord rec{};
    rec.desc.kv_begin = static_cast<int32_t>(trial % 3 == 1 ? 8 * (rng() % 60) : rng() % 500);
    rec.desc.kv_len = 1 + static_cast<int32_t>(rng() % (ntok - rec.desc.kv_begin));
    std::fill(rec.tile_slot, rec.tile_slot + cuda_detail::kRecordTiles, 12345);  // stale record memory
    std::fill(&rec.tile_box[0][0], &rec.tile_box[0][0] + sizeof(rec.tile_box) / 4, 12345);
    const DeviceRun* rb = runs.data() + tok_run[rec.desc.kv_begin];
    cuda_detail::fill_tile_slots(rec, rb, runs.data() + runs.size());
    // Tokens [a, b) on consecutive slots of one run, from a slot TMA can address.
    auto one_run = [&](int64_t a, int64_t b) {
      for (int64_t i = a; i < b; ++i)
        if (tok_run[i] != tok_run[a] || tok_slot[i] != tok_slot[a] + (i - a)) return false;
      return tok_slot[a] + kN <= INT32_MAX;
    };
    int entries = 0;
    for (int t = 0; t < cuda_detail::kRecordTiles; ++t) {
      const int64_t off = int64_t{t} * kN, first = rec.desc.kv_begin + off;
      const std::string where = "trial " + std::to_string(trial) + " tile " + std::to_string(t);
      if (off >= rec.desc.kv_len) {
        EXPECT_EQ(rec.tile_slot[t], -1) << where;
        continue;
      }
      const int count = static_cast<int>(std::min<int64_t>(kN, rec.desc.kv_len - off));
      if (count == kN && one_run(first, first + kN)) {
        EXPECT_EQ(rec.tile_slot[t], tok_slot[first]) << where;
        continue;
      }
      bool units = entries < cuda_detail::kRecordBoxTiles;
      for (int u = 0; units && 8 * u < count; ++u) units = one_run(first + 8 * u, first + std::min(8 * u + 8, count));
      if (!units) {
        EXPECT_EQ(rec.tile_slot[t], -1) << where;
        continue;
      }
      ASSERT_EQ(rec.tile_slot[t], -2 - entries) << where;
      for (int u = 0; u < kN / 8; ++u)
        EXPECT_EQ(rec.tile_box[entries][u], 8 * u < count ? tok_slot[first + 8 * u] : -1) << where << " unit " << u;
      ++entries;
      ++boxed_tiles;
      short_units += count % 8 != 0;
    }
  }
  EXPECT_GT(boxed_tiles, 100);  // the layouts above do exercise the box entries, short last units included
  EXPECT_GT(short_units, 10);
}

// CPU-only: a block's first tile (tile_rotation) is within its tiles, spread over consecutive
// blocks, and 0 wherever the producer could not issue every tile from the table (a tile left to
// the run search, more tiles than the table, a single tile).
TEST(CudaAttention, TileRotation) {
  using cuda_detail::BlockRecord;
  constexpr int kN = cuda_detail::kKvTile;
  BlockRecord rec{};
  for (int ntiles : {2, 5, 40, cuda_detail::kRecordTiles}) {
    rec.desc.kv_len = ntiles * kN - 3;  // a partial last tile
    for (int t = 0; t < cuda_detail::kRecordTiles; ++t) rec.tile_slot[t] = t % 3 == 0 ? -2 : 1000 + t * kN;
    std::vector<int> seen(ntiles, 0);
    for (int64_t block = 0; block < 4 * ntiles; ++block) {
      const int32_t r = cuda_detail::tile_rotation(rec, block);
      ASSERT_GE(r, 0);
      ASSERT_LT(r, ntiles);
      ++seen[r];
    }
    EXPECT_EQ(std::count(seen.begin(), seen.end(), 0), 0) << ntiles << " tiles: every first tile is used";
    rec.tile_slot[ntiles - 1] = -1;  // the last tile needs the run search
    for (int64_t block = 0; block < 8; ++block) EXPECT_EQ(cuda_detail::tile_rotation(rec, block), 0);
  }
  for (int t = 0; t < cuda_detail::kRecordTiles; ++t) rec.tile_slot[t] = 1000 + t * kN;
  rec.desc.kv_len = kN;  // one tile
  EXPECT_EQ(cuda_detail::tile_rotation(rec, 5), 0);
  rec.desc.kv_len = (cuda_detail::kRecordTiles + 1) * kN;  // past the table
  EXPECT_EQ(cuda_detail::tile_rotation(rec, 5), 0);
}

// CPU-only: the rotation rule (rotation_rule.h) counts the chunks of the items with private pieces
// once each, virtually (per vnode) or physically (the union of their slots), against the budget.
TEST(CudaAttention, RotationRule) {
  using namespace cuda_detail;
  Plan plan;
  // Items with private pieces get one 32-token piece each (vnodes 3, 4, ...: slots 20000 + 32 k).
  auto item = [&](int vnode, int begin, int len, int priv) {
    PlanItem it{vnode, begin, len, 0, 4, 0, -1};
    it.priv_begin = static_cast<int32_t>(plan.privates.size());
    it.priv_count = priv;
    it.priv_len = priv * 32;
    for (int k = 0; k < priv; ++k)
      plan.privates.push_back(PlanPrivate{3 + static_cast<int32_t>(plan.privates.size()), k, 32 * k, 32});
    return it;
  };
  // vnode 0's chunk [0, 1000) twice (two query tiles), vnode 1's [200, 1200), vnode 2 without
  // private pieces (never counted).
  plan.items = {item(0, 0, 1000, 2), item(0, 0, 1000, 3), item(1, 200, 1000, 1), item(2, 0, 5000, 0)};
  // Physical layout: vnode 0 = slots [0, 1000); vnode 1 = an ancestor's slots [500, 1000) then its
  // own [7000, 7700) (token t at 500 + t, then 7000 + t - 500); vnode 2 = [9000, 14000); pieces as
  // above, except vnode `dup_vnode`, which re-reads [20016, 20048) (a folded internal node read again
  // by a leaf's piece).
  int chunk_calls = 0, dup_vnode = -1;
  auto ranges = [&](int vn, int64_t b, int64_t len, auto&& emit) {
    if (vn == 0) {
      ++chunk_calls;
      emit(b, len);
    } else if (vn == 1) {
      ++chunk_calls;
      const int64_t e = b + len;
      if (b < 500) emit(500 + b, std::min<int64_t>(e, 500) - b);
      if (e > 500) {
        const int64_t lo = std::max<int64_t>(b, 500);
        for (int64_t t = lo; t < e; t += 100) emit(7000 + t - 500, std::min<int64_t>(100, e - t));  // pieces
      }
    } else if (vn >= 3) {
      ASSERT_EQ(b, 0);
      ASSERT_EQ(len, 32);
      emit(vn == dup_vnode ? 20016 : 20000 + 32 * (vn - 3), len);
    } else {
      ADD_FAILURE() << "vnode 2 has no private pieces";
    }
  };
  constexpr int64_t kBpt = 4 * 8 * 128;  // bytes per token: 8 KV heads, d = 128
  RotateScratch sc;
  // Virtual: 1000 + 1000 tokens.
  EXPECT_TRUE(choose_rotation(plan, kRotateVirtual, kBpt, 2000 * kBpt, sc, ranges));
  EXPECT_FALSE(choose_rotation(plan, kRotateVirtual, kBpt, 2000 * kBpt - 1, sc, ranges));
  EXPECT_EQ(chunk_calls, 0);
  // Physical: [0, 1000) U [700, 1000) U [7000, 7700) = 1700 slots.
  EXPECT_TRUE(choose_rotation(plan, kRotatePhysical, kBpt, 1700 * kBpt, sc, ranges));
  EXPECT_EQ(chunk_calls, 2) << "each distinct chunk once";
  EXPECT_FALSE(choose_rotation(plan, kRotatePhysical, kBpt, 1700 * kBpt - 1, sc, ranges));
  EXPECT_FALSE(choose_rotation(plan, kRotateOff, kBpt, int64_t{1} << 40, sc, ranges));
  // Two pieces on shared slots: the physical rule does not rotate, the virtual one ignores pieces.
  dup_vnode = 4;
  EXPECT_FALSE(choose_rotation(plan, kRotatePhysical, kBpt, 1700 * kBpt, sc, ranges));
  EXPECT_TRUE(choose_rotation(plan, kRotateVirtual, kBpt, 2000 * kBpt, sc, ranges));
  dup_vnode = -1;
  // No item with private pieces: nothing to rotate, whatever the budget.
  for (PlanItem& it : plan.items) it.priv_count = 0;
  EXPECT_FALSE(choose_rotation(plan, kRotatePhysical, kBpt, int64_t{1} << 40, sc, ranges));
  EXPECT_FALSE(choose_rotation(plan, kRotateVirtual, kBpt, int64_t{1} << 40, sc, ranges));
}

// CPU-only: the per-request plan is a valid plan (validate_plan) and the CPU executor runs it exactly.
TEST(CudaAttention, PerRequestPlanIsValidOnCpu) {
  RandomForestSpec spec;
  spec.max_len = 200;
  spec.internal_query_prob = 0.3;
  spec.explicit_slots = true;
  for (int seed = 0; seed < 5; ++seed) {
    const KvTree tree = random_forest(spec, 300 + seed);
    const AttnShape s{8, 2, 16};
    PerRequestConfig cfg;
    cfg.num_sms = 4;
    cfg.min_chunk = 32;
    Plan plan;
    build_per_request_plan(tree, s, cfg, plan);
    validate_plan(plan, tree);
    const Tensors x(tree, s, KvDType::kF16, 1);
    const Reference ref(tree, s, x, s.default_sm_scale());
    std::vector<float> out(x.q.size()), lse(ref.lse.size());
    execute_plan(plan, tree, s, x.q, x.k, x.v, s.default_sm_scale(), out, lse);
    const Errors e = compare(out, lse, ref.out, ref.lse);
    EXPECT_LE(e.out, 1e-5) << "seed " << seed;
    EXPECT_LE(e.lse, 1e-5) << "seed " << seed;
  }
}

// Timing on the paper's suite (bench/anchors/h200-paper-suite.csv: 15 trees x 3 head settings,
// d = 128, fp16 like the anchors), CUDA graph replays with the L2 flushed before each run: the
// default, the static round-robin scheduler, and the default with plain launches. Disabled by default: run with
// --gtest_also_run_disabled_tests on a GPU; FT_TIMING_ONLY=text keeps the cells whose
// "levels|lens" contains text, FT_TIMING_ITERS sets the timed runs (default 30), FT_TIMING_QUICK=1
// times the default column only, FT_TIMING_MIN_CHUNK / FT_TIMING_SPLIT_WAVES override those
// planner constants (experiments; the planner's defaults otherwise).
std::vector<std::string> split_csv_line(const std::string& line) {
  std::vector<std::string> f(1);
  for (char c : line) {
    if (c == ',') {
      f.emplace_back();
    } else if (c != '\r') {
      f.back() += c;
    }
  }
  return f;
}

std::vector<int64_t> parse_ints(const std::string& text) {
  std::vector<int64_t> v;
  std::istringstream in(text);
  for (int64_t x; in >> x;) v.push_back(x);
  return v;
}

TEST(CudaAttention, DISABLED_TimingPaperSuite) {
  SKIP_WITHOUT_GPU();
  std::ifstream csv(std::string(FASTTREE_SOURCE_DIR) + "/bench/anchors/h200-paper-suite.csv");
  if (!csv.good()) csv = std::ifstream("bench/anchors/h200-paper-suite.csv");
  ASSERT_TRUE(csv.good()) << "bench/anchors/h200-paper-suite.csv not found";
  const char* only_env = std::getenv("FT_TIMING_ONLY");
  const std::string only = only_env != nullptr ? only_env : "";
  const char* iters_env = std::getenv("FT_TIMING_ITERS");
  const int iters = iters_env != nullptr ? std::max(1, std::atoi(iters_env)) : 30;
  const bool quick = std::getenv("FT_TIMING_QUICK") != nullptr && std::atoi(std::getenv("FT_TIMING_QUICK")) != 0;
  PlannerConfig pcfg;
  if (const char* e = std::getenv("FT_TIMING_MIN_CHUNK")) pcfg.min_chunk = std::atoll(e);
  if (const char* e = std::getenv("FT_TIMING_SPLIT_WAVES")) pcfg.split_waves = std::atof(e);
  std::printf("planner: min_chunk %lld, split_waves %.2f%s\n", static_cast<long long>(pcfg.min_chunk), pcfg.split_waves,
              quick ? " (quick: default column only)" : "");
  std::string line;
  std::getline(csv, line);  // header
  std::printf("%-44s %5s %7s %7s | %7s %7s %7s | %6s %6s %6s\n", "tree (levels | lens)", "heads", "floor", "anchor",
              "graph", "rr", "plain", "TB/s", "x_flr", "x_anc");
  double log_flr = 0, log_anc = 0, log_sep = 0, log_rr = 0;
  int n = 0, beat = 0;
  while (std::getline(csv, line)) {
    const std::vector<std::string> f = split_csv_line(line);
    if (f.size() < 12) continue;
    const std::string name = f[0] + " | " + f[1];
    if (!only.empty() && (f[0] + "|" + f[1]).find(only) == std::string::npos) continue;
    const KvTree tree = tree_from_levels(parse_ints(f[0]), parse_ints(f[1]));
    const AttnShape s{std::stoi(f[2]), std::stoi(f[3]), 128};
    const double anchor = std::stod(f[11]);
    Planner planner(pcfg);
    Plan plan;
    planner.build(tree, s, plan);
    TreeTopology topo;
    topo.build(tree);
    const TreeStats ts = tree_stats(tree, topo);
    const double floor = floor_us(ts.unique_tokens, ts.sum_path_len, s, 2);
    auto time = [&](bool graph, bool atomic) {
      CudaTimingOptions opt;
      opt.iters = iters;
      opt.use_graph = graph;
      opt.atomic_scheduler = atomic;
      return cuda_time_plan(plan, tree, s, KvDType::kF16, opt).median_us;
    };
    const double t_sep = time(true, true);
    const double t_rr = quick ? t_sep : time(true, false);
    const double t_plain = quick ? t_sep : time(false, true);
    const double best = std::min(t_sep, t_rr);
    const double tbs = kv_bytes(ts.unique_tokens, s, 2) / (best * 1e-6) / 1e12;
    std::printf("%-44s %2d/%-2d %7.1f %7.1f | %7.1f %7.1f %7.1f | %6.2f %6.2f %6.2f\n", name.substr(0, 44).c_str(),
                s.num_qo_heads, s.num_kv_heads, floor, anchor, t_sep, t_rr, t_plain, tbs, best / floor, best / anchor);
    std::fflush(stdout);
    log_flr += std::log(best / floor);
    log_anc += std::log(best / anchor);
    log_sep += std::log(t_sep / floor);
    log_rr += std::log(t_rr / floor);
    beat += best < anchor ? 1 : 0;
    ++n;
  }
  if (n > 0)
    std::printf("geomean over %d cells: best/floor %.2f, best/anchor %.2f, default/floor %.2f, round-robin/floor %.2f; "
                "%d cells faster than the best anchor\n",
                n, std::exp(log_flr / n), std::exp(log_anc / n), std::exp(log_sep / n), std::exp(log_rr / n), beat);
}

// One run (default options) on one cell, for a profiler (scripts/gpu_check.sh runs ncu on it).
// FT_PROFILE_CELL="levels|lens|hq|hkv" picks the cell (default "1 10|4000 400|32|32").
TEST(CudaAttention, DISABLED_ProfileOneCell) {
  SKIP_WITHOUT_GPU();
  const char* env = std::getenv("FT_PROFILE_CELL");
  const std::vector<std::string> f = split_csv_line(std::string(env != nullptr ? env : "1 10|4000 400|32|32") + "|");
  std::vector<std::string> parts;
  std::string cur;
  for (char c : f[0]) {
    if (c == '|') {
      parts.push_back(cur);
      cur.clear();
    } else {
      cur += c;
    }
  }
  ASSERT_GE(parts.size(), 4u) << "FT_PROFILE_CELL=levels|lens|hq|hkv";
  const KvTree tree = tree_from_levels(parse_ints(parts[0]), parse_ints(parts[1]));
  const AttnShape s{std::stoi(parts[2]), std::stoi(parts[3]), 128};
  Planner planner;
  Plan plan;
  planner.build(tree, s, plan);
  CudaTimingOptions opt;
  opt.warmup = 0;
  opt.iters = 1;
  opt.gpu_warmup_ms = 0;
  opt.l2 = L2Mode::kCleanFlush;  // one copy: the profiler sees this one run
  std::printf("%s: %.1f us (one run, first launch)\n", parts[0].c_str(), cuda_time_plan(plan, tree, s, KvDType::kF16, opt).median_us);
}

}  // namespace
}  // namespace fasttree
