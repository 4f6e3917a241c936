// The fasttree CLI end to end: good runs produce correct files; every malformed input ends with a
// one-line error on stderr and a non-zero exit (never a crash or a signal).
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>

#include <fmt/format.h>

#include "cli_path.h"
#include "core/npy.h"
#include "core/tree_io.h"
#include "cpu/reference.h"
#include "cuda/backend.h"
#include "plan/plan.h"

namespace fasttree {
namespace {

namespace fs = std::filesystem;

using RunResult = CliRun;

class Cli : public CliFixture {
 protected:
  Cli() : CliFixture("fasttree_cli_") {}
  RunResult run(const std::string& args) const { return run_cli("", args); }
  // A failing run: non-zero exit (not a signal), exactly one line on stderr containing `needle`.
  void expect_error(const std::string& args, const std::string& needle) const {
    const RunResult r = run(args);
    EXPECT_GT(r.exit_code, 0) << args;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << args << "\n" << r.err;
    EXPECT_NE(r.err.find(needle), std::string::npos) << args << "\nstderr: " << r.err;
  }

};

TEST_F(Cli, AttentionMatchesReferenceOnGeneratedInputs) {
  ASSERT_EQ(run("gen-tree --random --seed 5 --depth 4 --fanout 3 --max-len 40 --explicit-slots --out t.json --tensors . "
                "--heads 8/2 --head-dim 64 --tensor-dtype f16").exit_code, 0);
  const RunResult r = run("attention --tree t.json --q q.npy --k k.npy --v v.npy --out o.npy --lse l.npy");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const KvTree tree = load_tree(path("t.json"));
  const HostTensor q = read_npy(path("q.npy")), k = read_npy(path("k.npy")), v = read_npy(path("v.npy"));
  const HostTensor o = read_npy(path("o.npy")), l = read_npy(path("l.npy"));
  const AttnShape shape{8, 2, 64};
  std::vector<float> ref(o.data.size()), ref_lse(l.data.size());
  reference_attention(tree, shape, q.data, k.data, v.data, shape.default_sm_scale(), ref, ref_lse);
  double err = 0, mx = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    err = std::max(err, static_cast<double>(std::fabs(ref[i] - o.data[i])));
    mx = std::max(mx, static_cast<double>(std::fabs(ref[i])));
  }
  EXPECT_LE(err, 1e-5 * std::max(1.0, mx));
  for (size_t i = 0; i < ref_lse.size(); ++i)
    if (std::isinf(ref_lse[i])) EXPECT_TRUE(std::isinf(l.data[i]));
    else EXPECT_NEAR(ref_lse[i], l.data[i], 1e-5 * std::max(1.0f, std::fabs(ref_lse[i])));
}

TEST_F(Cli, PlanPrintsSharingAndJson) {
  RunResult r = run("plan --levels 1,16,64 --lens 1024,256,32 --heads 32/8");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("virtual nodes: 81"), std::string::npos) << r.out;
  r = run("plan --levels 1,10 --lens 4000,400 --heads 32/32 --json");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("\"per_request_kv_tokens\": 44000"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("\"unique_kv_tokens\": 8000"), std::string::npos) << r.out;
}

TEST_F(Cli, CalibrationSearchRunsOnTheSuite) {
  // --model-cost scores plans without a GPU: exercises the suite loader, the grid and the output.
  const RunResult r = run("calibrate --model-cost --alphas 0.66 --betas 0.33 --gammas 0.1,300 --min-chunks 256 --waves 1 "
                          "--tile-sets '64,16;64,32,16' --fold-maxes 256 --fold-narrow 32 --flags-out flags.txt --csv cal.csv");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("4 configurations"), std::string::npos) << r.out;
  EXPECT_EQ(slurp("flags.txt").rfind("--alpha 0.66 --beta 0.33 --gamma ", 0), 0u) << slurp("flags.txt");
  const std::string csv = slurp("cal.csv");
  EXPECT_EQ(std::count(csv.begin(), csv.end(), '\n'), 5);
  EXPECT_EQ(csv.rfind("tile_rows,alpha,beta,gamma,min_chunk,split_waves,fold_max,fold_narrow_tokens,geomean_over_floor,", 0), 0u)
      << csv;
  // The tile set holds commas: quoted, so every row has the header's fields (10 + one geomean per head setting).
  EXPECT_NE(csv.find("\n\"64,32,16\",0.66,0.33,"), std::string::npos) << csv;
  EXPECT_NE(csv.find(",distinct_plans_timed,geomean_32/32,geomean_32/8,geomean_16/1\n"), std::string::npos) << csv;
  // Per head setting: its best configuration; then the suite at each setting's best and the per-cell oracle.
  for (const char* h : {"heads 32/32: best --alpha", "heads 32/8: best --alpha", "heads 16/1: best --alpha", "(oracle): "})
    EXPECT_NE(r.out.find(h), std::string::npos) << r.out;
  expect_error("calibrate --model-cost --alphas x", "--alphas");
  expect_error("calibrate --model-cost --fold-maxes 300", "--fold-maxes");
  expect_error("calibrate --model-cost --fold-narrow 1.5", "--fold-narrow");
  expect_error("calibrate --model-cost --min-gain 1", "--min-gain");
  expect_error("calibrate --model-cost --tile-sets '64,0'", "--tile-sets: rows must be in [1, 4096]");
  expect_error("calibrate --model-cost --tile-sets '64,16;'", "--tile-sets");
  expect_error("calibrate --model-cost --min-chunks 0", "--min-chunks");
  expect_error("calibrate --model-cost --waves 0", "--waves");
  // A rejected grid creates no CSV.
  expect_error("calibrate --model-cost --tile-sets 64.5 --csv rejected.csv", "--tile-sets");
  EXPECT_FALSE(std::filesystem::exists("rejected.csv"));
}

TEST_F(Cli, CalibrationKeepsDefaultsWithinMinGain) {
  // A grid that holds the planner's defaults (PlannerConfig) and other fold thresholds: with a
  // lead requirement no configuration can meet, --flags-out gets the defaults.
  const PlannerConfig d;
  const std::string grid = fmt::format(
      "calibrate --model-cost --alphas 0.33,{} --betas {} --gammas {} --min-chunks {} --waves {} --tile-sets 64,16 "
      "--fold-maxes 0,{} --fold-narrow {} --flags-out flags.txt --csv cal.csv",
      d.alpha, d.beta, d.gamma, d.min_chunk, d.split_waves, d.fold_max, d.fold_narrow_tokens);
  RunResult r = run(grid + " --min-gain 0.99");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("4 configurations"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("within 99.0 % of the best: kept"), std::string::npos) << r.out;
  EXPECT_EQ(slurp("flags.txt"), fmt::format("--alpha {} --beta {} --gamma {} --min-chunk {} --split-waves {} --tile-rows 64,16 "
                                            "--fold-max {} --fold-narrow-tokens {}\n",
                                            d.alpha, d.beta, d.gamma, d.min_chunk, d.split_waves, d.fold_max,
                                            d.fold_narrow_tokens));
  const std::string csv = slurp("cal.csv");
  EXPECT_NE(csv.find(",0," + std::to_string(d.fold_narrow_tokens) + ","), std::string::npos) << csv;  // fold_max 0 rows
}

TEST_F(Cli, MalformedTreesAndOptions) {
  write("bad_parent.json", R"({"nodes":[{"parent":-1,"len":4},{"parent":5,"len":2}]})");
  write("cycle.json", R"({"nodes":[{"parent":1,"len":4},{"parent":0,"len":2}]})");
  write("bad_query.json", R"({"nodes":[{"parent":-1,"len":4}],"queries":[3]})");
  write("dup_slot.json", R"({"nodes":[{"parent":-1,"len":2,"slots":[0,0]}]})");
  write("not_json.json", "{\"nodes\": [");
  write("short.txt", "3\n-1 0 10 1\n0 1 5 0\n");
  write("binary.txt", std::string("\x00\x01\xff\xfe", 4));
  expect_error("plan --tree bad_parent.json", "node 1");
  expect_error("plan --tree cycle.json", "cycle");
  expect_error("plan --tree bad_query.json", "query 0");
  expect_error("plan --tree dup_slot.json", "slot 0");
  expect_error("plan --tree not_json.json", "not_json.json");
  expect_error("plan --tree short.txt", "short.txt");
  expect_error("plan --tree binary.txt", "binary.txt");
  expect_error("plan --tree missing.json", "missing.json");
  expect_error("plan --levels 1,4 --lens 10", "lengths");
  expect_error("plan --levels 1,x --lens 1,2", "--levels");
  expect_error("plan --levels 1,4 --lens 10,5 --heads 32/5", "multiple");
  expect_error("plan --levels 1,4 --lens 10,5 --heads 0/0", "heads");
  expect_error("plan --levels 1,4 --lens 10,5 --alpha -1", "--alpha");
  expect_error("plan --levels 1,4 --lens 10,5 --tile-rows 0", "--tile-rows");
  expect_error("plan --levels 1,4 --lens 10,5 --narrow-max-path -1", "--narrow-max-path");
  expect_error("plan --levels 1,4 --lens 10,5 --narrow-max-waves -2", "--narrow-max-waves");
  expect_error("plan --levels 1,4 --lens 10,5 --narrow-split-max-waves -1", "--narrow-split-max-waves");
  expect_error("plan --levels 1,4 --lens 10,5 --mid-class-rows -3", "--mid-class-rows");
  expect_error("plan --levels 1,4 --lens 10,5 --narrow-rows 20", "--narrow-rows");
  expect_error("plan --levels 1,4 --lens 10,5 --narrow-wide-rows 48", "--narrow-wide-rows");
  expect_error("plan --levels 1,4 --lens 10,5 --narrow-wide-min-waves -1", "--narrow-wide-min-waves");
  expect_error("plan", "give a tree");
  expect_error("gen-tree --random --depth 0", "--depth");
  expect_error("bench --levels 1,4 --lens 10,5 --l2 flush", "--l2");  // parse errors come before any device use
  expect_error("calibrate --l2 none", "--l2");
  // Without a usable GPU (CI): one line naming the device error. With one these commands run the
  // whole suite (the GPU machine's bench runs cover that), so they are only checked without.
  if (cuda_device_count() == 0) {
    expect_error("bench --suite paper", "CUDA");
    expect_error("bench --suite paper --fasttree-only", "CUDA");  // a known flag: the same device error, not a parse error
  }
}

TEST_F(Cli, MalformedTensors) {
  ASSERT_EQ(run("gen-tree --levels 1,4 --lens 10,5 --out t.json --tensors . --heads 4/2 --head-dim 8").exit_code, 0);
  write("garbage.npy", "not an npy file at all");
  const std::string ok = "attention --tree t.json --q q.npy --k k.npy --v v.npy --out o.npy";
  EXPECT_EQ(run(ok).exit_code, 0);
  expect_error("attention --tree t.json --q k.npy --k k.npy --v v.npy --out o.npy", "query rows");
  expect_error("attention --tree t.json --q q.npy --k q.npy --v v.npy --out o.npy", "V must match K");
  expect_error("attention --tree t.json --q q.npy --k garbage.npy --v v.npy --out o.npy", "garbage.npy");
  expect_error("attention --tree t.json --q q.npy --k k.npy --v v.npy --out no/such/dir/o.npy", "o.npy");
  write("far.json", R"({"nodes":[{"parent":-1,"len":2},{"parent":0,"len":2,"slots":[100,101]},)"
                    R"({"parent":0,"len":1},{"parent":0,"len":1},{"parent":0,"len":1}]})");
  expect_error("attention --tree far.json --q q.npy --k k.npy --v v.npy --out o.npy", "slot 100");
  const std::string file = path("k.npy");
  const auto size = fs::file_size(file);
  fs::resize_file(file, size - 7);
  expect_error(ok, "k.npy");
}

}  // namespace
}  // namespace fasttree
