// fasttree plan: builds the FastTree plan for a tree and reports what is shared.
#include <algorithm>
#include <chrono>
#include <vector>
#include <cstdio>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "apps/cli_common.h"
#include "apps/commands.h"
#include "core/error.h"
#include "plan/plan_stats.h"
#include "plan/plan_validate.h"
#include "plan/planner.h"

namespace fasttree {

namespace {

struct PlanCmd {
  TreeSource src;
  HeadOptions heads;
  PlannerOptions planner;
  std::string dtype = "fp16";
  bool json = false;
};

void run_plan(const PlanCmd& c) {
  const KvTree tree = make_tree(c.src);
  const AttnShape shape = make_shape(c.heads);
  const int dbytes = 2;  // fp16 and bf16
  Planner planner(make_planner_config(c.planner));
  Plan plan;
  planner.build(tree, shape, plan);
  validate_plan(plan, tree);
  // Time steady-state re-planning (median of 21 rebuilds into the same buffers).
  std::vector<double> us;
  for (int i = 0; i < 21; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    planner.build(tree, shape, plan);
    us.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(us.begin(), us.end());
  const PlanStats s = plan_stats(plan, tree);
  const double plan_bytes = kv_bytes(s.plan_kv_tokens, shape, dbytes);
  const double req_bytes = kv_bytes(s.per_request_kv_tokens, shape, dbytes);
  const double uniq_bytes = kv_bytes(s.unique_kv_tokens, shape, dbytes);
  const double floor = floor_us(s.unique_kv_tokens, s.sum_path_len, shape, dbytes);

  if (c.json) {
    nlohmann::json j;
    j["nodes"] = tree.num_nodes();
    j["queries"] = tree.num_queries();
    j["num_qo_heads"] = shape.num_qo_heads;
    j["num_kv_heads"] = shape.num_kv_heads;
    j["head_dim"] = shape.head_dim;
    j["virtual_nodes"] = s.num_vnodes;
    j["concatenated_edges"] = s.num_concat_edges;
    j["work_items"] = s.num_items;
    j["work_items_x_kv_heads"] = static_cast<int64_t>(s.num_items) * shape.num_kv_heads;
    nlohmann::json classes = nlohmann::json::array();
    for (int k = 0; k < plan.num_tile_classes; ++k)
      classes.push_back({{"q_rows", plan.tile_classes[k].q_rows}, {"kv_tile", plan.tile_classes[k].kv_tile}, {"items", s.items_per_class[k]}});
    j["tile_classes"] = classes;
    j["max_item_tokens"] = s.max_item_tokens;
    j["folded_leaves"] = s.num_folded_leaves;
    j["private_tokens"] = s.private_tokens;
    j["partial_rows"] = s.num_partial_rows;
    j["direct_queries"] = s.num_direct_queries;
    j["partials_per_query_mean"] = s.mean_partials_per_query;
    j["partials_per_query_max"] = s.max_partials_per_query;
    j["unique_kv_tokens"] = s.unique_kv_tokens;
    j["plan_kv_tokens"] = s.plan_kv_tokens;
    j["per_request_kv_tokens"] = s.per_request_kv_tokens;
    j["plan_kv_bytes"] = plan_bytes;
    j["per_request_kv_bytes"] = req_bytes;
    j["unique_kv_bytes"] = uniq_bytes;
    j["floor_us_h200"] = floor;
    j["plan_build_us_median"] = us[us.size() / 2];
    std::puts(j.dump(2).c_str());
    return;
  }
  fmt::print("tree: {} nodes, {} queries; heads {}/{} (GQA {}), head_dim {}\n", tree.num_nodes(), tree.num_queries(),
             shape.num_qo_heads, shape.num_kv_heads, shape.gqa(), shape.head_dim);
  fmt::print("virtual nodes: {} ({} edges concatenated)\n", s.num_vnodes, s.num_concat_edges);
  fmt::print("work items: {} ({} with the {} KV heads)\n", s.num_items, static_cast<int64_t>(s.num_items) * shape.num_kv_heads,
             shape.num_kv_heads);
  for (int k = 0; k < plan.num_tile_classes; ++k)
    fmt::print("  tile class {}: {:>3} query rows x {:>3} KV tokens: {} items\n", k, plan.tile_classes[k].q_rows,
               plan.tile_classes[k].kv_tile, s.items_per_class[k]);
  fmt::print("longest item: {} tokens; folded leaves: {} ({} private tokens)\n", s.max_item_tokens, s.num_folded_leaves,
             s.private_tokens);
  fmt::print("partials per query: mean {:.2f}, max {} ({} queries written directly, {} partial rows)\n",
             s.mean_partials_per_query, s.max_partials_per_query, s.num_direct_queries, s.num_partial_rows);
  fmt::print("KV bytes read ({}): plan {:.2f} MB, per-request kernel {:.2f} MB ({:.1f}x less), unique {:.2f} MB\n",
             c.dtype, plan_bytes / 1e6, req_bytes / 1e6, plan_bytes > 0 ? req_bytes / plan_bytes : 0.0, uniq_bytes / 1e6);
  fmt::print("H200 floor: {:.1f} us; planning: {:.1f} us (median of {} rebuilds)\n", floor, us[us.size() / 2], us.size());
}

}  // namespace

void register_plan_command(CLI::App& app) {
  auto* cmd = app.add_subcommand("plan", "Plan a tree: virtual nodes, work items per tile class, partials, bytes read");
  auto c = std::make_shared<PlanCmd>();
  add_tree_source(*cmd, c->src);
  add_head_options(*cmd, c->heads);
  add_planner_options(*cmd, c->planner);
  cmd->add_option("--dtype", c->dtype, "KV dtype for byte counts")->check(CLI::IsMember({"fp16", "bf16"}))->capture_default_str();
  cmd->add_flag("--json", c->json, "Print JSON instead of text");
  cmd->callback([c] { run_plan(*c); });
}

}  // namespace fasttree
