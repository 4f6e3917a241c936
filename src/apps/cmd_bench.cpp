// fasttree bench: GPU timings of the FastTree plan vs the per-request baseline and the planner
// ablations, on the paper's suite (bench/anchors/h200-paper-suite.csv) or on any tree. Every cell
// is also checked against the fp64 CPU reference on a sample of its queries.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <random>
#include <sstream>

#include <fmt/format.h>

#include "apps/cli_common.h"
#include "apps/commands.h"
#include "apps/plan_check.h"
#include "apps/suite.h"
#include "core/error.h"
#include "core/tree_gen.h"
#include "cuda/backend.h"
#include "cuda/device_plan.h"
#include "plan/per_request_plan.h"
#include "plan/plan_stats.h"
#include "plan/plan_validate.h"
#include "plan/planner.h"

namespace fasttree {

namespace {

struct BenchCmd {
  std::string suite;
  TreeSource src;
  HeadOptions heads;
  PlannerOptions planner;
  std::string dtypes = "fp16,bf16";
  std::string anchors = default_anchors_path();
  std::string csv;
  std::string commit = "unknown";
  int iters = 50;
  int warmup = 10;
  int check_queries = 16;
  bool no_graph = false;
  std::string only;  // substring filter on the cell name
  std::string kv_layout = "slot";  // slot: [S, Hkv, d]; head: [Hkv, S, d]
  bool diag = false;  // also time an empty launch once and each FastTree plan without its merge
  std::string l2 = "rotate";  // L2 state at each timed run's start (cuda/backend.h L2Mode)
  bool fasttree_only = false;  // sweeps: time only the FastTree plan (baseline and ablation columns NaN)
};

using Cell = SuiteCell;

// One line per timeline mark of an FT_TRACE run (CudaTiming::trace): over the CTAs that reached
// it, min / median / max microseconds after the first tree-kernel CTA started.
void print_trace(const std::vector<uint64_t>& tr) {
  constexpr int kCtas = cuda_detail::kTraceCtas, kEvents = cuda_detail::kTraceEvents;
  if (tr.size() != size_t{cuda_detail::kTraceKinds} * kCtas * kEvents) return;
  uint64_t t0 = UINT64_MAX;
  for (int c = 0; c < kCtas; ++c)
    if (tr[c * kEvents] != 0) t0 = std::min(t0, tr[c * kEvents]);
  if (t0 == UINT64_MAX) return;
  // Tree events in time order (cuda/device_plan.h TraceTreeEvent), then the merge's.
  const std::vector<std::pair<int, const char*>> order[2] = {
      {{0, "tree start"}, {1, "records landed"}, {7, "first record read"}, {8, "first Q issued"}, {9, "first K/V begin"},
       {10, "first K/V issued"}, {2, "first tile published"}, {3, "first tile arrived"}, {4, "first unit written"},
       {5, "consumers done"}, {6, "producer done"}},
      {{0, "merge start"}, {1, "merge waited"}, {2, "merge done"}}};
  for (int kind = 0; kind < 2; ++kind)
    for (const auto& [e, name] : order[kind]) {
      std::vector<double> v;
      for (int c = 0; c < kCtas; ++c) {
        const uint64_t t = tr[(static_cast<size_t>(kind) * kCtas + c) * kEvents + e];
        if (t != 0) v.push_back(1e-3 * static_cast<double>(t - std::min(t, t0)));
      }
      if (v.empty()) continue;
      std::sort(v.begin(), v.end());
      fmt::print("  trace {:<20} {:5d} CTAs  min {:6.2f}  median {:6.2f}  max {:6.2f} us\n", name, v.size(), v.front(),
                 v[v.size() / 2], v.back());
    }
  // Per-CTA sums: durations in us (ns sums), counts, kilocycles of the SM clock (cycle sums).
  struct Sum {
    int event;
    const char* name;
    bool count;  // printed as is, not in thousands
  };
  const Sum sums[] = {
      {cuda_detail::kTrConsWaitNs, "consumer full-wait", false},
      {cuda_detail::kTrConsTiles, "tiles (count)", true},
      {cuda_detail::kTrProdWaitNs, "producer empty-wait", false},
      {cuda_detail::kTrProdIssueNs, "producer issuing", false},
      {cuda_detail::kTrConsTileCy, "consumer tile kcy", false},
      {cuda_detail::kTrProdRecordCy, "prod record kcy", false},
      {cuda_detail::kTrProdQCy, "prod Q kcy", false},
      {cuda_detail::kTrProdSearchCy, "prod search kcy", false},
      {cuda_detail::kTrProdCopyCy, "prod copies kcy", false},
      {cuda_detail::kTrProdPublishCy, "prod publish kcy", false},
      {cuda_detail::kTrProdTableCy, "table copies kcy", false},
      {cuda_detail::kTrProdTableTiles, "table tiles (count)", true},
      {cuda_detail::kTrProdTableMinCy, "table tile min kcy", false},
      {cuda_detail::kTrProdTableMaxCy, "table tile max kcy", false},
      {cuda_detail::kTrProdTableFirstCy, "table first kcy", false},
      {cuda_detail::kTrProdPastCy, "past-table copies kcy", false},
      {cuda_detail::kTrProdPastN, "past-table tiles (count)", true},
      {cuda_detail::kTrProdPartialCy, "partial copies kcy", false},
      {cuda_detail::kTrProdPartialN, "partial tiles (count)", true},
      {cuda_detail::kTrProdSlowCy, "cross-run copies kcy", false},
      {cuda_detail::kTrProdSlowN, "cross-run tiles (count)", true},
      {cuda_detail::kTrProdPartialMinCy, "partial tile min kcy", false},
      {cuda_detail::kTrProdSlowMinCy, "cross-run tile min kcy", false},
      {cuda_detail::kTrProdQRowsCy, "Q row tables kcy", false},
      {cuda_detail::kTrProdBoxCy, "box-table copies kcy", false},
      {cuda_detail::kTrProdBoxN, "box-table tiles (count)", true},
      {cuda_detail::kTrProdBoxMinCy, "box-table tile min kcy", false},
  };
  for (const auto& [e, name, count] : sums) {
    std::vector<double> v;
    for (int c = 0; c < kCtas; ++c) {
      const uint64_t x = tr[static_cast<size_t>(c) * kEvents + e];
      if (x != 0) v.push_back(count ? static_cast<double>(x) : 1e-3 * static_cast<double>(x));
    }
    if (v.empty()) continue;
    std::sort(v.begin(), v.end());
    fmt::print("  sum   {:<20} {:5d} CTAs  min {:6.2f}  median {:6.2f}  max {:6.2f}\n", name, v.size(), v.front(),
               v[v.size() / 2], v.back());
  }
}

std::string spaced(const std::string& commas) {
  std::string s = commas;
  std::replace(s.begin(), s.end(), ',', ' ');
  return s;
}

void run_bench(const BenchCmd& c) {
  const L2Mode l2_mode = l2_mode_option(c.l2);
  FT_CHECK(cuda_backend_built(), "fasttree bench needs the CUDA backend: this binary was built without nvcc");
  FT_CHECK(cuda_device_count() > 0, "fasttree bench: no CUDA device found");
  std::vector<Cell> cells;
  if (!c.suite.empty()) {
    FT_CHECK(c.suite == "paper", "--suite: only 'paper' is known");
    cells = load_suite(c.anchors);
  } else {
    Cell cell;
    cell.tree = make_tree(c.src);
    cell.shape = make_shape(c.heads);
    cell.triton_us = cell.sdpa_us = cell.pat_us = cell.best_anchor_us = NAN;
    cell.nodes_per_level = c.src.levels.empty() ? c.src.tree_file : spaced(c.src.levels);
    cell.context_per_level = spaced(c.src.lens);
    cells.push_back(std::move(cell));
  }
  std::vector<KvDType> dtypes;
  for (const auto& d : split_fields(c.dtypes, ',')) {
    FT_CHECK(d == "fp16" || d == "bf16", "--dtypes: unknown dtype '" + d + "' (fp16, bf16)");
    dtypes.push_back(d == "fp16" ? KvDType::kF16 : KvDType::kBF16);
  }
  std::FILE* csv = nullptr;
  if (!c.csv.empty()) {
    csv = std::fopen(c.csv.c_str(), "w");
    FT_CHECK(csv != nullptr, c.csv + ": cannot open for writing");
    std::fputs("nodes_per_level,context_per_level,num_qo_heads,num_kv_heads,head_dim,dtype,queries,unique_kv_tokens,"
               "sum_path_len,fasttree_us,fasttree_nograph_us,per_request_us,no_greedy_us,no_split_us,floor_us,"
               "fasttree_over_floor,eff_bandwidth_tbs,best_anchor_us,speedup_vs_best_anchor,fasttree_triton_us,"
               "sdpa_flash_us,pat_us,plan_us,max_rel_err,commit,l2_mode,fasttree_dirty_flush_us\n",
               csv);
  }
  fmt::print("timings: median of {} runs ({}, CUDA events) after {} warm-up runs, L2 mode {}\n", c.iters,
             c.no_graph ? "plain launches" : "graph replays", c.warmup, c.l2);
  fmt::print("{:<34} {:>5} {:>4} {:>9} {:>9} {:>9} {:>9} {:>8} {:>6} {:>7} {:>8} {:>8}\n", "tree (levels | lens)", "heads",
             "dt", "fasttree", "per-req", "no-greedy", "no-split", "floor", "x", "TB/s", "best-anc", "rel-err");
  if (c.diag) {
    CudaTimingOptions t;
    t.iters = c.iters;
    t.warmup = c.warmup;
    t.use_graph = !c.no_graph;
    t.l2 = l2_mode;
    fmt::print("diag: empty kernel in this harness: {:.1f} us (1 CTA), {:.1f} us (264 CTAs)\n",
               cuda_time_empty_launch(1, t).median_us, cuda_time_empty_launch(264, t).median_us);
  }
  std::vector<double> over_floor;
  int failures = 0;
  for (const Cell& cell : cells) {
    if (!c.only.empty() && (cell.nodes_per_level + "|" + cell.context_per_level).find(c.only) == std::string::npos) continue;
    PlannerConfig cfg = make_planner_config(c.planner);
    Plan plan, no_greedy, no_split, per_request;
    Planner planner(cfg);
    planner.build(cell.tree, cell.shape, plan);
    validate_plan(plan, cell.tree);
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < 10; ++i) planner.build(cell.tree, cell.shape, plan);
    const double plan_us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() / 10;
    PlannerConfig cfg_ng = cfg;
    cfg_ng.edges = EdgePolicy::kAllZero;
    Planner(cfg_ng).build(cell.tree, cell.shape, no_greedy);
    PlannerConfig cfg_ns = cfg;
    cfg_ns.split = false;
    Planner(cfg_ns).build(cell.tree, cell.shape, no_split);
    build_per_request_plan(cell.tree, cell.shape, PerRequestConfig{}, per_request);
    const TreeStats ts = [&] {
      TreeTopology topo;
      topo.build(cell.tree);
      return tree_stats(cell.tree, topo);
    }();
    for (KvDType dt : dtypes) {
      CudaTimingOptions topt;
      topt.iters = c.iters;
      topt.warmup = c.warmup;
      topt.use_graph = !c.no_graph;
      topt.l2 = l2_mode;
      topt.kv_head_major = c.kv_layout == "head";
      const double ft = cuda_time_plan(plan, cell.tree, cell.shape, dt, topt).median_us;
      const bool all = !c.fasttree_only;
      const double pr = all ? cuda_time_plan(per_request, cell.tree, cell.shape, dt, topt).median_us : NAN;
      const double ng = all ? cuda_time_plan(no_greedy, cell.tree, cell.shape, dt, topt).median_us : NAN;
      const double ns = all ? cuda_time_plan(no_split, cell.tree, cell.shape, dt, topt).median_us : NAN;
      CudaTimingOptions topt_ng = topt;
      topt_ng.use_graph = false;
      const double ft_nograph = all ? cuda_time_plan(plan, cell.tree, cell.shape, dt, topt_ng).median_us : NAN;
      // The harness of the first twenty-six sessions (a memset flush), for comparison with their
      // figures and with the anchors.
      CudaTimingOptions topt_dirty = topt;
      topt_dirty.l2 = L2Mode::kDirtyFlush;
      const double ft_dirty = !all ? NAN : l2_mode == L2Mode::kDirtyFlush ? ft : cuda_time_plan(plan, cell.tree, cell.shape, dt, topt_dirty).median_us;
      if (c.diag) {
        CudaTimingOptions topt_nm = topt;
        topt_nm.skip_merge = true;
        fmt::print("diag: {} {}/{}: fasttree {:.1f} us, without the merge {:.1f} us\n", cell.nodes_per_level,
                   cell.shape.num_qo_heads, cell.shape.num_kv_heads, ft,
                   cuda_time_plan(plan, cell.tree, cell.shape, dt, topt_nm).median_us);
        if (cuda_trace_built()) {
          CudaTimingOptions topt_tr = topt;
          topt_tr.trace = true;
          print_trace(cuda_time_plan(plan, cell.tree, cell.shape, dt, topt_tr).trace);
        }
      }
      double err = NAN;
      bool ok = !std::isnan(ft);
      if (c.check_queries > 0) {
        const PlanCheckResult chk = check_plan_on_gpu(plan, cell.tree, cell.shape, dt, c.check_queries, 1234, c.kv_layout == "head");
        err = chk.rel_err();
        ok = ok && err <= (dt == KvDType::kF16 ? 5e-3 : 2e-2) && chk.max_lse_err <= 1e-3;
      }
      failures += ok ? 0 : 1;
      const double floor = floor_us(ts.unique_tokens, ts.sum_path_len, cell.shape, 2);
      const double bw = kv_bytes(ts.unique_tokens, cell.shape, 2) / (ft * 1e-6) / 1e12;
      over_floor.push_back(ft / floor);
      const char* dname = dt == KvDType::kF16 ? "fp16" : "bf16";
      const std::string heads = fmt::format("{}/{}", cell.shape.num_qo_heads, cell.shape.num_kv_heads);
      fmt::print("{:<34} {:>5} {:>4} {:>9.1f} {:>9.1f} {:>9.1f} {:>9.1f} {:>8.1f} {:>6.2f} {:>7.2f} {:>8.1f} {:>8.1e}{}\n",
                 (cell.nodes_per_level + " | " + cell.context_per_level).substr(0, 34), heads, dname, ft, pr, ng, ns, floor,
                 ft / floor, bw, cell.best_anchor_us, err, ok ? "" : "  FAIL");
      std::fflush(stdout);
      if (csv) {
        std::fprintf(csv, "%s,%s,%d,%d,%d,%s,%d,%lld,%lld,%.2f,%.2f,%.2f,%.2f,%.2f,%.2f,%.3f,%.3f,%.1f,%.3f,%.1f,%.1f,%.1f,%.1f,%.2e,%s,%s,%.2f\n",
                     cell.nodes_per_level.c_str(), cell.context_per_level.c_str(), cell.shape.num_qo_heads,
                     cell.shape.num_kv_heads, cell.shape.head_dim, dname, cell.tree.num_queries(),
                     static_cast<long long>(ts.unique_tokens), static_cast<long long>(ts.sum_path_len), ft, ft_nograph, pr,
                     ng, ns, floor, ft / floor, bw, cell.best_anchor_us, cell.best_anchor_us / ft, cell.triton_us,
                     cell.sdpa_us, cell.pat_us, plan_us, err, c.commit.c_str(), c.l2.c_str(), ft_dirty);
        std::fflush(csv);
      }
    }
  }
  if (csv) std::fclose(csv);
  double log_sum = 0;
  for (double x : over_floor) log_sum += std::log(x);
  if (!over_floor.empty())
    fmt::print("geomean fasttree / floor over {} cells: {:.2f}\n", over_floor.size(), std::exp(log_sum / over_floor.size()));
  FT_CHECK(failures == 0, std::to_string(failures) + " cell(s) failed the correctness check");
}

}  // namespace

void register_bench_command(CLI::App& app) {
  auto* cmd = app.add_subcommand("bench", "GPU benchmark: FastTree vs per-request vs ablations (--suite paper or any tree)");
  auto c = std::make_shared<BenchCmd>();
  cmd->add_option("--suite", c->suite, "Named suite: paper (the 15 trees x 3 head settings of the anchors file)");
  add_tree_source(*cmd, c->src, false);
  add_head_options(*cmd, c->heads);
  add_planner_options(*cmd, c->planner);
  cmd->add_option("--dtypes", c->dtypes, "Comma-separated dtypes: fp16,bf16")->capture_default_str();
  cmd->add_option("--anchors", c->anchors, "Anchors CSV (for --suite paper)")->capture_default_str();
  cmd->add_option("--csv", c->csv, "Write one CSV row per cell and dtype");
  cmd->add_option("--commit", c->commit, "Commit id written into the CSV")->capture_default_str();
  cmd->add_option("--iters", c->iters, "Timed runs per measurement (median reported)")->check(CLI::Range(1, 100000))->capture_default_str();
  cmd->add_option("--warmup", c->warmup, "Warm-up runs")->check(CLI::Range(0, 100000))->capture_default_str();
  cmd->add_option("--check-queries", c->check_queries, "Queries per cell checked against the fp64 reference (0: no check)")
      ->check(CLI::Range(0, 1 << 20))
      ->capture_default_str();
  cmd->add_flag("--no-graph", c->no_graph, "Time plain launches instead of CUDA graph replays");
  cmd->add_flag("--fasttree-only", c->fasttree_only, "Time only the FastTree plan (no baseline or ablations: planner sweeps)");
  add_l2_option(*cmd, c->l2);
  cmd->add_flag("--diag", c->diag, "Also time an empty kernel in the same harness, and each FastTree plan without its merge");
  cmd->add_option("--only", c->only, "Run only cells whose 'levels|lens' contains this text");
  cmd->add_option("--kv-layout", c->kv_layout, "K/V pool layout: slot ([S, Hkv, d]) or head ([Hkv, S, d], each head's slots contiguous)")
      ->check(CLI::IsMember({"slot", "head"}))->capture_default_str();
  cmd->callback([c] { run_bench(*c); });
}

}  // namespace fasttree
