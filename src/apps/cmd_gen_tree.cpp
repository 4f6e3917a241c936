// fasttree gen-tree: writes a tree (paper level spec or seeded random forest) as JSON or the
// artifact's text format, and optionally random Q/K/V .npy tensors that fit it.
#include <cstdio>
#include <random>

#include "apps/cli_common.h"
#include "apps/commands.h"
#include "core/error.h"
#include "core/npy.h"
#include "core/tree_gen.h"
#include "core/tree_io.h"

namespace fasttree {

namespace {

struct GenTreeCmd {
  TreeSource src;
  bool random = false;
  uint64_t seed = 1;
  RandomForestSpec spec;
  std::string format = "json";
  std::string out = "-";
  std::string tensors_dir;
  HeadOptions heads;
  std::string tensor_dtype = "f32";
};

void write_text_file(const std::string& path, const std::string& text) {
  if (path == "-") {
    std::fwrite(text.data(), 1, text.size(), stdout);
    return;
  }
  std::FILE* f = std::fopen(path.c_str(), "wb");
  FT_CHECK(f != nullptr, path + ": cannot open for writing");
  const bool ok = std::fwrite(text.data(), 1, text.size(), f) == text.size();
  FT_CHECK(std::fclose(f) == 0 && ok, path + ": write failed");
}

HostTensor random_tensor(std::vector<int64_t> shape, std::mt19937_64& rng) {
  HostTensor t;
  t.shape = std::move(shape);
  t.data.resize(t.numel());
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  for (float& x : t.data) x = dist(rng);
  return t;
}

void run_gen_tree(GenTreeCmd& c) {
  KvTree tree;
  if (c.random) {
    FT_CHECK(c.src.tree_file.empty() && c.src.levels.empty(), "--random excludes --tree/--levels");
    FT_CHECK(c.spec.min_roots >= 1 && c.spec.max_roots >= c.spec.min_roots, "--roots must be >= 1");
    FT_CHECK(c.spec.max_depth >= 1 && c.spec.max_fanout >= 1, "--depth and --fanout must be >= 1");
    FT_CHECK(c.spec.min_len >= 0 && c.spec.max_len >= c.spec.min_len, "--min-len/--max-len must satisfy 0 <= min <= max");
    tree = random_forest(c.spec, c.seed);
  } else {
    tree = make_tree(c.src);
  }
  write_text_file(c.out, c.format == "json" ? tree_to_json(tree) : tree_to_text(tree));
  if (c.tensors_dir.empty()) return;
  const AttnShape shape = make_shape(c.heads);
  std::mt19937_64 rng(c.seed);
  const int64_t slots = max_slot_plus_one(tree);
  const DType dt = c.tensor_dtype == "f16" ? DType::kF16 : DType::kF32;
  write_npy(c.tensors_dir + "/q.npy", random_tensor({tree.num_queries(), shape.num_qo_heads, shape.head_dim}, rng), dt);
  write_npy(c.tensors_dir + "/k.npy", random_tensor({slots, shape.num_kv_heads, shape.head_dim}, rng), dt);
  write_npy(c.tensors_dir + "/v.npy", random_tensor({slots, shape.num_kv_heads, shape.head_dim}, rng), dt);
}

}  // namespace

void register_gen_tree_command(CLI::App& app) {
  auto* cmd = app.add_subcommand("gen-tree", "Write a tree (level spec or random forest) and optionally random Q/K/V");
  auto c = std::make_shared<GenTreeCmd>();
  add_tree_source(*cmd, c->src, false);
  cmd->add_flag("--random", c->random, "Generate a seeded random forest");
  cmd->add_option("--seed", c->seed, "Random seed (forest and tensors)")->capture_default_str();
  cmd->add_option("--roots", c->spec.max_roots, "Random forest: at most this many roots")->capture_default_str();
  cmd->add_option("--depth", c->spec.max_depth, "Random forest: maximum depth")->capture_default_str();
  cmd->add_option("--fanout", c->spec.max_fanout, "Random forest: maximum children per node")->capture_default_str();
  cmd->add_option("--min-len", c->spec.min_len, "Random forest: minimum tokens per node")->capture_default_str();
  cmd->add_option("--max-len", c->spec.max_len, "Random forest: maximum tokens per node")->capture_default_str();
  cmd->add_option("--queries-per-leaf", c->spec.max_queries_per_leaf, "Random forest: at most this many queries per leaf")
      ->check(CLI::Range(1, 1 << 20))
      ->capture_default_str();
  cmd->add_option("--internal-query-prob", c->spec.internal_query_prob, "Random forest: chance an internal node has a query")
      ->check(CLI::Range(0.0, 1.0))
      ->capture_default_str();
  cmd->add_option("--empty-node-prob", c->spec.empty_node_prob, "Random forest: chance a node has no tokens")
      ->check(CLI::Range(0.0, 1.0))
      ->capture_default_str();
  cmd->add_flag("--explicit-slots", c->spec.explicit_slots, "Random forest: shuffled explicit slot lists");
  cmd->add_option("--format", c->format, "json | text (the artifact's format)")->check(CLI::IsMember({"json", "text"}))->capture_default_str();
  cmd->add_option("--out", c->out, "Output file ('-' = stdout)")->capture_default_str();
  cmd->add_option("--tensors", c->tensors_dir, "Also write random q.npy, k.npy, v.npy for the tree into this folder");
  add_head_options(*cmd, c->heads);
  cmd->add_option("--tensor-dtype", c->tensor_dtype, "f32 | f16")->check(CLI::IsMember({"f32", "f16"}))->capture_default_str();
  cmd->callback([c] { run_gen_tree(*c); });
}

}  // namespace fasttree
