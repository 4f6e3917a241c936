// fasttree calibrate: fits the planner's constants (alpha, beta, gamma, min_chunk, split_waves, the
// tile classes and the leaf-folding thresholds fold_max / fold_narrow_tokens) to this kernel's
// measured times on the GPU it runs on. Method: grid search; for every candidate configuration the
// planner builds a plan for every cell of the paper suite (15 trees x 3 head settings, d = 128,
// fp16); identical plans are timed once (CUDA events, median, L2 flushed); the objective is the
// geometric mean over cells of time / floor. Prints the ranking and the winner, optionally writing
// every evaluated configuration to a CSV. The winner replaces the planner's defaults (--flags-out)
// only when it beats them by more than --min-gain: two runs of one binary differ by ~0.4 % in
// this objective, so a smaller lead is noise.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>

#include <fmt/format.h>

#include "apps/cli_common.h"
#include "apps/commands.h"
#include "apps/suite.h"
#include "core/error.h"
#include "core/tree_gen.h"
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
  std::string alphas = "0.33,0.66,1.5", betas = "0.1,0.33,1", gammas = "0.1,30,300,3000,30000";
  std::string min_chunks = "128,256,512,1024", waves = "0.5,1,2";
  std::string tile_sets = "64,16;64,32,16";
  std::string fold_maxes = "128,256";  // the values the twenty-first session compared (PERF_NOTES.md)
  std::string fold_narrow = "32,128";
  double min_gain = 0.005;  // relative lead over the defaults the winner needs to be written out
  std::string flags_out;  // writes the winner as planner flags for `fasttree bench`
  std::string l2 = "rotate";  // L2 state at each timed run's start (cuda/backend.h L2Mode)
  bool model_cost = false;  // no GPU: score plans with a bytes + items cost model (tests the search)
};

// Stand-in for a GPU timing (--model-cost): KV bytes streamed at the H200's bandwidth spread over
// the SMs, plus a fixed cost per work item and per partial row. Only for exercising the search.
double model_time_us(const Plan& plan, const AttnShape& shape) {
  double tokens = 0;
  for (const PlanItem& it : plan.items) tokens += static_cast<double>(item_tokens(it));
  const double bytes = 2.0 * tokens * shape.num_kv_heads * shape.head_dim * 2;
  const double units = static_cast<double>(plan.num_items()) * shape.num_kv_heads;
  return bytes / kH200ReadBytesPerS * 1e6 + units * 0.02 + plan.num_partial_rows * shape.num_qo_heads * 0.0005 + 4.0;
}

uint64_t plan_hash(const Plan& p) {
  uint64_t h = 1469598103934665603ull;
  auto mix = [&](int64_t x) { h = (h ^ static_cast<uint64_t>(x)) * 1099511628211ull; };
  for (const PlanItem& it : p.items) {
    mix(it.vnode), mix(it.kv_begin), mix(it.kv_len), mix(it.q_begin), mix(it.q_count), mix(it.tile_class), mix(it.priv_len);
  }
  for (int32_t v : p.vnode_node) mix(v);
  for (int32_t q : p.vnode_queries) mix(q);
  return h;
}

std::string tile_rows_str(const PlannerConfig& cfg) {
  std::string s;
  for (int t = 0; t < cfg.num_tile_classes; ++t) s += (t ? "," : "") + std::to_string(cfg.tile_classes[t].q_rows);
  return s;
}

std::string planner_flags(const PlannerConfig& r) {
  return fmt::format("--alpha {} --beta {} --gamma {} --min-chunk {} --split-waves {} --tile-rows {} --fold-max {} "
                     "--fold-narrow-tokens {}",
                     r.alpha, r.beta, r.gamma, r.min_chunk, r.split_waves, tile_rows_str(r), r.fold_max, r.fold_narrow_tokens);
}

// Whether cfg is the planner's default configuration in every knob the search varies.
bool is_default(const PlannerConfig& cfg) {
  const PlannerConfig d;
  if (cfg.num_tile_classes != d.num_tile_classes) return false;
  for (int t = 0; t < d.num_tile_classes; ++t)
    if (cfg.tile_classes[t].q_rows != d.tile_classes[t].q_rows) return false;
  return cfg.alpha == d.alpha && cfg.beta == d.beta && cfg.gamma == d.gamma && cfg.min_chunk == d.min_chunk &&
         cfg.split_waves == d.split_waves && cfg.fold_max == d.fold_max && cfg.fold_narrow_tokens == d.fold_narrow_tokens &&
         cfg.mid_class_rows == d.mid_class_rows;
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

// Geometric mean of time / floor over the cells of head-setting group k.
double group_geomean(const std::vector<double>& us, const std::vector<double>& floors, const std::vector<int>& group, int k) {
  double log_sum = 0;
  int n = 0;
  for (size_t i = 0; i < us.size(); ++i)
    if (group[i] == k) log_sum += std::log(us[i] / floors[i]), ++n;
  return n > 0 ? std::exp(log_sum / n) : 0.0;
}

// What one configuration for all cells leaves on the table: for every head setting its own best
// configuration (and the suite geomean if each setting used its own), and the per-cell oracle (the
// fastest plan any searched configuration gave that cell: the planner's cost model at its best).
template <class Result>
void report_by_head_setting(const std::vector<Result>& results, const std::vector<double>& floors, const std::vector<int>& group,
                            const std::vector<std::string>& names) {
  const Result* def = nullptr;
  for (const Result& r : results)
    if (is_default(r.cfg)) def = &r;
  double log_best = 0;
  for (size_t k = 0; k < names.size(); ++k) {
    const Result* best = nullptr;
    double best_gm = 0;
    for (const Result& r : results)
      if (best == nullptr || r.group_gm[k] < best_gm) best = &r, best_gm = r.group_gm[k];
    for (size_t i = 0; i < floors.size(); ++i)
      if (group[i] == static_cast<int>(k)) log_best += std::log(best->cell_us[i] / floors[i]);
    fmt::print("heads {}: best {} -> {:.3f}", names[k], planner_flags(best->cfg), best_gm);
    if (def != nullptr) fmt::print(" (defaults {:.3f})", def->group_gm[k]);
    fmt::print("\n");
  }
  double log_oracle = 0;
  for (size_t i = 0; i < floors.size(); ++i) {
    double m = results[0].cell_us[i];
    for (const Result& r : results) m = std::min(m, r.cell_us[i]);
    log_oracle += std::log(m / floors[i]);
  }
  const double n = static_cast<double>(floors.size());
  fmt::print("each head setting at its best: {:.3f}; every cell at its best plan (oracle): {:.3f}\n", std::exp(log_best / n),
             std::exp(log_oracle / n));
}

void run_calibrate(const CalibrateCmd& c) {
  const L2Mode l2_mode = l2_mode_option(c.l2);
  FT_CHECK(c.model_cost || (cuda_backend_built() && cuda_device_count() > 0),
           "fasttree calibrate needs a CUDA device (or --model-cost to exercise the search without one)");
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
  // Head settings ("32/8") in suite order; group[i] is cell i's.
  std::vector<std::string> group_names;
  std::vector<int> group;
  for (const SuiteCell& cell : cells) {
    const std::string g = fmt::format("{}/{}", cell.shape.num_qo_heads, cell.shape.num_kv_heads);
    auto it = std::find(group_names.begin(), group_names.end(), g);
    if (it == group_names.end()) it = group_names.insert(group_names.end(), g);
    group.push_back(static_cast<int>(it - group_names.begin()));
  }
  struct Result {
    PlannerConfig cfg;
    double geomean;
    std::vector<double> cell_us;   // per suite cell
    std::vector<double> group_gm;  // geomean per head setting (group_names order)
  };
  std::vector<Result> results;
  // Integer grids through the project's list parser (non-negative integers), then their ranges.
  std::vector<int32_t> fold_maxes, fold_narrow;
  for (int64_t v : parse_int_list(c.fold_maxes, "--fold-maxes")) {
    FT_CHECK(v <= kMaxFoldTokens, "--fold-maxes: " + std::to_string(v) + " is not in [0, " + std::to_string(kMaxFoldTokens) + "]");
    fold_maxes.push_back(static_cast<int32_t>(v));
  }
  for (int64_t v : parse_int_list(c.fold_narrow, "--fold-narrow")) {
    FT_CHECK(v <= (1 << 20), "--fold-narrow: " + std::to_string(v) + " is not in [0, 2^20]");
    fold_narrow.push_back(static_cast<int32_t>(v));
  }
  FT_CHECK(c.min_gain >= 0 && c.min_gain < 1, "--min-gain must be in [0, 1)");
  // Every grid list parsed and checked once, before the CSV is created.
  std::vector<std::vector<int64_t>> tile_sets;
  for (size_t pos = 0; pos <= c.tile_sets.size();) {
    const size_t e = std::min(c.tile_sets.find(';', pos), c.tile_sets.size());
    tile_sets.push_back(parse_int_list(std::string_view(c.tile_sets).substr(pos, e - pos), "--tile-sets"));
    FT_CHECK(!tile_sets.back().empty() && tile_sets.back().size() <= static_cast<size_t>(kMaxTileClasses),
             "--tile-sets: each set holds 1 to 4 row counts");
    for (int64_t r : tile_sets.back()) FT_CHECK(r >= 1 && r <= 4096, "--tile-sets: rows must be in [1, 4096]");
    pos = e + 1;
  }
  const std::vector<double> alphas = doubles(c.alphas, "--alphas"), betas = doubles(c.betas, "--betas"),
                            gammas = doubles(c.gammas, "--gammas"), waves = doubles(c.waves, "--waves");
  for (double w : waves) FT_CHECK(w > 0, "--waves: split_waves must be positive");
  const std::vector<int64_t> min_chunks = parse_int_list(c.min_chunks, "--min-chunks");
  for (int64_t v : min_chunks) FT_CHECK(v >= 1 && v <= (1 << 30), "--min-chunks: " + std::to_string(v) + " is not in [1, 2^30]");
  std::FILE* csv = c.csv.empty() ? nullptr : std::fopen(c.csv.c_str(), "w");
  FT_CHECK(c.csv.empty() || csv != nullptr, c.csv + ": cannot open for writing");
  if (csv) {
    std::fputs("tile_rows,alpha,beta,gamma,min_chunk,split_waves,fold_max,fold_narrow_tokens,geomean_over_floor,distinct_plans_timed",
               csv);
    for (const std::string& g : group_names) std::fprintf(csv, ",geomean_%s", g.c_str());  // e.g. geomean_32/8
    std::fputc('\n', csv);
  }
  Plan plan;
  for (const auto& tiles : tile_sets)
  for (double a : alphas)
    for (double b : betas)
      for (double g : gammas)
        for (int64_t mc : min_chunks)
          for (double w : waves)
          for (int32_t fm : fold_maxes)
          for (int32_t fn : fold_narrow) {
            PlannerConfig cfg;
            cfg.fold_max = fm;
            cfg.fold_narrow_tokens = fn;
            cfg.alpha = a, cfg.beta = b, cfg.gamma = g;
            cfg.min_chunk = mc;
            cfg.split_waves = w;
            cfg.num_tile_classes = static_cast<int>(tiles.size());
            for (size_t t = 0; t < tiles.size(); ++t) cfg.tile_classes[t] = TileClass{static_cast<int>(tiles[t]), 64};
            cfg.mid_class_rows = 0;  // the tile sets searched are taken as given
            Planner planner(cfg);
            double log_sum = 0;
            std::vector<double> cell_us(cells.size());
            for (size_t i = 0; i < cells.size(); ++i) {
              planner.build(cells[i].tree, cells[i].shape, plan);
              const uint64_t key = plan_hash(plan) ^ (static_cast<uint64_t>(i) << 56);
              auto it = timed.find(key);
              if (it == timed.end()) {
                CudaTimingOptions opt;
                opt.iters = c.iters;
                opt.warmup = 5;
                opt.use_graph = true;
                opt.gpu_warmup_ms = 2;
                opt.l2 = l2_mode;
                const double us = c.model_cost ? model_time_us(plan, cells[i].shape)
                                               : cuda_time_plan(plan, cells[i].tree, cells[i].shape, dt, opt).median_us;
                it = timed.emplace(key, us).first;
              }
              cell_us[i] = it->second;
              log_sum += std::log(it->second / floors[i]);
            }
            const double gm = std::exp(log_sum / cells.size());
            std::vector<double> group_gm(group_names.size());
            for (size_t k = 0; k < group_names.size(); ++k) group_gm[k] = group_geomean(cell_us, floors, group, static_cast<int>(k));
            if (csv) {
              std::fprintf(csv, "\"%s\",%g,%g,%g,%lld,%g,%d,%d,%.4f,%zu", tile_rows_str(cfg).c_str(), a, b, g,
                           static_cast<long long>(cfg.min_chunk), w, fm, fn, gm, timed.size());
              for (double v : group_gm) std::fprintf(csv, ",%.4f", v);
              std::fputc('\n', csv);
            }
            results.push_back({cfg, gm, std::move(cell_us), std::move(group_gm)});
          }
  if (csv) std::fclose(csv);
  std::sort(results.begin(), results.end(), [](const Result& x, const Result& y) { return x.geomean < y.geomean; });
  fmt::print("{} configurations, {} distinct plans timed; best by geomean(time / floor):\n", results.size(), timed.size());
  for (size_t i = 0; i < std::min<size_t>(10, results.size()); ++i) {
    const PlannerConfig& r = results[i].cfg;
    fmt::print("  {} -> {:.3f}\n", planner_flags(r), results[i].geomean);
  }
  // The configuration written out: the winner, unless the defaults were searched and trail it by at
  // most min_gain (then the defaults, so that a run with --flags-out measures what users get).
  const Result* chosen = results.empty() ? nullptr : &results[0];
  for (const Result& r : results) {
    if (!is_default(r.cfg)) continue;
    if (chosen != nullptr && r.geomean <= chosen->geomean * (1.0 + c.min_gain)) {
      fmt::print("the defaults score {:.3f}, within {:.1f} % of the best: kept\n", r.geomean, 100.0 * c.min_gain);
      chosen = &r;
    } else {
      fmt::print("the defaults score {:.3f}: the best beats them by more than {:.1f} %\n", r.geomean, 100.0 * c.min_gain);
    }
    break;
  }
  if (!results.empty()) report_by_head_setting(results, floors, group, group_names);
  if (!c.flags_out.empty() && chosen != nullptr) {
    std::FILE* f = std::fopen(c.flags_out.c_str(), "w");
    FT_CHECK(f != nullptr, c.flags_out + ": cannot open for writing");
    std::fprintf(f, "%s\n", planner_flags(chosen->cfg).c_str());
    std::fclose(f);
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
  cmd->add_option("--tile-sets", c->tile_sets, "Candidate tile-class sets (rows), ';'-separated")->capture_default_str();
  cmd->add_option("--fold-maxes", c->fold_maxes, "Candidate fold_max values (leaf folding)")->capture_default_str();
  cmd->add_option("--fold-narrow", c->fold_narrow, "Candidate fold_narrow_tokens values")->capture_default_str();
  cmd->add_option("--min-gain", c->min_gain, "Relative lead over the defaults the winner needs to be written by --flags-out")
      ->capture_default_str();
  cmd->add_option("--flags-out", c->flags_out,
                  "Write the best configuration as planner flags to this file (the defaults when within --min-gain of it)");
  add_l2_option(*cmd, c->l2);
  cmd->add_flag("--model-cost", c->model_cost, "Score plans with a cost model instead of GPU timings (no GPU needed)");
  cmd->callback([c] { run_calibrate(*c); });
}

}  // namespace fasttree
