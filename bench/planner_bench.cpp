// Google Benchmark of the planner: the 15 paper trees (bench/anchors/h200-paper-suite.csv) at
// their head settings, and a 4096-query random forest. Plans are rebuilt into the same buffers
// (steady state, as a scheduler re-plans each step).
#include <benchmark/benchmark.h>

#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "core/tree_gen.h"
#include "plan/planner.h"

namespace fasttree {
namespace {

struct SuiteTree {
  std::vector<int64_t> counts, lens;
  int hq, hkv;
  std::string name;
};

std::vector<int64_t> split_ints(const std::string& s) {
  std::vector<int64_t> out;
  std::istringstream in(s);
  for (int64_t v; in >> v;) out.push_back(v);
  return out;
}

std::vector<SuiteTree> load_suite() {
  std::ifstream f(std::string(FASTTREE_SOURCE_DIR) + "/bench/anchors/h200-paper-suite.csv");
  std::vector<SuiteTree> out;
  std::string line;
  std::getline(f, line);  // header
  while (std::getline(f, line)) {
    std::vector<std::string> cols;
    std::stringstream ss(line);
    for (std::string c; std::getline(ss, c, ',');) cols.push_back(c);
    if (cols.size() < 4) continue;
    SuiteTree t{split_ints(cols[0]), split_ints(cols[1]), std::stoi(cols[2]), std::stoi(cols[3]), ""};
    t.name = cols[0] + "|" + cols[1] + "|" + cols[2] + "/" + cols[3];
    out.push_back(t);
  }
  return out;
}

void bench_tree(benchmark::State& state, const KvTree& tree, AttnShape shape) {
  Planner planner;
  Plan plan;
  planner.build(tree, shape, plan);
  for (auto _ : state) {
    planner.build(tree, shape, plan);
    benchmark::DoNotOptimize(plan.items.data());
  }
  state.counters["queries"] = tree.num_queries();
  state.counters["nodes"] = tree.num_nodes();
  state.counters["items"] = plan.num_items();
}

void register_all() {
  for (const SuiteTree& s : load_suite()) {
    const KvTree tree = tree_from_levels(s.counts, s.lens);
    benchmark::RegisterBenchmark(("paper/" + s.name).c_str(), [tree, s](benchmark::State& st) {
      bench_tree(st, tree, AttnShape{s.hq, s.hkv, 128});
    })->Unit(benchmark::kMicrosecond);
  }
  RandomForestSpec spec;
  spec.min_roots = 4;
  spec.max_roots = 4;
  spec.max_depth = 6;
  spec.max_fanout = 4;
  spec.min_len = 16;
  spec.max_len = 512;
  spec.max_queries_per_leaf = 1;
  spec.internal_query_prob = 0.0;
  // Grow the forest until it holds at least 4096 queries, then keep exactly 4096.
  KvTree forest;
  for (uint64_t seed = 1; forest.num_queries() < 4096; ++seed) {
    spec.min_roots = spec.max_roots = static_cast<int>(4 * seed);
    forest = random_forest(spec, seed);
  }
  forest.query_node.resize(4096);
  benchmark::RegisterBenchmark("random_forest/4096q", [forest](benchmark::State& st) {
    bench_tree(st, forest, AttnShape{32, 8, 128});
  })->Unit(benchmark::kMicrosecond);
}

}  // namespace
}  // namespace fasttree

int main(int argc, char** argv) {
  fasttree::register_all();
  benchmark::Initialize(&argc, argv);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
