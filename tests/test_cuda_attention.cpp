// CUDA tree attention (cuda/tree_attention.h through the host entry points of cuda/backend.h)
// against the fp64 CPU reference (cpu/reference.h). Every GPU test skips itself when no CUDA device
// is present, so CI without a GPU passes.
//
// Inputs are uniform in [-1, 1] and rounded to the device dtype BEFORE the reference is computed,
// so the only differences are fp32 accumulation and the rounding of P to the dtype for P·V.
// Device outputs (and the partial workspace) are poisoned with NaN before each run, so an unwritten
// element fails. Every check runs both kernel copy variants (cp.async, bulk copy). Tolerances (absolute, outputs are averages of values in [-1, 1], |O| <= 1):
//   out: max |gpu - ref| <= 5e-3 (fp16: P carries 11 bits) or 2e-2 (bf16: 8 bits)
//   lse: |gpu - ref| <= 1e-3 * max(1, |ref|) (P rounding does not enter the LSE); -inf == -inf.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
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
#include "cuda/per_request.h"
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

// Runs `plan` on the GPU (poisoned outputs) with both kernel copy variants (cp.async and bulk
// copy) and checks each against the reference; returns the worst errors.
Errors run_and_check(const Plan& plan, const KvTree& tree, const AttnShape& s, KvDType t, const Tensors& x,
                     const Reference& ref, float scale, const std::string& what, CudaRunOptions opt = {}) {
  opt.poison_outputs = true;
  Errors worst;
  for (bool bulk : {false, true}) {
    opt.bulk_copy = bulk;
    std::vector<float> out(x.q.size(), NAN), lse(ref.lse.size(), NAN);
    cuda_attention(plan, tree, s, t, x.q, x.k, x.v, scale, out, lse, opt);
    const Errors e = compare(out, lse, ref.out, ref.lse);
    EXPECT_LE(e.out, out_tol(t)) << what << (bulk ? " [bulk]" : " [cp.async]");
    EXPECT_LE(e.lse, 1e-3) << what << (bulk ? " [bulk]" : " [cp.async]");
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
};
constexpr PlanVariant kVariants[] = {
    {"greedy", EdgePolicy::kGreedy, true, 132, 256},
    {"all0", EdgePolicy::kAllZero, true, 132, 256},
    {"nosplit", EdgePolicy::kGreedy, false, 132, 256},
    {"greedy+chunks", EdgePolicy::kGreedy, true, 4, 64},
    {"all1+chunks", EdgePolicy::kAllOne, true, 4, 16},
};

Plan make_plan(const KvTree& tree, const AttnShape& s, const PlanVariant& v, PlannerConfig cfg = {}) {
  cfg.edges = v.edges;
  cfg.split = v.split;
  cfg.num_sms = v.num_sms;
  cfg.min_chunk = v.min_chunk;
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
  for (int d : {64, 128, 256}) {
    for (KvDType t : {KvDType::kF16, KvDType::kBF16}) {
      for (const AttnShape s : {AttnShape{2, 2, d}, AttnShape{16, 1, d}}) {
        const Tensors x(tree, s, t, 3);
        const Reference ref(tree, s, x, s.default_sm_scale());
        run_and_check(make_plan(tree, s, kVariants[3]), tree, s, t, x, ref, s.default_sm_scale(),
                      std::string("sanitizer ") + dtype_name(t) + " d=" + std::to_string(d));
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
        for (const PlanVariant& v : {kVariants[0], kVariants[1], kVariants[2]}) {
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

// Graph replay and the static scheduler give bit-identical results (every unit is computed the same
// way whichever CTA runs it).
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
  cuda_attention(plan, tree, s, KvDType::kBF16, x.q, x.k, x.v, scale, base, base_lse, plain);
  EXPECT_LE(compare(base, base_lse, ref.out, ref.lse).out, out_tol(KvDType::kBF16));
  CudaRunOptions graph = plain;
  graph.use_graph = true;
  graph.repeats = 3;
  CudaRunOptions round_robin = plain;
  round_robin.atomic_scheduler = false;
  round_robin.repeats = 2;
  CudaRunOptions bulk = graph;
  bulk.bulk_copy = true;
  for (const CudaRunOptions& opt : {graph, round_robin, bulk}) {
    std::vector<float> out(x.q.size(), NAN), lse(ref.lse.size(), NAN);
    cuda_attention(plan, tree, s, KvDType::kBF16, x.q, x.k, x.v, scale, out, lse, opt);
    EXPECT_EQ(out, base);
    EXPECT_EQ(lse, base_lse);
  }
  // lse may be omitted.
  std::vector<float> out(x.q.size(), NAN);
  cuda_attention(plan, tree, s, KvDType::kBF16, x.q, x.k, x.v, scale, out, {}, plain);
  EXPECT_EQ(out, base);
}

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
        for (bool bulk : {false, true}) {
          std::vector<float> out(x.q.size(), NAN), lse(ref.lse.size(), NAN);
          CudaRunOptions opt;
          opt.poison_outputs = true;
          opt.bulk_copy = bulk;
          cuda_attention_per_request(*tree, s, t, x.q, x.k, x.v, scale, out, lse, opt);
          const Errors e = compare(out, lse, ref.out, ref.lse);
          EXPECT_LE(e.out, out_tol(t)) << dtype_name(t) << " d=" << s.head_dim << " bulk " << bulk;
          EXPECT_LE(e.lse, 1e-3) << dtype_name(t) << " d=" << s.head_dim << " bulk " << bulk;
        }
      }
    }
  }
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

// Timing of the FastTree plan vs the per-request baseline on some of the paper's trees (d = 128,
// fp16 like the anchors). Disabled by default: run with --gtest_also_run_disabled_tests on a GPU.
TEST(CudaAttention, DISABLED_TimingPaperTrees) {
  SKIP_WITHOUT_GPU();
  struct Cell {
    std::vector<int64_t> counts, lens;
    int hq, hkv;
    double best_anchor_us;  // bench/anchors/h200-paper-suite.csv
  };
  const Cell cells[] = {
      {{1, 10}, {4000, 400}, 32, 32, 61.6},
      {{1, 10}, {4000, 400}, 32, 8, 39.8},
      {{1, 10}, {4000, 400}, 16, 1, 24.9},
      {{1, 16, 64}, {1024, 256, 32}, 32, 32, 68.1},
      {{1, 16, 64}, {1024, 256, 32}, 32, 8, 44.6},
      {{1, 16, 64}, {1024, 256, 32}, 16, 1, 20.1},
      {{1, 256}, {256, 32}, 32, 32, 77.7},
      {{1, 256}, {256, 32}, 32, 8, 47.7},
      {{1, 256}, {256, 32}, 16, 1, 25.2},
      {{1, 4, 16, 64, 256, 1024}, {256, 8, 256, 64, 32, 256}, 32, 8, 410.7},
      {{1, 2, 4, 8, 16, 32, 64, 128, 1024}, {16, 16, 16, 16, 16, 16, 16, 16, 16}, 32, 32, 184.9},
  };
  std::printf("%-30s %5s %7s %7s | %7s %7s %7s %7s %7s %7s | %7s %7s | %6s %6s\n", "tree", "heads", "floor",
              "anchor", "tree", "bulk", "rr", "graph", "noflush", "nomerge", "perreq", "pr_bulk", "x_flr", "x_anc");
  for (const Cell& c : cells) {
    const KvTree tree = tree_from_levels(c.counts, c.lens);
    const AttnShape s{c.hq, c.hkv, 128};
    Planner planner;
    Plan plan;
    planner.build(tree, s, plan);
    Plan per_request;
    build_per_request_plan(tree, s, PerRequestConfig{}, per_request);
    const PlanStats st = plan_stats(plan, tree);
    const double floor = floor_us(st.unique_kv_tokens, st.sum_path_len, s, 2);
    auto time = [&](const Plan& p, auto&& tweak) {
      CudaTimingOptions opt;
      tweak(opt);
      return cuda_time_plan(p, tree, s, KvDType::kF16, opt).median_us;
    };
    const double t_tree = time(plan, [](CudaTimingOptions&) {});
    const double t_bulk = time(plan, [](CudaTimingOptions& o) { o.bulk_copy = true; });
    const double t_rr = time(plan, [](CudaTimingOptions& o) { o.atomic_scheduler = false; });
    const double t_graph = time(plan, [](CudaTimingOptions& o) { o.use_graph = true; });
    const double t_warm = time(plan, [](CudaTimingOptions& o) { o.flush_l2 = false; });
    const double t_nomerge = time(plan, [](CudaTimingOptions& o) { o.skip_merge = true; });
    const double t_pr = time(per_request, [](CudaTimingOptions&) {});
    const double t_pr_bulk = time(per_request, [](CudaTimingOptions& o) { o.bulk_copy = true; });
    const double best = std::min({t_tree, t_bulk, t_rr, t_graph});
    std::string name;
    for (size_t i = 0; i < c.counts.size(); ++i) name += (i ? "," : "") + std::to_string(c.counts[i]);
    name += "/";
    for (size_t i = 0; i < c.lens.size(); ++i) name += (i ? "," : "") + std::to_string(c.lens[i]);
    std::printf("%-30s %2d/%-2d %7.1f %7.1f | %7.1f %7.1f %7.1f %7.1f %7.1f %7.1f | %7.1f %7.1f | %6.2f %6.2f\n",
                name.c_str(), c.hq, c.hkv, floor, c.best_anchor_us, t_tree, t_bulk, t_rr, t_graph, t_warm, t_nomerge,
                t_pr, t_pr_bulk, best / floor, best / c.best_anchor_us);
  }
}
// One run of each kernel variant on one cell, for a profiler (scripts/gpu_check.sh runs ncu on it).
TEST(CudaAttention, DISABLED_ProfileOneCell) {
  SKIP_WITHOUT_GPU();
  const KvTree tree = tree_from_levels(std::vector<int64_t>{1, 10}, std::vector<int64_t>{4000, 400});
  const AttnShape s{32, 32, 128};
  Planner planner;
  Plan plan;
  planner.build(tree, s, plan);
  for (bool bulk : {false, true}) {
    CudaTimingOptions opt;
    opt.warmup = 0;
    opt.iters = 1;
    opt.gpu_warmup_ms = 0;
    opt.bulk_copy = bulk;
    std::printf("%s: %.1f us\n", bulk ? "bulk" : "cp.async", cuda_time_plan(plan, tree, s, KvDType::kF16, opt).median_us);
  }
}

}  // namespace
}  // namespace fasttree
