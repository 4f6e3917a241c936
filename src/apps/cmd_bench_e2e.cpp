// fasttree bench-e2e: end-to-end decode throughput of the engine on the paper's workloads A-D
// (engine/workloads.h), FastTree attention vs the per-request baseline in the same engine.
//
//   fasttree bench-e2e --workload A,B,C,D --preset llama2-7b,mistral-7b --attention both \
//       --csv bench/results/h200-e2e.csv --commit $(git rev-parse --short HEAD)
//
// For every model x workload x attention it runs the whole workload (every request submitted at
// once, continuous batching up to --max-running sequences, greedy, no early stop) and reports
// throughput (generated tokens / wall seconds of prefill + decode), the mean decode step split
// into attention / GEMMs / rest (device timings of every --profile-every-th step), planner time
// per step, prefix-cache hit rate and the step's H200 floor (apps/e2e_run.h): a human table and a
// one-line JSON object per run on stdout, CSV rows appended to --csv. One model instance serves
// all workloads and attentions of a preset; its KV pool (--kv-slots, default: the largest
// workload at once) is reused run after run. Each measured run starts from an empty prefix cache
// (its prefill is part of the measurement) and follows an unmeasured warm-up run of the same
// workload for --warmup-tokens tokens.
//
// --check-steps K first runs each workload for K tokens with both attentions, taking logits, and
// compares the greedy tokens sample by sample (apps/e2e_run.h check_greedy_agreement); divergences
// beyond the bf16 tie tolerance (--tie-tol) make the command fail after its report.
// Every bad input is a one-line error with a non-zero exit.
#include <algorithm>
#include <cctype>
#include <climits>
#include <cstdio>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "apps/cli_common.h"
#include "apps/commands.h"
#include "apps/e2e_report.h"
#include "apps/e2e_run.h"
#include "apps/progress_bar.h"
#include "core/error.h"
#include "engine/model_config.h"
#include "engine/model_factory.h"
#include "engine/tp_gpu_model.h"
#include "engine/workloads.h"

namespace fasttree {

namespace {

struct BenchE2eCmd {
  std::string workloads = "A,B,C,D";
  std::string presets;
  std::string model_dir;
  std::string backend = "cuda";
  std::string attention = "both";
  int max_new_tokens = 256;
  std::string scale = "full";
  std::optional<double> length_scale;  // default: from --scale
  uint64_t seed = 0;
  uint64_t weights_seed = 0;
  int max_running = 256;
  int64_t max_prefill_tokens = SchedulerOptions{}.max_prefill_tokens;
  int64_t kv_slots = 0;
  int tp = 1;
  int threads = 0;
  std::string csv;
  std::string commit;
  bool progress = false;
  bool no_progress = false;
  int profile_every = 8;
  int warmup_tokens = 2;
  int check_steps = 0;
  bool check_only = false;
  bool dry_run = false;
  double tie_tol = 0.02;
  PlannerOptions planner;
};

std::vector<std::string> split_list(const std::string& text, const std::string& what) {
  std::vector<std::string> out;
  size_t pos = 0;
  while (true) {
    const size_t comma = text.find(',', pos);
    std::string item = text.substr(pos, comma == std::string::npos ? std::string::npos : comma - pos);
    const size_t b = item.find_first_not_of(" \t"), e = item.find_last_not_of(" \t");
    item = b == std::string::npos ? "" : item.substr(b, e - b + 1);
    FT_CHECK(!item.empty(), what + ": empty item in '" + text + "'");
    out.push_back(item);
    if (comma == std::string::npos) break;
    pos = comma + 1;
  }
  return out;
}

// --scale full | small | F in (0, 1] -> (fan-out scale, length scale).
std::pair<double, double> parse_scale(const std::string& s, std::optional<double> length_scale) {
  double fan = 1.0, len = 1.0;
  if (s == "full") {
  } else if (s == "small") {
    fan = 0.125;
    len = 0.0625;
  } else {
    size_t used = 0;
    bool ok = !s.empty();
    try {
      if (ok) fan = std::stod(s, &used);
    } catch (const std::exception&) {
      ok = false;
    }
    FT_CHECK(ok && used == s.size() && fan > 0.0 && fan <= 1.0,
             "--scale must be full, small or a number in (0, 1], got '" + s + "'");
  }
  if (length_scale) {
    FT_CHECK(*length_scale > 0.0 && *length_scale <= 1.0, "--length-scale must be in (0, 1], got " + fmt::format("{}", *length_scale));
    len = *length_scale;
  }
  return {fan, len};
}

std::string default_commit() {
  std::FILE* p = ::popen("git rev-parse --short HEAD 2>/dev/null", "r");
  if (p == nullptr) return "unknown";
  char buf[64] = {};
  const bool got = std::fgets(buf, sizeof(buf), p) != nullptr;
  ::pclose(p);
  std::string s = got ? buf : "";
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.pop_back();
  return s.empty() ? "unknown" : s;
}

struct PreparedWorkload {
  std::string name;
  WorkloadShape shape;
  std::vector<GenerationRequest> requests;
  WorkloadStats stats;
};

void run_bench_e2e(BenchE2eCmd& c) {
  FT_CHECK(c.backend == "cpu" || c.backend == "cuda", "--backend must be cpu or cuda, got '" + c.backend + "'");
  FT_CHECK(c.model_dir.empty() != c.presets.empty(), "give exactly one of --model DIR and --preset NAME[,NAME...]");
  FT_CHECK(!(c.progress && c.no_progress), "give at most one of --progress and --no-progress");
  FT_CHECK(!c.check_only || c.check_steps > 0, "--check-only needs --check-steps K > 0");
  FT_CHECK(c.check_steps <= c.max_new_tokens, "--check-steps " + std::to_string(c.check_steps) +
                                                 " must be at most --max-new-tokens " + std::to_string(c.max_new_tokens));
  FT_CHECK(c.kv_slots >= 0 && c.kv_slots <= INT32_MAX, "--kv-slots must be in [0, 2^31), got " + std::to_string(c.kv_slots));
  const auto [scale, length_scale] = parse_scale(c.scale, c.length_scale);
  std::vector<std::string> attentions;
  if (c.attention == "both") attentions = {"fasttree", "per-request"};
  else attentions = {c.attention};
  std::vector<std::string> workload_list = split_list(c.workloads, "--workload");
  for (std::string& w : workload_list)
    for (char& ch : w) ch = static_cast<char>(std::toupper(static_cast<unsigned char>(ch)));
  const std::vector<std::string> models = c.presets.empty() ? std::vector<std::string>{c.model_dir} : split_list(c.presets, "--preset");
  if (c.commit.empty()) c.commit = default_commit();
  const bool progress = c.progress || (!c.no_progress && stderr_is_tty());
  const PlannerConfig planner = make_planner_config(c.planner, engine_planner_config());

  std::vector<E2eRecord> records;
  int64_t mismatches = 0;
  for (const std::string& model_name : models) {
    const ModelConfig config = c.presets.empty() ? load_model_config(model_name) : model_preset(model_name);
    std::string label = model_name;
    if (c.presets.empty()) {  // a checkpoint folder: its last path component
      while (label.size() > 1 && label.back() == '/') label.pop_back();
      label = label.substr(label.find_last_of('/') == std::string::npos ? 0 : label.find_last_of('/') + 1);
    }
    std::vector<PreparedWorkload> work;
    int64_t need_all = 1;
    for (const std::string& name : workload_list) {
      WorkloadSpec spec;
      spec.name = name;
      spec.vocab_size = config.vocab_size;
      spec.seed = c.seed;
      spec.max_new_tokens = c.max_new_tokens;
      spec.scale = scale;
      spec.length_scale = length_scale;
      PreparedWorkload p{name, workload_shape(spec), make_workload(spec), {}};
      p.stats = workload_stats(p.requests);
      need_all = std::max(need_all, p.stats.kv_slots_all_at_once());
      work.push_back(std::move(p));
    }
    const int64_t slots = c.kv_slots > 0 ? c.kv_slots : need_all;
    FT_CHECK(slots <= INT32_MAX, "workloads need " + std::to_string(slots) + " KV slots, more than 2^31 - 1");
    const double kv_gib = static_cast<double>(slots) * kv_bytes_per_token_bf16(config) / (1024.0 * 1024.0 * 1024.0);
    for (const PreparedWorkload& p : work) {
      FT_CHECK(p.stats.max_request_slots <= slots,
               "--kv-slots " + std::to_string(slots) + " cannot hold one request of workload " + p.name + ": it needs " +
                   std::to_string(p.stats.max_request_slots) + " (prompt + n x (max_new_tokens - 1))");
      std::fprintf(stderr,
                   "bench-e2e: %s workload %s (%s): %s; %lld requests, %lld sequences, %lld prompt tokens (%lld unique, "
                   "x%.1f shared), %lld tokens to generate\n",
                   label.c_str(), p.name.c_str(), p.shape.title.c_str(), p.shape.describe().c_str(),
                   static_cast<long long>(p.stats.requests), static_cast<long long>(p.stats.sequences),
                   static_cast<long long>(p.stats.prompt_tokens), static_cast<long long>(p.stats.unique_prompt_tokens),
                   p.stats.sharing(), static_cast<long long>(p.stats.generated_tokens));
    }
    std::fprintf(stderr, "bench-e2e: %s on %s: KV pool %lld slots (%.2f GiB in bf16), weights %.2f GB in bf16\n", label.c_str(),
                 c.backend.c_str(), static_cast<long long>(slots), kv_gib, weight_bytes_bf16(config) / 1e9);
    if (c.dry_run) continue;

    ModelSpec ms;
    if (c.presets.empty()) ms.model_dir = model_name;
    else ms.preset = model_name;
    ms.weights_seed = c.weights_seed;
    ms.backend = c.backend;
    ms.kv_slots = slots;
    ms.threads = c.threads;
    ms.tp = c.tp;
    ms.planner = planner;
    const std::unique_ptr<DecoderModel> model = make_model(ms);
    if (const auto* tpm = dynamic_cast<const TpGpuModel*>(model.get())) {
      std::printf("%s tp %d all-reduce: %s\n", label.c_str(), c.tp, tpm->all_reduce_path().c_str());
      std::fflush(stdout);
    }
    SchedulerOptions base;
    base.max_running = c.max_running;
    base.max_prefill_tokens = c.max_prefill_tokens;
    base.planner = planner;

    for (const PreparedWorkload& p : work) {
      if (c.check_steps > 0) {
        std::vector<GenerationRequest> short_reqs = p.requests;
        for (GenerationRequest& r : short_reqs) r.max_new_tokens = c.check_steps;
        const AgreementCheck check = check_greedy_agreement(*model, short_reqs, base, c.tie_tol);
        mismatches += check.mismatches;
        std::fputs(agreement_text(p.name, label, check).c_str(), stdout);
        std::printf("%s\n", agreement_json(p.name, label, check).dump().c_str());
        std::fflush(stdout);
      }
      if (c.check_only) continue;
      for (const std::string& att : attentions) {
        E2eRunOptions ro;
        ro.scheduler = base;
        ro.scheduler.sharing = att == "per-request" ? PathSharing::kPerRequest : PathSharing::kShared;
        ro.profile_every = c.profile_every;
        ro.progress = progress;
        ro.label = p.name + " " + label + " " + att;
        E2eRecord rec;
        rec.workload = p.name;
        rec.preset = label;
        rec.backend = c.backend;
        rec.attention = att;
        rec.max_new_tokens = c.max_new_tokens;
        rec.scale = scale;
        rec.length_scale = length_scale;
        rec.kv_slots = slots;
        rec.tp = c.tp;
        rec.profile_every = c.profile_every;
        rec.commit = c.commit;
        if (c.warmup_tokens > 0) {  // unmeasured: first launches, cuBLAS/graph setup, the batch's shapes
          std::vector<GenerationRequest> warm = p.requests;
          for (GenerationRequest& r : warm) r.max_new_tokens = std::min(r.max_new_tokens, c.warmup_tokens);
          E2eRunOptions wo = ro;
          wo.progress = false;
          wo.profile_every = 0;
          run_e2e(*model, warm, wo);
        }
        rec.m = run_e2e(*model, p.requests, ro);
        if (!c.csv.empty()) append_e2e_csv(c.csv, {rec});
        std::printf("%s\n", e2e_json(rec).dump().c_str());
        std::fflush(stdout);
        records.push_back(std::move(rec));
      }
    }
  }
  if (!records.empty()) {
    std::fputs(e2e_table(records).c_str(), stdout);
    std::fflush(stdout);
  }
  FT_CHECK(mismatches == 0, "check: " + std::to_string(mismatches) +
                                " sequences diverge between fasttree and per-request beyond the tie tolerance");
}

}  // namespace

void register_bench_e2e_command(CLI::App& app) {
  auto* cmd = app.add_subcommand("bench-e2e", "End-to-end decode throughput on the paper's workloads A-D (FastTree vs per-request)");
  auto c = std::make_shared<BenchE2eCmd>();
  cmd->add_option("--workload", c->workloads, "Workloads, e.g. A or A,B,C,D (engine/workloads.h)")->capture_default_str();
  cmd->add_option("--preset", c->presets, "Random weights of named shapes, e.g. llama2-7b or llama2-7b,mistral-7b");
  cmd->add_option("--model", c->model_dir, "HF checkpoint folder (config.json + *.safetensors)");
  cmd->add_option("--weights-seed", c->weights_seed, "Seed of the --preset random weights")->capture_default_str();
  cmd->add_option("--backend", c->backend, "cpu | cuda")->capture_default_str();
  cmd->add_option("--attention", c->attention, "fasttree | per-request | both")
      ->check(CLI::IsMember({"fasttree", "per-request", "both"}))
      ->capture_default_str();
  cmd->add_option("--max-new-tokens", c->max_new_tokens, "Tokens generated per sequence (no early stop)")
      ->check(CLI::Range(1, 1 << 20))
      ->capture_default_str();
  cmd->add_option("--scale", c->scale, "full | small (fan-outs x1/8, lengths x1/16) | F: fan-outs x F, F in (0, 1]")
      ->capture_default_str();
  cmd->add_option("--length-scale", c->length_scale, "Token lengths x this, in (0, 1] (default: from --scale)");
  cmd->add_option("--seed", c->seed, "Seed of the workloads' synthetic token ids")->capture_default_str();
  cmd->add_option("--max-running", c->max_running, "Sequences decoded together at most")->check(CLI::Range(1, 1 << 20))->capture_default_str();
  cmd->add_option("--max-prefill-tokens", c->max_prefill_tokens, "A batched prefill runs once admitted requests hold this many uncached tokens (1 = one request per prefill)")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 40))->capture_default_str();
  cmd->add_option("--kv-slots", c->kv_slots, "KV pool size in tokens (default: the largest workload at once)");
  cmd->add_option("--tp", c->tp, "Tensor-parallel ranks: cuda = GPUs 0..N-1 through NCCL (cpu: TpCpuModel)")
      ->check(CLI::Range(1, 64))
      ->capture_default_str();
  cmd->add_option("--threads", c->threads, "CPU threads of the cpu backend (0 = all)")->check(CLI::Range(0, 4096))->capture_default_str();
  cmd->add_option("--csv", c->csv, "Append one row per run to this CSV file (header when new)");
  cmd->add_option("--commit", c->commit, "Commit recorded in the CSV (default: git rev-parse --short HEAD, or unknown)");
  cmd->add_flag("--progress", c->progress, "Progress bar on stderr even when it is not a terminal");
  cmd->add_flag("--no-progress", c->no_progress, "No progress bar");
  cmd->add_option("--profile-every", c->profile_every, "Profile one decode step in this many (attention/GEMM split; 0 = none)")
      ->check(CLI::Range(0, 1 << 30))
      ->capture_default_str();
  cmd->add_option("--warmup-tokens", c->warmup_tokens,
                  "Before each measured run, run the same workload unmeasured for this many tokens (0 = no warm-up)")
      ->check(CLI::Range(0, 1 << 20))
      ->capture_default_str();
  cmd->add_option("--check-steps", c->check_steps, "First compare fasttree vs per-request greedy tokens over K steps (0 = off)")
      ->check(CLI::Range(0, 1 << 20))
      ->capture_default_str();
  cmd->add_flag("--check-only", c->check_only, "Only the --check-steps comparison, no throughput runs");
  cmd->add_option("--tie-tol", c->tie_tol, "A divergence is a bf16 tie when the logit gap <= this x max(1, |top logit|)")
      ->check(CLI::Range(0.0, 1e9))
      ->capture_default_str();
  cmd->add_flag("--dry-run", c->dry_run, "Describe the workloads and the KV pool (stderr), build no model, run nothing");
  add_planner_options(*cmd, c->planner);
  cmd->callback([c] { run_bench_e2e(*c); });
}

}  // namespace fasttree
