#include "apps/cli_common.h"

#include <fmt/format.h>

#include "core/error.h"
#include "core/tree_gen.h"
#include "core/tree_io.h"

namespace fasttree {

void add_tree_source(CLI::App& cmd, TreeSource& src, bool required) {
  auto* tree = cmd.add_option("--tree", src.tree_file, "Tree file (JSON or the artifact's text format)");
  auto* levels = cmd.add_option("--levels", src.levels, "Paper level spec: nodes per level, e.g. 1,16,64");
  auto* lens = cmd.add_option("--lens", src.lens, "Tokens per node of each level, e.g. 1024,256,32");
  tree->excludes(levels)->excludes(lens);
  levels->needs(lens);
  lens->needs(levels);
  (void)required;
}

KvTree make_tree(const TreeSource& src) {
  if (!src.tree_file.empty()) return load_tree(src.tree_file);  // validated by the reader
  FT_CHECK(!src.levels.empty(), "give a tree: --tree FILE or --levels A,B,.. --lens X,Y,..");
  const auto counts = parse_int_list(src.levels, "--levels");
  const auto lens = parse_int_list(src.lens, "--lens");
  KvTree t = tree_from_levels(counts, lens);
  validate_tree(t);
  return t;
}

void add_head_options(CLI::App& cmd, HeadOptions& opt) {
  cmd.add_option("--heads", opt.heads, "Query heads / KV heads, e.g. 32/8")->capture_default_str();
  cmd.add_option("--head-dim", opt.head_dim, "Head dimension")->capture_default_str();
}

AttnShape make_shape(const HeadOptions& opt) {
  const auto slash = opt.heads.find('/');
  FT_CHECK(slash != std::string::npos, "--heads must look like QO/KV (e.g. 32/8), got '" + opt.heads + "'");
  const auto qo = parse_int_list(opt.heads.substr(0, slash), "--heads (query heads)");
  const auto kv = parse_int_list(opt.heads.substr(slash + 1), "--heads (KV heads)");
  FT_CHECK(qo.size() == 1 && kv.size() == 1, "--heads must look like QO/KV (e.g. 32/8), got '" + opt.heads + "'");
  FT_CHECK(qo[0] <= 1024 && kv[0] <= 1024, "--heads: at most 1024 heads");
  FT_CHECK(opt.head_dim > 0 && opt.head_dim <= 1024, "--head-dim must be in [1, 1024]");
  AttnShape s{static_cast<int>(qo[0]), static_cast<int>(kv[0]), opt.head_dim};
  s.validate();
  return s;
}

void add_planner_options(CLI::App& cmd, PlannerOptions& opt) {
  cmd.add_option("--edges", opt.edges, "Edge policy: greedy | zero (ablation: no greedy) | one (every query re-reads its path)")
      ->check(CLI::IsMember({"greedy", "zero", "one"}))
      ->capture_default_str();
  cmd.add_flag("--no-split", opt.no_split, "Ablation: never split a context into chunks");
  cmd.add_flag("--no-balance-chunks", opt.no_balance_chunks,
               "Chunk length from split_waves alone (no choice by the units' finish time on the SMs)");
  cmd.add_flag("--no-align-segments", opt.no_align_segments,
               "Keep each context's segments in path order (no whole-tile segments first)");
  cmd.add_option("--num-sms", opt.num_sms, "SMs the plan spreads work over")->capture_default_str();
  cmd.add_option("--alpha", opt.alpha, "Cost model alpha (query padding)");
  cmd.add_option("--beta", opt.beta, "Cost model beta (KV padding)");
  cmd.add_option("--gamma", opt.gamma, "Cost model gamma (per extra partial)");
  cmd.add_option("--delta", opt.delta, "Cost model delta (per parent-context token re-read by a concatenated child's tiles)");
  cmd.add_option("--min-chunk", opt.min_chunk, "Shortest context chunk when splitting");
  cmd.add_option("--split-waves", opt.split_waves, "Split so the work fills this many waves of SMs");
  cmd.add_option("--tile-rows", opt.tile_rows, "Tile classes as query rows per tile, e.g. 64,32,16");
  cmd.add_option("--fold-max", opt.fold_max, "Fold one-query leaves of at most this many tokens into an ancestor's item (0 = off)");
  cmd.add_option("--fold-min-rows", opt.fold_min_rows, "Fold only into query tiles of more rows than this");
  cmd.add_option("--fold-min-waves", opt.fold_min_waves, "Fold only when at least this many units per SM remain");
  cmd.add_option("--fold-narrow-tokens", opt.fold_narrow_tokens,
                 "Fold into tiles of at most --fold-min-rows rows only with this many private tokens per tile");
  cmd.add_option("--narrow-max-path", opt.narrow_max_path,
                 "Narrow mode (16-row query tiles for small trees): longest query path it takes (0 = off)");
  cmd.add_option("--narrow-rows", opt.narrow_rows, "Narrow mode: query rows per tile (16, 32 or 64)");
  cmd.add_option("--narrow-wide-rows", opt.narrow_wide_rows,
                 "Narrow mode: wider query tiles (0 = off, else 32 or 64) where they still fill the SMs");
  cmd.add_option("--narrow-wide-max-gqa", opt.narrow_wide_max_gqa, "Narrow mode: wide tiles only up to this GQA ratio");
  cmd.add_option("--narrow-wide-min-waves", opt.narrow_wide_min_waves,
                 "Narrow mode: wide tiles only when they number at least this many per SM");
  cmd.add_option("--narrow-max-waves", opt.narrow_max_waves, "Narrow mode: at most this many 16-row tiles of query rows per SM");
  cmd.add_option("--narrow-split-max-waves", opt.narrow_split_max_waves,
                 "Narrow mode: split contexts only when the tiles fill fewer than this many per SM");
  cmd.add_option("--mid-class-rows", opt.mid_class_rows,
                 "Tile class of this many query rows added at GQA >= 4 (default 0 = off; --tile-rows turns it off)");
}

namespace {

// A given flag's value into `out`, after checking lo <= value <= hi.
template <class T, class Out>
void in_range(const std::optional<T>& value, T lo, T hi, const char* flag, Out& out) {
  if (!value) return;
  FT_CHECK(*value >= lo && *value <= hi, fmt::format("{} must be in [{}, {}], got {}", flag, lo, hi, *value));
  out = static_cast<Out>(*value);
}

}  // namespace

PlannerConfig make_planner_config(const PlannerOptions& opt, PlannerConfig base) {
  PlannerConfig cfg = base;
  cfg.edges = opt.edges == "zero" ? EdgePolicy::kAllZero : opt.edges == "one" ? EdgePolicy::kAllOne : EdgePolicy::kGreedy;
  cfg.split = !opt.no_split;
  if (opt.no_balance_chunks) cfg.balance_chunks = false;
  if (opt.no_align_segments) cfg.align_segments = false;
  FT_CHECK(opt.num_sms > 0 && opt.num_sms <= 4096, "--num-sms must be in [1, 4096]");
  cfg.num_sms = opt.num_sms;
  for (const auto& [value, name] : {std::pair{opt.alpha, "--alpha"}, {opt.beta, "--beta"}, {opt.gamma, "--gamma"}, {opt.delta, "--delta"}})
    FT_CHECK(!value || (*value >= 0 && *value < 1e12), std::string(name) + " must be a non-negative number");
  if (opt.alpha) cfg.alpha = *opt.alpha;
  if (opt.beta) cfg.beta = *opt.beta;
  if (opt.gamma) cfg.gamma = *opt.gamma;
  if (opt.delta) cfg.delta = *opt.delta;
  if (opt.min_chunk) {
    FT_CHECK(*opt.min_chunk >= 1, "--min-chunk must be >= 1");
    cfg.min_chunk = *opt.min_chunk;
  }
  if (opt.split_waves) {
    FT_CHECK(*opt.split_waves > 0 && *opt.split_waves <= 1000, "--split-waves must be in (0, 1000]");
    cfg.split_waves = *opt.split_waves;
  }
  in_range(opt.fold_max, 0, kMaxFoldTokens, "--fold-max", cfg.fold_max);
  in_range(opt.fold_min_rows, 0, 4096, "--fold-min-rows", cfg.fold_min_rows);
  in_range(opt.fold_narrow_tokens, 0, 1 << 20, "--fold-narrow-tokens", cfg.fold_narrow_tokens);
  in_range(opt.fold_min_waves, 0.0, 1000.0, "--fold-min-waves", cfg.fold_min_waves);
  in_range(opt.narrow_max_path, int64_t{0}, int64_t{1} << 40, "--narrow-max-path", cfg.narrow_max_path);
  in_range(opt.narrow_max_waves, 0.0, 1000.0, "--narrow-max-waves", cfg.narrow_max_waves);
  in_range(opt.narrow_split_max_waves, 0.0, 1000.0, "--narrow-split-max-waves", cfg.narrow_split_max_waves);
  if (opt.narrow_rows) {
    FT_CHECK(*opt.narrow_rows == 16 || *opt.narrow_rows == 32 || *opt.narrow_rows == 64, "--narrow-rows must be 16, 32 or 64");
    cfg.narrow_rows = *opt.narrow_rows;
  }
  if (opt.narrow_wide_rows) {
    FT_CHECK(*opt.narrow_wide_rows == 0 || *opt.narrow_wide_rows == 32 || *opt.narrow_wide_rows == 64,
             "--narrow-wide-rows must be 0, 32 or 64");
    cfg.narrow_wide_rows = *opt.narrow_wide_rows;
  }
  in_range(opt.narrow_wide_max_gqa, 0, 1024, "--narrow-wide-max-gqa", cfg.narrow_wide_max_gqa);
  in_range(opt.narrow_wide_min_waves, 0.0, 1000.0, "--narrow-wide-min-waves", cfg.narrow_wide_min_waves);
  in_range(opt.mid_class_rows, 0, 4096, "--mid-class-rows", cfg.mid_class_rows);
  if (!opt.tile_rows.empty()) {
    const auto rows = parse_int_list(opt.tile_rows, "--tile-rows");
    FT_CHECK(!rows.empty() && rows.size() <= static_cast<size_t>(kMaxTileClasses),
             "--tile-rows: give 1 to " + std::to_string(kMaxTileClasses) + " classes");
    cfg.num_tile_classes = static_cast<int>(rows.size());
    if (!opt.mid_class_rows) cfg.mid_class_rows = 0;  // explicit classes are taken as given
    for (size_t i = 0; i < rows.size(); ++i) {
      FT_CHECK(rows[i] >= 1 && rows[i] <= 4096, "--tile-rows: rows must be in [1, 4096]");
      cfg.tile_classes[i] = TileClass{static_cast<int>(rows[i]), 64};
    }
  }
  return cfg;
}

void add_l2_option(CLI::App& cmd, std::string& l2) {
  cmd.add_option("--l2", l2,
                 "L2 state at each timed run's start: rotate (rotated input copies: inputs cold, code cached), clean "
                 "(256 MB read first), dirty (256 MB memset first: the timed run also pays ~50 MB of write-backs), warm "
                 "(diagnostics: nothing flushed)")
      ->capture_default_str();
}

L2Mode l2_mode_option(const std::string& l2) {
  try {
    return parse_l2_mode(l2);
  } catch (const Error& e) {
    FT_FAIL("--l2: " + e.message());
  }
}

}  // namespace fasttree
