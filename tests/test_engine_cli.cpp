// `fasttree generate` end to end (the built binary): JSON lines of generated ids that match the
// engine's scheduler in-process (and transformers' greedy tokens when data/golden has a model),
// JSONL prompt files with per-line overrides, n-sample forks, and one-line errors for bad inputs.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "cli_path.h"
#include "cuda/backend.h"
#include "engine/cpu_model.h"
#include "engine/scheduler.h"
#include "engine/weights.h"

namespace fasttree {
namespace {

namespace fs = std::filesystem;

using RunResult = CliRun;

class CliGenerate : public CliFixture {
 protected:
  CliGenerate() : CliFixture("fasttree_cli_gen_") {}
  RunResult run(const std::string& args) const { return run_cli("", "generate --threads 2 " + args); }
  void expect_error(const std::string& args, const std::string& needle) const {
    const RunResult r = run(args);
    EXPECT_GT(r.exit_code, 0) << args;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << args << "\n" << r.err;
    EXPECT_NE(r.err.find(needle), std::string::npos) << args << "\nstderr: " << r.err;
    EXPECT_TRUE(r.out.empty()) << args << "\nstdout: " << r.out;
  }
  static std::vector<nlohmann::json> lines(const std::string& out) {
    std::vector<nlohmann::json> v;
    std::istringstream in(out);
    std::string line;
    while (std::getline(in, line)) v.push_back(nlohmann::json::parse(line));
    return v;
  }

};

// What the scheduler gives in-process for the preset "tiny" with --weights-seed 0.
std::vector<GenerationResult> in_process(const std::vector<GenerationRequest>& reqs) {
  CpuModelOptions mo;
  mo.num_threads = 2;
  CpuModel model(random_weights(model_preset("tiny"), 0), 512, mo);
  Scheduler s(model);
  for (const auto& r : reqs) s.submit(r);
  return s.run();
}

TEST_F(CliGenerate, PromptIdsGreedyMatchesTheEngine) {
  const RunResult r = run("--preset tiny --prompt-ids 1,2,3,4,5 --max-new-tokens 6");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const auto out = lines(r.out);
  ASSERT_EQ(out.size(), 1u);
  GenerationRequest req;
  req.prompt = {1, 2, 3, 4, 5};
  req.max_new_tokens = 6;
  const auto want = in_process({req});
  EXPECT_EQ(out[0]["id"], 0);
  EXPECT_EQ(out[0]["prompt_tokens"], 5);
  EXPECT_EQ(out[0]["output_ids"].get<std::vector<std::vector<int32_t>>>(), want[0].samples);
  // Per-request attention gives the same tokens.
  const RunResult pr = run("--preset tiny --prompt-ids 1,2,3,4,5 --max-new-tokens 6 --attention per-request");
  ASSERT_EQ(pr.exit_code, 0) << pr.err;
  EXPECT_EQ(pr.out, r.out);
}

TEST_F(CliGenerate, JsonlPromptsForksAndStats) {
  write("p.jsonl",
        "[10, 11, 12, 13]\n"
        "\n"
        "{\"prompt_ids\": [10, 11, 12, 14], \"max_new_tokens\": 3, \"n\": 2, \"temperature\": 0.8, \"seed\": 9}\r\n"
        "{\"prompt_ids\": [7], \"top_k\": 5, \"top_p\": 0.9, \"temperature\": 1.0}\n");
  const RunResult r = run("--preset tiny --prompts p.jsonl --max-new-tokens 4 --stats");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const auto out = lines(r.out);
  ASSERT_EQ(out.size(), 3u);
  std::vector<GenerationRequest> reqs(3);
  reqs[0].prompt = {10, 11, 12, 13};
  reqs[0].max_new_tokens = 4;
  reqs[1].prompt = {10, 11, 12, 14};
  reqs[1].max_new_tokens = 3;
  reqs[1].n = 2;
  reqs[1].sampling.temperature = 0.8f;
  reqs[1].sampling.seed = 9;
  reqs[2].prompt = {7};
  reqs[2].max_new_tokens = 4;
  reqs[2].sampling = {1.0f, 5, 0.9f, 0};
  const auto want = in_process(reqs);
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(out[i]["id"], static_cast<int>(i));
    EXPECT_EQ(out[i]["output_ids"].get<std::vector<std::vector<int32_t>>>(), want[i].samples) << i;
  }
  EXPECT_EQ(out[1]["output_ids"].size(), 2u);
  EXPECT_EQ(out[1]["cached_tokens"], 3);  // shares 3 prompt tokens with line 1
  EXPECT_NE(r.err.find("stats: {\"requests\":3"), std::string::npos) << r.err;
}

TEST_F(CliGenerate, GoldenModelFolderMatchesTransformers) {
  const std::string dir = std::string(FASTTREE_SOURCE_DIR) + "/data/golden/llama_tiny";
  if (!fs::exists(dir + "/golden.json"))
    GTEST_SKIP() << "no golden data: make it with scripts/make_golden.py on the GPU machine";
  std::ifstream f(dir + "/golden.json");
  const nlohmann::json g = nlohmann::json::parse(f);
  std::string jsonl;
  for (const auto& p : g["prompts"]) jsonl += p.dump() + "\n";
  write("p.jsonl", jsonl);
  const RunResult r = run("--model " + dir + " --prompts p.jsonl --max-new-tokens 8");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const auto out = lines(r.out);
  ASSERT_EQ(out.size(), g["greedy"].size());
  for (size_t i = 0; i < out.size(); ++i) EXPECT_EQ(out[i]["output_ids"][0], g["greedy"][i]) << "prompt " << i;
}

TEST_F(CliGenerate, BadInputsAreOneLineErrors) {
  if (cuda_device_count() == 0)  // with a device, --backend cuda runs (tests/test_engine_gpu.cpp)
    expect_error("--preset tiny --prompt-ids 1,2 --backend cuda",
                 cuda_backend_built() ? "no CUDA device is present" : "built without the CUDA backend");
  expect_error("--preset tiny --prompt-ids 1,2 --backend tpu", "--backend must be cpu or cuda");
  expect_error("--model no_such_dir --prompt-ids 1,2", "no_such_dir: no such folder");
  fs::create_directories(path("empty_model"));
  expect_error("--model empty_model --prompt-ids 1,2", "config.json");
  expect_error("--preset tiny --prompt-ids 1,256", "token 256");
  expect_error("--preset tiny --prompt-ids 1,x", "'x' is not a token id");
  expect_error("--preset tiny --prompt-ids 1,,2", "is not a token id");
  expect_error("--preset nope --prompt-ids 1", "unknown model preset 'nope'");
  expect_error("--preset tiny", "exactly one of --prompt-ids and --prompts");
  expect_error("--prompt-ids 1", "exactly one of --model DIR and --preset NAME");
  expect_error("--preset tiny --prompt-ids 1 --top-p 0", "top_p");
  expect_error("--preset tiny --prompt-ids 1 --temperature -1", "temperature");
  expect_error("--preset tiny --prompt-ids 1,2,3 --max-new-tokens 10 --kv-slots 8", "never");
  expect_error("--preset tiny --prompts missing.jsonl", "missing.jsonl");
  write("bad.jsonl", "[1, 2]\n[1, 2\n");
  expect_error("--preset tiny --prompts bad.jsonl", "bad.jsonl:2: not valid JSON");
  write("big.jsonl", "[1, 2]\n\n[3, 999]\n");
  expect_error("--preset tiny --prompts big.jsonl", "big.jsonl:3");
  write("obj.jsonl", "{\"ids\": [1]}\n");
  expect_error("--preset tiny --prompts obj.jsonl", "without \"prompt_ids\"");
  write("field.jsonl", "{\"prompt_ids\": [1], \"n\": 0}\n");
  expect_error("--preset tiny --prompts field.jsonl", "\"n\" must be an integer");
  write("str.jsonl", "[\"a\"]\n");
  expect_error("--preset tiny --prompts str.jsonl", "is not a token id");
  write("empty.jsonl", "\n\n");
  expect_error("--preset tiny --prompts empty.jsonl", "no prompts");
  expect_error("--preset tiny --prompt-ids 1 --stop-ids 1,q", "--stop-ids");
}

}  // namespace
}  // namespace fasttree
