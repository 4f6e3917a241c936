// fasttree calibrate: fits the planner's constants (alpha, beta, gamma, min_chunk, split_waves) to
// this kernel's measured times on the GPU it runs on. Method: grid search; for every candidate
// configuration the planner builds a plan for every cell of the paper suite (15 trees x 3 head
// settings, d = 128, fp16); identical plans are timed once (CUDA events, median, L2 flushed); the
// objective is the geometric mean over cells of time / floor. Prints the ranking and the winner,
// optionally writing every evaluated configuration to a CSV.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>

#include <fmt/format.h>

#include "apps/commands.h"
#include "apps/suite.h"
#include "core/error.h"
#include "cuda/backend.h"
#include "plan/plan_stats.h"
#include "plan/planner.h"

namespace fasttree {

namespace {

struct CalibrateCmd {
  std::string anchors = default_anchors_path();
  std::string csv;
  std::string dtype = "fp16";
  int iters = 20;
  std::string alphas = "0.33,0.66,1.5", betas = "0.1,0.33,1", gammas = "0.1,30,300,3000";
  std::string min_chunks = "128,256,512,1024", waves = "0.5,1,2";
};

uint64_t plan_hash(const Plan& p) {
  uint64_t h = 1469598103934665603ull;
  auto mix = [&](int64_t x) { h = (h ^ static_cast<uint64_t>(x)) * 1099511628211ull; };
  for (const PlanItem& it : p.items) {
    mix(it.vnode), mix(it.kv_begin), mix(it.kv_len), mix(it.q_begin), mix(it.q_count), mix(it.tile_class);
  }
  for (int32_t v : p.vnode_node) mix(v);
  for (int32_t q : p.vnode_queries) mix(q);
  return h;
}

std::vector<double> doubles(const std::string& s, const std::string& what) {
  std::vector<double> out;
  size_t pos = 0;
  while (pos <= s.size()) {
    const size_t e = std::min(s.find(',', pos), s.size());
    const std::string item = s.substr(pos, e - pos);
    try {
      size_t used = 0;
      out.push_back(std::stod(item, &used));
      FT_CHECK(used == item.size() && out.back() >= 0, "");
    } catch (...) {
      FT_FAIL(what + ": '" + item + "' is not a non-negative number");
    }
    pos = e + 1;
  }
  return out;
}

void run_calibrate(const CalibrateCmd& c) {
  FT_CHECK(cuda_backend_built() && cuda_device_count() > 0, "fasttree calibrate needs a CUDA device");
  const std::vector<SuiteCell> cells = load_suite(c.anchors);
  const KvDType dt = c.dtype == "bf16" ? KvDType::kBF16 : KvDType::kF16;
  std::map<uint64_t, double> timed;  // plan hash -> median us
  std::vector<double> floors;
  for (const SuiteCell& cell : cells) {
    TreeTopology topo;
    topo.build(cell.tree);
    const TreeStats ts = tree_stats(cell.tree, topo);
    floors.push_back(floor_us(ts.unique_tokens, ts.sum_path_len, cell.shape, 2));
  }
  struct Result {
    PlannerConfig cfg;
    double geomean;
  };
  std::vector<Result> results;
  std::FILE* csv = c.csv.empty() ? nullptr : std::fopen(c.csv.c_str(), "w");
  FT_CHECK(c.csv.empty() || csv != nullptr, c.csv + ": cannot open for writing");
  if (csv) std::fputs("alpha,beta,gamma,min_chunk,split_waves,geomean_over_floor,distinct_plans_timed\n", csv);
  Plan plan;
  for (double a : doubles(c.alphas, "--alphas"))
    for (double b : doubles(c.betas, "--betas"))
      for (double g : doubles(c.gammas, "--gammas"))
        for (double mc : doubles(c.min_chunks, "--min-chunks"))
          for (double w : doubles(c.waves, "--waves")) {
            PlannerConfig cfg;
            cfg.alpha = a, cfg.beta = b, cfg.gamma = g;
            cfg.min_chunk = std::max<int64_t>(1, static_cast<int64_t>(mc));
            cfg.split_waves = std::max(0.01, w);
            Planner planner(cfg);
            double log_sum = 0;
            for (size_t i = 0; i < cells.size(); ++i) {
              planner.build(cells[i].tree, cells[i].shape, plan);
              const uint64_t key = plan_hash(plan) ^ (static_cast<uint64_t>(i) << 56);
              auto it = timed.find(key);
              if (it == timed.end()) {
                CudaTimingOptions opt;
                opt.iters = c.iters;
                opt.warmup = 5;
                opt.use_graph = true;
                it = timed.emplace(key, cuda_time_plan(plan, cells[i].tree, cells[i].shape, dt, opt).median_us).first;
              }
              log_sum += std::log(it->second / floors[i]);
            }
            const double gm = std::exp(log_sum / cells.size());
            results.push_back({cfg, gm});
            if (csv) std::fprintf(csv, "%g,%g,%g,%lld,%g,%.4f,%zu\n", a, b, g, static_cast<long long>(cfg.min_chunk), w, gm, timed.size());
          }
  if (csv) std::fclose(csv);
  std::sort(results.begin(), results.end(), [](const Result& x, const Result& y) { return x.geomean < y.geomean; });
  fmt::print("{} configurations, {} distinct plans timed; best by geomean(time / floor):\n", results.size(), timed.size());
  for (size_t i = 0; i < std::min<size_t>(10, results.size()); ++i) {
    const PlannerConfig& r = results[i].cfg;
    fmt::print("  alpha {:<5} beta {:<5} gamma {:<6} min_chunk {:<5} split_waves {:<4} -> {:.3f}\n", r.alpha, r.beta, r.gamma,
               r.min_chunk, r.split_waves, results[i].geomean);
  }
}

}  // namespace

void register_calibrate_command(CLI::App& app) {
  auto* cmd = app.add_subcommand("calibrate", "Fit planner constants to measured GPU times (grid search over the paper suite)");
  auto c = std::make_shared<CalibrateCmd>();
  cmd->add_option("--anchors", c->anchors, "Suite file")->capture_default_str();
  cmd->add_option("--csv", c->csv, "Write every evaluated configuration");
  cmd->add_option("--dtype", c->dtype, "fp16 | bf16")->check(CLI::IsMember({"fp16", "bf16"}))->capture_default_str();
  cmd->add_option("--iters", c->iters, "Timed runs per distinct plan")->check(CLI::Range(1, 10000))->capture_default_str();
  cmd->add_option("--alphas", c->alphas, "Candidate alphas")->capture_default_str();
  cmd->add_option("--betas", c->betas, "Candidate betas")->capture_default_str();
  cmd->add_option("--gammas", c->gammas, "Candidate gammas")->capture_default_str();
  cmd->add_option("--min-chunks", c->min_chunks, "Candidate min_chunk values")->capture_default_str();
  cmd->add_option("--waves", c->waves, "Candidate split_waves values")->capture_default_str();
  cmd->callback([c] { run_calibrate(*c); });
}

}  // namespace fasttree
