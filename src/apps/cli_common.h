// Options shared by several subcommands: where the tree comes from, head configuration, planner
// switches. Each add_* registers the options on a subcommand; the matching make_* turns the parsed
// values into library objects (throwing fasttree::Error on bad values).
#pragma once
#include <optional>
#include <string>

#include <CLI/CLI.hpp>

#include "core/attention_shape.h"
#include "core/kv_tree.h"
#include "cuda/backend.h"
#include "plan/plan.h"

namespace fasttree {

struct TreeSource {
  std::string tree_file;
  std::string levels;
  std::string lens;
};
void add_tree_source(CLI::App& cmd, TreeSource& src, bool required = true);
// Loads (JSON or artifact text) or generates the tree, and validates it.
KvTree make_tree(const TreeSource& src);

struct HeadOptions {
  std::string heads = "32/8";
  int head_dim = 128;
};
void add_head_options(CLI::App& cmd, HeadOptions& opt);
AttnShape make_shape(const HeadOptions& opt);

struct PlannerOptions {
  std::string edges = "greedy";
  bool no_split = false;
  bool no_balance_chunks = false;
  bool no_align_segments = false;
  int num_sms = 132;
  std::optional<double> alpha, beta, gamma, delta;
  std::optional<int64_t> min_chunk;
  std::optional<double> split_waves;
  std::optional<int> fold_max;
  std::optional<int> fold_min_rows;
  std::optional<int> fold_narrow_tokens;
  std::optional<double> fold_min_waves;
  std::optional<int64_t> narrow_max_path;
  std::optional<int> narrow_rows;
  std::optional<int> narrow_wide_rows;
  std::optional<int> narrow_wide_max_gqa;
  std::optional<double> narrow_wide_min_waves;
  std::optional<double> narrow_max_waves;
  std::optional<double> narrow_split_max_waves;
  std::optional<int> mid_class_rows;
  std::string tile_rows;  // e.g. "64,32,16" (KV tile 64 each); empty = defaults
};
void add_planner_options(CLI::App& cmd, PlannerOptions& opt);
PlannerConfig make_planner_config(const PlannerOptions& opt, PlannerConfig base = {});

// --l2 (bench, calibrate): the timing harness's L2 mode by name; checked when the command runs, so
// that a bad value is a one-line error like the other flags'.
void add_l2_option(CLI::App& cmd, std::string& l2);
L2Mode l2_mode_option(const std::string& l2);

}  // namespace fasttree
