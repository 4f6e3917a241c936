// fasttree generate: token-id generation with the engine (scheduler + model), one JSON line per
// request on stdout:
//   {"id": 0, "prompt_tokens": 5, "cached_tokens": 0, "output_ids": [[...n samples...]]}
// Prompts come from --prompt-ids 1,2,3 (one request) or --prompts FILE.jsonl: one request per
// non-empty line, either a JSON array of token ids or an object {"prompt_ids": [...]} that may
// override "max_new_tokens", "n", "temperature", "top_p", "top_k" and "seed" for that request.
// The model is a HF checkpoint folder (--model) or seeded random weights of a preset (--preset), on
// --backend cpu or cuda (engine/model_factory.h); --tp N splits the model over N GPUs (or N CPU ranks).
// Every bad input is a one-line error.
#include <algorithm>
#include <climits>
#include <cstdio>
#include <fstream>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "apps/commands.h"
#include "core/error.h"
#include "engine/model_factory.h"
#include "engine/scheduler.h"

namespace fasttree {

namespace {

struct GenerateCmd {
  std::string model_dir;
  std::string preset;
  uint64_t weights_seed = 0;
  std::string backend = "cpu";
  std::string prompt_ids;
  std::string prompts_file;
  int max_new_tokens = 16;
  float temperature = 0.0f;
  float top_p = 1.0f;
  int top_k = 0;
  uint64_t seed = 0;
  int n = 1;
  std::string stop_ids;
  std::string attention = "fasttree";
  int64_t kv_slots = 0;
  int max_running = 256;
  int64_t max_prefill_tokens = SchedulerOptions{}.max_prefill_tokens;
  int threads = 0;
  int tp = 1;
  bool stats = false;
};

// "1,2,3" -> ids; `what` names the option in errors.
std::vector<int32_t> parse_id_list(const std::string& text, const std::string& what) {
  std::vector<int32_t> ids;
  size_t pos = 0;
  FT_CHECK(!text.empty(), what + ": empty list");
  while (pos <= text.size()) {
    const size_t comma = text.find(',', pos);
    std::string item = text.substr(pos, comma == std::string::npos ? std::string::npos : comma - pos);
    const size_t b = item.find_first_not_of(" \t"), e = item.find_last_not_of(" \t");
    item = b == std::string::npos ? "" : item.substr(b, e - b + 1);
    size_t used = 0;
    long long v = 0;
    bool ok = !item.empty();
    if (ok) {
      try {
        v = std::stoll(item, &used);
      } catch (const std::exception&) {
        ok = false;
      }
    }
    FT_CHECK(ok && used == item.size() && v >= INT32_MIN && v <= INT32_MAX,
             what + ": '" + item + "' is not a token id");
    ids.push_back(static_cast<int32_t>(v));
    if (comma == std::string::npos) break;
    pos = comma + 1;
  }
  return ids;
}

GenerationRequest base_request(const GenerateCmd& c) {
  GenerationRequest r;
  r.max_new_tokens = c.max_new_tokens;
  r.n = c.n;
  r.sampling.temperature = c.temperature;
  r.sampling.top_p = c.top_p;
  r.sampling.top_k = c.top_k;
  r.sampling.seed = c.seed;
  if (!c.stop_ids.empty()) r.stop_tokens = parse_id_list(c.stop_ids, "--stop-ids");
  return r;
}

struct SourcedRequest {
  GenerationRequest request;
  std::string where;  // "--prompt-ids" or "FILE:LINE"
};

std::vector<SourcedRequest> read_prompts_file(const GenerateCmd& c) {
  std::ifstream f(c.prompts_file, std::ios::binary);
  FT_CHECK(f.good(), c.prompts_file + ": cannot open prompts file");
  std::vector<SourcedRequest> out;
  std::string line;
  int line_no = 0;
  while (std::getline(f, line)) {
    ++line_no;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.find_first_not_of(" \t") == std::string::npos) continue;
    const std::string where = c.prompts_file + ":" + std::to_string(line_no);
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(line);
    } catch (const nlohmann::json::exception&) {
      FT_FAIL(where + ": not valid JSON (want an array of token ids or {\"prompt_ids\": [...]})");
    }
    GenerationRequest r = base_request(c);
    const nlohmann::json* ids = &j;
    if (j.is_object()) {
      FT_CHECK(j.contains("prompt_ids"), where + ": object without \"prompt_ids\"");
      ids = &j["prompt_ids"];
      for (const auto& [key, value] : j.items()) {
        auto integer = [&](int64_t lo, int64_t hi) {
          FT_CHECK(value.is_number_integer() && value.get<int64_t>() >= lo && value.get<int64_t>() <= hi,
                   where + ": \"" + key + "\" must be an integer in [" + std::to_string(lo) + ", " + std::to_string(hi) +
                       "], got " + value.dump());
          return value.get<int64_t>();
        };
        auto number = [&] {
          FT_CHECK(value.is_number(), where + ": \"" + key + "\" must be a number, got " + value.dump());
          return value.get<float>();
        };
        if (key == "prompt_ids") continue;
        if (key == "max_new_tokens") r.max_new_tokens = static_cast<int>(integer(0, 1 << 30));
        else if (key == "n") r.n = static_cast<int>(integer(1, 1 << 20));
        else if (key == "top_k") r.sampling.top_k = static_cast<int>(integer(0, INT32_MAX));
        else if (key == "seed") r.sampling.seed = static_cast<uint64_t>(integer(0, INT64_MAX));
        else if (key == "temperature") r.sampling.temperature = number();
        else if (key == "top_p") r.sampling.top_p = number();
        else FT_FAIL(where + ": unknown field \"" + key + "\"");
      }
    }
    FT_CHECK(ids->is_array(), where + ": prompt must be an array of token ids, got " + ids->dump());
    for (const auto& t : *ids) {
      FT_CHECK(t.is_number_integer() && t.get<int64_t>() >= INT32_MIN && t.get<int64_t>() <= INT32_MAX,
               where + ": " + t.dump() + " is not a token id");
      r.prompt.push_back(static_cast<int32_t>(t.get<int64_t>()));
    }
    out.push_back({std::move(r), where});
  }
  FT_CHECK(!out.empty(), c.prompts_file + ": no prompts");
  return out;
}

void run_generate(GenerateCmd& c) {
  FT_CHECK(c.backend == "cpu" || c.backend == "cuda", "--backend must be cpu or cuda");
  FT_CHECK(c.model_dir.empty() != c.preset.empty(), "give exactly one of --model DIR and --preset NAME");
  FT_CHECK(c.prompt_ids.empty() != c.prompts_file.empty(), "give exactly one of --prompt-ids and --prompts FILE.jsonl");

  std::vector<SourcedRequest> requests;
  if (!c.prompt_ids.empty()) {
    GenerationRequest r = base_request(c);
    r.prompt = parse_id_list(c.prompt_ids, "--prompt-ids");
    requests.push_back({std::move(r), "--prompt-ids"});
  } else {
    requests = read_prompts_file(c);
  }

  int64_t slots = c.kv_slots;
  if (slots == 0) {  // room for every request at once
    for (const auto& r : requests)
      slots += static_cast<int64_t>(r.request.prompt.size()) +
               int64_t{std::max(1, r.request.n)} * std::max(0, r.request.max_new_tokens - 1);
    slots = std::max<int64_t>(slots, 1);
  }
  FT_CHECK(slots > 0 && slots <= INT32_MAX, "--kv-slots must be in [1, 2^31), got " + std::to_string(slots));
  ModelSpec spec;
  spec.model_dir = c.model_dir;
  spec.preset = c.preset;
  spec.weights_seed = c.weights_seed;
  spec.backend = c.backend;
  spec.kv_slots = slots;
  spec.threads = c.threads;
  spec.tp = c.tp;
  const std::unique_ptr<DecoderModel> model = make_model(spec);
  SchedulerOptions so;
  so.max_running = c.max_running;
  so.max_prefill_tokens = c.max_prefill_tokens;
  so.sharing = c.attention == "per-request" ? PathSharing::kPerRequest : PathSharing::kShared;
  so.planner = spec.planner;
  Scheduler scheduler(*model, so);
  for (auto& r : requests) {
    try {
      scheduler.submit(r.request);
    } catch (const Error& e) {
      FT_FAIL(r.where + ": " + e.message());
    }
  }
  for (const GenerationResult& res : scheduler.run()) {
    nlohmann::ordered_json j;
    j["id"] = res.id;
    j["prompt_tokens"] = res.prompt_tokens;
    j["cached_tokens"] = res.cached_tokens;
    j["output_ids"] = res.samples;
    std::printf("%s\n", j.dump().c_str());
  }
  std::fflush(stdout);
  if (c.stats) {
    const SchedulerStats& s = scheduler.stats();
    nlohmann::ordered_json j;
    j["requests"] = s.requests_finished;
    j["generated_tokens"] = s.generated_tokens;
    j["prompt_tokens"] = s.prompt_tokens;
    j["cached_prompt_tokens"] = s.cached_prompt_tokens;
    j["prefill_tokens"] = s.prefill_tokens;
    j["decode_steps"] = s.decode_steps;
    j["plans"] = s.plans;
    j["plan_extensions"] = s.plan_extensions;
    j["evicted_tokens"] = s.evicted_tokens;
    j["max_batch"] = s.max_batch;
    j["kv_slots"] = slots;
    std::fprintf(stderr, "stats: %s\n", j.dump().c_str());
  }
}

}  // namespace

void register_generate_command(CLI::App& app) {
  auto* cmd = app.add_subcommand("generate", "Generate token ids with the engine (JSON lines on stdout)");
  auto c = std::make_shared<GenerateCmd>();
  cmd->add_option("--model", c->model_dir, "HF checkpoint folder (config.json + *.safetensors)");
  cmd->add_option("--preset", c->preset, "Random weights of a named shape (tiny, llama2-7b, mistral-7b, llama3-8b)");
  cmd->add_option("--weights-seed", c->weights_seed, "Seed of the --preset random weights")->capture_default_str();
  cmd->add_option("--backend", c->backend, "cpu | cuda")->capture_default_str();
  cmd->add_option("--prompt-ids", c->prompt_ids, "One prompt as comma-separated token ids");
  cmd->add_option("--prompts", c->prompts_file,
                  "JSONL file: one prompt per line, [ids...] or {\"prompt_ids\": [...], \"max_new_tokens\": .., \"n\": .., "
                  "\"temperature\": .., \"top_p\": .., \"top_k\": .., \"seed\": ..}");
  cmd->add_option("--max-new-tokens", c->max_new_tokens, "Tokens to generate per sample")->check(CLI::Range(0, 1 << 30))->capture_default_str();
  cmd->add_option("--temperature", c->temperature, "0 = greedy")->capture_default_str();
  cmd->add_option("--top-p", c->top_p, "Nucleus sampling mass in (0, 1]")->capture_default_str();
  cmd->add_option("--top-k", c->top_k, "Keep the k most likely tokens (0 = off)")->capture_default_str();
  cmd->add_option("--seed", c->seed, "Sampling seed (sample i of a request uses seed + i)")->capture_default_str();
  cmd->add_option("--n", c->n, "Samples per prompt (they share the prompt's KV)")->check(CLI::Range(1, 1 << 20))->capture_default_str();
  cmd->add_option("--stop-ids", c->stop_ids, "Comma-separated token ids that end a sample (kept in its output)");
  cmd->add_option("--attention", c->attention, "fasttree | per-request (no sharing in decode attention)")
      ->check(CLI::IsMember({"fasttree", "per-request"}))
      ->capture_default_str();
  cmd->add_option("--kv-slots", c->kv_slots, "KV pool size in tokens (default: every request at once)");
  cmd->add_option("--max-running", c->max_running, "Sequences decoded together at most")->check(CLI::Range(1, 1 << 20))->capture_default_str();
  cmd->add_option("--max-prefill-tokens", c->max_prefill_tokens, "A batched prefill runs once admitted requests hold this many uncached tokens (1 = one request per prefill)")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 40))->capture_default_str();
  cmd->add_option("--threads", c->threads, "CPU threads (0 = all)")->check(CLI::Range(0, 4096))->capture_default_str();
  cmd->add_option("--tp", c->tp, "Tensor-parallel ranks: cuda = GPUs 0..N-1 (NCCL), cpu = threads groups")
      ->check(CLI::Range(1, 64))
      ->capture_default_str();
  cmd->add_flag("--stats", c->stats, "Print scheduler statistics as one JSON line on stderr");
  cmd->callback([c] { run_generate(*c); });
}

}  // namespace fasttree
