// fasttree attention: runs tree attention on .npy tensors with the CPU or CUDA backend.
//   Q [num_queries, Hq, d], K/V [num_slots, Hkv, d] (<f4 or <f2) -> O [num_queries, Hq, d] <f4,
//   optional LSE [num_queries, Hq] <f4 (natural log).
#include <algorithm>
#include <cmath>

#include <fmt/format.h>

#include "apps/cli_common.h"
#include "apps/commands.h"
#include "core/error.h"
#include "core/npy.h"
#include "cpu/executor.h"
#include "cpu/reference.h"
#include "cuda/backend.h"
#include "plan/plan_validate.h"
#include "plan/planner.h"

namespace fasttree {

namespace {

struct AttentionCmd {
  TreeSource src;
  PlannerOptions planner;
  std::string q, k, v, out, lse;
  double sm_scale = 0;
  std::string backend = "cpu";
  std::string dtype = "fp16";
  bool check = false;
};

std::string shape_str(const std::vector<int64_t>& s) {
  std::string r = "[";
  for (size_t i = 0; i < s.size(); ++i) r += (i ? ", " : "") + std::to_string(s[i]);
  return r + "]";
}

void run_attention(const AttentionCmd& c) {
  const KvTree tree = make_tree(c.src);
  const HostTensor q = read_npy(c.q);
  const HostTensor k = read_npy(c.k);
  const HostTensor v = read_npy(c.v);
  FT_CHECK(q.shape.size() == 3, c.q + ": Q must be [num_queries, num_qo_heads, head_dim], got " + shape_str(q.shape));
  FT_CHECK(k.shape.size() == 3, c.k + ": K must be [num_slots, num_kv_heads, head_dim], got " + shape_str(k.shape));
  check_shape(v, k.shape, c.v + " (V must match K)");
  FT_CHECK(q.shape[0] == tree.num_queries(), c.q + ": has " + std::to_string(q.shape[0]) + " query rows, the tree has " +
                                                  std::to_string(tree.num_queries()) + " queries");
  FT_CHECK(q.shape[2] == k.shape[2], "head_dim differs: Q has " + std::to_string(q.shape[2]) + ", K has " + std::to_string(k.shape[2]));
  FT_CHECK(q.shape[1] > 0 && k.shape[1] > 0 && q.shape[1] % k.shape[1] == 0,
           "Q heads (" + std::to_string(q.shape[1]) + ") must be a positive multiple of KV heads (" + std::to_string(k.shape[1]) + ")");
  const AttnShape shape{static_cast<int>(q.shape[1]), static_cast<int>(k.shape[1]), static_cast<int>(q.shape[2])};
  shape.validate();
  validate_tree(tree, k.shape[0]);  // every slot must exist in K/V
  const float scale = c.sm_scale > 0 ? static_cast<float>(c.sm_scale) : shape.default_sm_scale();

  Plan plan;
  Planner(make_planner_config(c.planner)).build(tree, shape, plan);
  validate_plan(plan, tree);
  HostTensor out{{q.shape[0], q.shape[1], q.shape[2]}, std::vector<float>(q.data.size(), NAN)};
  HostTensor lse{{q.shape[0], q.shape[1]}, std::vector<float>(q.shape[0] * q.shape[1], NAN)};
  if (c.backend == "cpu") {
    execute_plan(plan, tree, shape, q.data, k.data, v.data, scale, out.data, lse.data);
  } else {
    cuda_attention(plan, tree, shape, c.dtype == "bf16" ? KvDType::kBF16 : KvDType::kF16, q.data, k.data, v.data, scale,
                   out.data, lse.data);
  }
  if (c.check) {
    std::vector<float> ref(out.data.size()), ref_lse(lse.data.size());
    reference_attention(tree, shape, q.data, k.data, v.data, scale, ref, ref_lse);
    double max_err = 0, max_ref = 0;
    for (size_t i = 0; i < ref.size(); ++i) {
      max_err = std::max(max_err, static_cast<double>(std::fabs(ref[i] - out.data[i])));
      max_ref = std::max(max_ref, static_cast<double>(std::fabs(ref[i])));
    }
    fmt::print(stderr, "check vs fp64 reference: max abs error {:.3g} (max |ref| {:.3g})\n", max_err, max_ref);
  }
  write_npy(c.out, out);
  if (!c.lse.empty()) write_npy(c.lse, lse);
}

}  // namespace

void register_attention_command(CLI::App& app) {
  auto* cmd = app.add_subcommand("attention", "Tree attention on .npy tensors (CPU plan executor or CUDA)");
  auto c = std::make_shared<AttentionCmd>();
  add_tree_source(*cmd, c->src);
  add_planner_options(*cmd, c->planner);
  cmd->add_option("--q", c->q, "Q .npy [num_queries, Hq, d]")->required();
  cmd->add_option("--k", c->k, "K .npy [num_slots, Hkv, d]")->required();
  cmd->add_option("--v", c->v, "V .npy [num_slots, Hkv, d]")->required();
  cmd->add_option("--out", c->out, "Output .npy [num_queries, Hq, d] <f4")->required();
  cmd->add_option("--lse", c->lse, "Optional LSE .npy [num_queries, Hq] <f4 (natural log)");
  cmd->add_option("--sm-scale", c->sm_scale, "Softmax scale (default 1/sqrt(head_dim))")->check(CLI::PositiveNumber);
  cmd->add_option("--backend", c->backend, "cpu | cuda")->check(CLI::IsMember({"cpu", "cuda"}))->capture_default_str();
  cmd->add_option("--dtype", c->dtype, "Device dtype for the cuda backend: fp16 | bf16")
      ->check(CLI::IsMember({"fp16", "bf16"}))
      ->capture_default_str();
  cmd->add_flag("--check", c->check, "Also run the fp64 reference and print the max error to stderr");
  cmd->callback([c] { run_attention(*c); });
}

}  // namespace fasttree
