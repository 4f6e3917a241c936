// `fasttree bench-e2e` end to end (the built binary) on the CPU backend with the tiny preset and
// small-scale workloads: CSV rows and columns (header once when appending), JSON lines and the
// table, FastTree vs per-request greedy agreement (--check-steps: the CPU path is fp32, so every
// sample must agree exactly, no tie allowance needed), a KV pool that holds only one request at a
// time (runs in waves, no hang), and one-line errors for bad inputs. In process: the scheduler's
// logits observer (SchedulerOptions::on_token_logits) that the agreement check is built on. Every command runs under
// `timeout`, so a hang fails the test instead of stalling CI.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <tuple>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "cli_path.h"
#include "engine/cpu_model.h"
#include "engine/model_config.h"
#include "engine/sampler.h"
#include "engine/scheduler.h"
#include "engine/weights.h"
#include "engine/workloads.h"

namespace fasttree {
namespace {

namespace fs = std::filesystem;

using RunResult = CliRun;

using Row = std::map<std::string, std::string>;

class CliBenchE2e : public CliFixture {
 protected:
  CliBenchE2e() : CliFixture("fasttree_cli_e2e_") {}
  RunResult run(const std::string& args) const { return run_cli("timeout 120 ", "bench-e2e --threads 2 " + args); }
  void expect_error(const std::string& args, const std::string& needle) const {
    const RunResult r = run(args);
    EXPECT_GT(r.exit_code, 0) << args;
    EXPECT_NE(r.exit_code, 124) << args << ": timed out";
    const std::string last = last_line(r.err);
    EXPECT_EQ(last.rfind("fasttree: error: ", 0), 0u) << args << "\n" << r.err;
    EXPECT_NE(last.find(needle), std::string::npos) << args << "\nstderr: " << r.err;
  }
  static std::string last_line(const std::string& text) {
    std::string t = text;
    while (!t.empty() && t.back() == '\n') t.pop_back();
    const size_t nl = t.rfind('\n');
    return nl == std::string::npos ? t : t.substr(nl + 1);
  }
  static std::vector<nlohmann::json> json_lines(const std::string& out) {
    std::vector<nlohmann::json> v;
    std::istringstream in(out);
    std::string line;
    while (std::getline(in, line))
      if (!line.empty() && line[0] == '{') v.push_back(nlohmann::json::parse(line));
    return v;
  }
  // Header + rows of a CSV file, every row keyed by column.
  static std::pair<std::vector<std::string>, std::vector<Row>> read_csv(const std::string& text) {
    std::istringstream in(text);
    std::string line;
    std::vector<std::string> header;
    std::vector<Row> rows;
    auto split = [](const std::string& l) {
      std::vector<std::string> f;
      std::string cur;
      for (char ch : l) {
        if (ch == ',') {
          f.push_back(cur);
          cur.clear();
        } else {
          cur += ch;
        }
      }
      f.push_back(cur);
      return f;
    };
    if (std::getline(in, line)) header = split(line);
    while (std::getline(in, line)) {
      const auto f = split(line);
      EXPECT_EQ(f.size(), header.size()) << line;
      Row r;
      for (size_t i = 0; i < f.size() && i < header.size(); ++i) r[header[i]] = f[i];
      rows.push_back(r);
    }
    return {header, rows};
  }

};

// The CPU backend, the tiny preset, no progress bar.
const std::string kTiny = "--backend cpu --preset tiny --no-progress ";

// What --scale small gives for the tiny preset (vocab 256).
WorkloadStats small_stats(const std::string& name, int max_new_tokens) {
  WorkloadSpec s;
  s.name = name;
  s.vocab_size = model_preset("tiny").vocab_size;
  s.max_new_tokens = max_new_tokens;
  s.scale = 0.125;
  s.length_scale = 0.0625;
  const auto reqs = make_workload(s);
  return workload_stats(reqs);
}

// The observer sees, for every generated token of every sample, exactly once and in order, the
// logits that token is the argmax of; with it the scheduler takes logits instead of the greedy path
// and the outputs stay the same, for both attentions.
TEST(SchedulerLogitsObserver, SeesEveryTokensLogitsOnce) {
  WorkloadSpec ws;
  ws.name = "C";  // n = 2 forks per request at this scale
  ws.vocab_size = 256;
  ws.max_new_tokens = 5;
  ws.scale = 0.125;
  ws.length_scale = 0.0625;
  const auto reqs = make_workload(ws);
  CpuModelOptions mo;
  mo.num_threads = 2;
  CpuModel model(random_weights(model_preset("tiny"), 3), 512, mo);
  for (PathSharing sharing : {PathSharing::kShared, PathSharing::kPerRequest}) {
    SchedulerOptions plain;
    plain.sharing = sharing;
    std::vector<GenerationResult> want;
    {
      Scheduler s(model, plain);
      for (const auto& r : reqs) s.submit(r);
      want = s.run();
    }
    std::map<std::tuple<int64_t, int, int64_t>, int32_t> seen;  // (request, sample, index) -> argmax
    SchedulerOptions observed = plain;
    observed.on_token_logits = [&](const TokenLogits& t) {
      ASSERT_EQ(t.logits.size(), 256u);
      const auto key = std::make_tuple(t.request_id, t.sample, t.index);
      EXPECT_EQ(seen.count(key), 0u) << "seen twice";
      seen[key] = greedy_token(t.logits);
    };
    Scheduler s(model, observed);
    for (const auto& r : reqs) s.submit(r);
    const auto got = s.run();
    ASSERT_EQ(got.size(), want.size());
    size_t tokens = 0;
    for (size_t i = 0; i < got.size(); ++i) {
      EXPECT_EQ(got[i].samples, want[i].samples) << i;
      ASSERT_EQ(got[i].samples.size(), 2u);
      for (int k = 0; k < 2; ++k)
        for (size_t j = 0; j < got[i].samples[k].size(); ++j) {
          const auto it = seen.find({static_cast<int64_t>(i), k, static_cast<int64_t>(j)});
          ASSERT_NE(it, seen.end()) << i << " " << k << " " << j;
          EXPECT_EQ(it->second, got[i].samples[k][j]);
          ++tokens;
        }
    }
    EXPECT_EQ(seen.size(), tokens);
    EXPECT_EQ(tokens, reqs.size() * 2 * 5);
  }
}

TEST_F(CliBenchE2e, AllWorkloadsBothAttentionsCsvJsonTable) {
  const RunResult r = run(kTiny + "--workload A,B,C,D --scale small --max-new-tokens 4 --csv out.csv --commit abc123");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const auto [header, rows] = read_csv(slurp("out.csv"));
  for (const char* col : {"workload", "preset", "attention", "requests", "generated_tokens", "seconds", "tokens_per_s",
                          "decode_step_ms", "attention_ms", "commit", "backend", "decode_steps", "mean_batch", "gemm_ms",
                          "other_ms", "plan_ms_per_step", "prefill_s", "cache_hit_rate", "floor_step_ms", "step_vs_floor"})
    EXPECT_NE(std::find(header.begin(), header.end(), col), header.end()) << col;
  ASSERT_EQ(rows.size(), 8u);
  std::map<std::string, double> unique_kv;
  for (size_t i = 0; i < rows.size(); ++i) {
    const Row& row = rows[i];
    const std::string wl = std::string(1, "ABCD"[i / 2]);
    const WorkloadStats s = small_stats(wl, 4);
    EXPECT_EQ(row.at("workload"), wl);
    EXPECT_EQ(row.at("attention"), i % 2 == 0 ? "fasttree" : "per-request");
    EXPECT_EQ(row.at("preset"), "tiny");
    EXPECT_EQ(row.at("backend"), "cpu");
    EXPECT_EQ(row.at("commit"), "abc123");
    EXPECT_EQ(std::stoll(row.at("requests")), s.requests) << wl;
    EXPECT_EQ(std::stoll(row.at("sequences")), s.sequences) << wl;
    EXPECT_EQ(std::stoll(row.at("generated_tokens")), s.sequences * 4) << wl;
    // One wave: the first token comes from the prefill, then 3 decode steps of every sequence.
    EXPECT_EQ(std::stoll(row.at("decode_steps")), 3) << wl;
    EXPECT_DOUBLE_EQ(std::stod(row.at("mean_batch")), static_cast<double>(s.sequences)) << wl;
    EXPECT_GT(std::stod(row.at("tokens_per_s")), 0.0) << wl;
    EXPECT_GT(std::stod(row.at("seconds")), 0.0) << wl;
    EXPECT_GT(std::stod(row.at("decode_step_ms")), 0.0) << wl;
    EXPECT_GT(std::stod(row.at("floor_step_ms")), 0.0) << wl;
    EXPECT_GT(std::stod(row.at("cache_hit_rate")), 0.0) << wl;  // every workload shares prompts
    EXPECT_EQ(row.at("attention_ms"), "") << "the CPU model has no device timings";
    EXPECT_EQ(row.at("profiled_steps"), "0");
    EXPECT_EQ(std::stoll(row.at("prefill_tokens")), s.unique_prompt_tokens) << wl;  // each shared token computed once
    EXPECT_EQ(std::stoll(row.at("kv_slots")), std::max({small_stats("A", 4).kv_slots_all_at_once(),
                                                        small_stats("B", 4).kv_slots_all_at_once(),
                                                        small_stats("C", 4).kv_slots_all_at_once(),
                                                        small_stats("D", 4).kv_slots_all_at_once()}));
    // The floor counts distinct KV tokens: the same for both attentions (per-request repeats them).
    const double u = std::stod(row.at("unique_kv_tokens"));
    // Mean over the 3 steps of unique prompt tokens + generated tails (1, 2, 3 tokens per sequence).
    EXPECT_DOUBLE_EQ(u, static_cast<double>(s.unique_prompt_tokens + 2 * s.sequences)) << wl;
    if (i % 2 == 0) unique_kv[wl] = u;
    else EXPECT_EQ(unique_kv[wl], u) << wl;
  }
  const auto js = json_lines(r.out);
  ASSERT_EQ(js.size(), 8u);
  EXPECT_EQ(js[0]["workload"], "A");
  EXPECT_EQ(js[0]["attention"], "fasttree");
  EXPECT_EQ(js[7]["workload"], "D");
  EXPECT_GT(js[7]["tokens_per_s"].get<double>(), 0.0);
  for (const char* wl : {"A", "B", "C", "D"})
    EXPECT_NE(r.out.find(std::string("speedup ") + wl + " tiny: fasttree"), std::string::npos) << r.out;
  EXPECT_NE(r.err.find("workload A (multi-level system prompt)"), std::string::npos) << r.err;

  // Appending: header once, rows added.
  const RunResult again = run("--backend cpu --preset tiny --workload b --attention per-request --scale small --max-new-tokens 2 --csv out.csv --progress --warmup-tokens 0");
  ASSERT_EQ(again.exit_code, 0) << again.err;
  EXPECT_NE(again.err.find("B tiny per-request ["), std::string::npos) << again.err;  // the progress bar
  EXPECT_NE(again.err.find("tok/s  batch 4"), std::string::npos) << again.err;
  EXPECT_EQ(r.err.find("tok/s  batch"), std::string::npos) << "--no-progress";
  const std::string text = slurp("out.csv");
  EXPECT_EQ(std::count(text.begin(), text.end(), '\n'), 10);
  const auto [h2, rows2] = read_csv(text);
  ASSERT_EQ(rows2.size(), 9u);
  EXPECT_EQ(rows2[8].at("workload"), "B");
  EXPECT_EQ(rows2[8].at("attention"), "per-request");
  EXPECT_EQ(rows2[8].at("max_new_tokens"), "2");
  EXPECT_EQ(std::stoll(rows2[8].at("decode_steps")), 1);
}

TEST_F(CliBenchE2e, FastTreeAndPerRequestAgreeOnTheCpu) {
  const RunResult r = run(kTiny + "--workload A,B,C,D --scale small --check-steps 5 --check-only");
  ASSERT_EQ(r.exit_code, 0) << r.err << r.out;
  const auto js = json_lines(r.out);
  ASSERT_EQ(js.size(), 4u) << r.out;
  for (size_t i = 0; i < 4; ++i) {
    const std::string wl(1, "ABCD"[i]);
    EXPECT_EQ(js[i]["check"], "greedy-agreement");
    EXPECT_EQ(js[i]["workload"], wl);
    EXPECT_EQ(js[i]["tokens"], 5);
    EXPECT_EQ(js[i]["sequences"].get<int64_t>(), small_stats(wl, 5).sequences);
    EXPECT_EQ(js[i]["agree"], js[i]["sequences"]) << js[i].dump();  // fp32: exact agreement
    EXPECT_EQ(js[i]["ties"], 0);
    EXPECT_EQ(js[i]["mismatches"], 0);
    EXPECT_GT(js[i]["min_fasttree_margin"].get<double>(), 0.0);
  }
  EXPECT_NE(r.out.find("sequences agree on all 5 greedy tokens"), std::string::npos) << r.out;
  EXPECT_TRUE(fs::exists(path("stdout.txt")));
  // --check-steps then the throughput runs in one command.
  const RunResult both = run(kTiny + "--workload C --scale small --max-new-tokens 3 --check-steps 2 --attention fasttree");
  ASSERT_EQ(both.exit_code, 0) << both.err;
  const auto j2 = json_lines(both.out);
  ASSERT_EQ(j2.size(), 2u);
  EXPECT_EQ(j2[0]["check"], "greedy-agreement");
  EXPECT_EQ(j2[1]["attention"], "fasttree");
  EXPECT_EQ(j2[1]["generated_tokens"].get<int64_t>(), small_stats("C", 3).sequences * 3);
}

// On a machine with the CUDA backend and a GPU: bf16 FastTree vs per-request greedy tokens agree
// up to bf16 ties (the command fails on a divergence beyond --tie-tol).
TEST_F(CliBenchE2e, GpuFastTreeAndPerRequestAgreeUpToTies) {
  const RunResult r = run("--backend cuda --preset tiny --no-progress --workload A,B,C,D --scale small --check-steps 8 --check-only");
  if (r.exit_code != 0 && (r.err.find("built without the CUDA backend") != std::string::npos ||
                           r.err.find("no CUDA device") != std::string::npos))
    GTEST_SKIP() << "no CUDA backend or device";
  ASSERT_EQ(r.exit_code, 0) << r.err << r.out;
  const auto js = json_lines(r.out);
  ASSERT_EQ(js.size(), 4u) << r.out;
  for (const auto& j : js) {
    EXPECT_EQ(j["mismatches"], 0) << j.dump();
    EXPECT_EQ(j["agree"].get<int64_t>() + j["ties"].get<int64_t>(), j["sequences"].get<int64_t>()) << j.dump();
  }
}

TEST_F(CliBenchE2e, PoolForOneRequestRunsInWaves) {
  // Exactly one request fits at a time (prompt + 3 slots); the 32 requests of A run one by one.
  const WorkloadStats s = small_stats("A", 4);
  const RunResult r = run(kTiny + "--workload A --scale small --max-new-tokens 4 --attention fasttree --kv-slots " +
                          std::to_string(s.max_request_slots));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const auto js = json_lines(r.out);
  ASSERT_EQ(js.size(), 1u);
  EXPECT_EQ(js[0]["generated_tokens"].get<int64_t>(), s.sequences * 4);
  EXPECT_EQ(js[0]["requests"].get<int64_t>(), 32);
  EXPECT_DOUBLE_EQ(js[0]["mean_batch"].get<double>(), 1.0);
  EXPECT_EQ(js[0]["decode_steps"].get<int64_t>(), 32 * 3);
}

TEST_F(CliBenchE2e, DryRunDescribesTheFullWorkloadsWithoutAModel) {
  const RunResult r = run("--preset llama2-7b,mistral-7b --backend cuda --dry-run");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_TRUE(r.out.empty()) << r.out;
  // The largest workload is A: 39396 unique prompt tokens + 512 x 256 generated; 0.5 MiB per token
  // for llama2-7b (32 layers x K,V x 32 heads x 128 x bf16), 128 KiB for mistral-7b (8 KV heads).
  EXPECT_NE(r.err.find("llama2-7b on cuda: KV pool 170468 slots (83.24 GiB in bf16)"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("mistral-7b on cuda: KV pool 170468 slots (20.81 GiB in bf16)"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("workload D (multi-document QA): 16 x document 1 1100+-50 -> document 2 1100+-50"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("512 requests, 512 sequences, 1667584 prompt tokens (39396 unique"), std::string::npos) << r.err;
}

TEST_F(CliBenchE2e, BadInputsAreOneLineErrors) {
  expect_error(kTiny + "--workload E --scale small", "unknown workload 'E'");
  expect_error(kTiny + "--workload A,,B --scale small", "--workload: empty item");
  expect_error(kTiny + "--workload A --scale 2", "--scale must be full, small or a number in (0, 1]");
  expect_error(kTiny + "--workload A --scale tiny", "--scale must be");
  expect_error(kTiny + "--workload A --scale small --length-scale 0", "--length-scale must be in (0, 1]");
  expect_error(kTiny + "--workload A --scale small --kv-slots 10", "--kv-slots 10 cannot hold one request of workload A");
  expect_error("--preset tiny --workload A --scale small --backend tpu", "--backend must be cpu or cuda");
  expect_error(kTiny + "--workload A --scale small --check-only", "--check-only needs --check-steps");
  expect_error(kTiny + "--workload A --scale small --max-new-tokens 4 --check-steps 5", "--check-steps 5 must be at most --max-new-tokens 4");
  expect_error("--backend cpu --preset tiny --workload A --scale small --model some_dir", "exactly one of --model");
  expect_error("--backend cpu --preset tiny --workload A --scale small --progress --no-progress", "at most one of --progress");
  std::ofstream(path("other.csv")) << "a,b,c\n1,2,3\n";
  expect_error(kTiny + "--workload A --scale small --max-new-tokens 2 --csv other.csv", "other.csv: existing CSV has other columns");
  EXPECT_EQ(slurp("other.csv"), "a,b,c\n1,2,3\n");
  // The cuda backend is refused by the model factory on a build without it (or runs on a GPU build).
  const RunResult cuda = run("--preset tiny --no-progress --workload A --scale small --max-new-tokens 2 --backend cuda --attention fasttree");
  EXPECT_NE(cuda.exit_code, 124);
  if (cuda.exit_code != 0) EXPECT_EQ(last_line(cuda.err).rfind("fasttree: error: ", 0), 0u) << cuda.err;
  // CLI11 rejects values outside the option's set.
  const RunResult att = run(kTiny + "--workload A --attention neither");
  EXPECT_GT(att.exit_code, 0);
}

}  // namespace
}  // namespace fasttree
