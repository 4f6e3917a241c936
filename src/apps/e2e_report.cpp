#include "apps/e2e_report.h"

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <utility>

#include <fmt/format.h>

#include "core/error.h"

namespace fasttree {

namespace {

using Field = std::pair<const char*, std::function<std::string(const E2eRecord&)>>;

std::string fixed(double v, int digits) { return fmt::format("{:.{}f}", v, digits); }
std::string profiled(const E2eRecord& r, double v) { return r.m.profiled_steps > 0 ? fixed(v, 4) : ""; }

const std::vector<Field>& fields() {
  static const std::vector<Field> f = {
      {"workload", [](const E2eRecord& r) { return r.workload; }},
      {"preset", [](const E2eRecord& r) { return r.preset; }},
      {"backend", [](const E2eRecord& r) { return r.backend; }},
      {"attention", [](const E2eRecord& r) { return r.attention; }},
      {"requests", [](const E2eRecord& r) { return std::to_string(r.m.requests); }},
      {"sequences", [](const E2eRecord& r) { return std::to_string(r.m.sequences); }},
      {"generated_tokens", [](const E2eRecord& r) { return std::to_string(r.m.generated_tokens); }},
      {"seconds", [](const E2eRecord& r) { return fixed(r.m.seconds, 4); }},
      {"tokens_per_s", [](const E2eRecord& r) { return fixed(r.m.tokens_per_s, 1); }},
      {"decode_steps", [](const E2eRecord& r) { return std::to_string(r.m.decode_steps); }},
      {"mean_batch", [](const E2eRecord& r) { return fixed(r.m.mean_batch, 2); }},
      {"max_batch", [](const E2eRecord& r) { return std::to_string(r.m.max_batch); }},
      {"decode_step_ms", [](const E2eRecord& r) { return fixed(r.m.decode_step_ms, 4); }},
      {"attention_ms", [](const E2eRecord& r) { return profiled(r, r.m.attention_ms); }},
      {"gemm_ms", [](const E2eRecord& r) { return profiled(r, r.m.gemm_ms); }},
      {"other_ms", [](const E2eRecord& r) { return profiled(r, r.m.other_ms); }},
      {"rest_ms", [](const E2eRecord& r) { return profiled(r, r.m.rest_ms()); }},
      {"profiled_steps", [](const E2eRecord& r) { return std::to_string(r.m.profiled_steps); }},
      {"plan_ms_per_step", [](const E2eRecord& r) { return fixed(r.m.plan_ms_per_step, 4); }},
      {"plan_share", [](const E2eRecord& r) { return fixed(r.m.plan_share(), 5); }},
      {"prefill_s", [](const E2eRecord& r) { return fixed(r.m.prefill_s, 4); }},
      {"prefill_tokens", [](const E2eRecord& r) { return std::to_string(r.m.prefill_tokens); }},
      {"cache_hit_rate", [](const E2eRecord& r) { return fixed(r.m.cache_hit_rate, 4); }},
      {"unique_kv_tokens", [](const E2eRecord& r) { return fixed(r.m.mean_unique_kv_tokens, 1); }},
      {"floor_step_ms", [](const E2eRecord& r) { return fixed(r.m.floor_step_ms, 4); }},
      {"step_vs_floor", [](const E2eRecord& r) { return fixed(r.m.step_vs_floor(), 3); }},
      {"max_new_tokens", [](const E2eRecord& r) { return std::to_string(r.max_new_tokens); }},
      {"scale", [](const E2eRecord& r) { return fmt::format("{}", r.scale); }},
      {"length_scale", [](const E2eRecord& r) { return fmt::format("{}", r.length_scale); }},
      {"kv_slots", [](const E2eRecord& r) { return std::to_string(r.kv_slots); }},
      {"profile_every", [](const E2eRecord& r) { return std::to_string(r.profile_every); }},
      {"commit", [](const E2eRecord& r) { return r.commit; }},
      {"tp", [](const E2eRecord& r) { return std::to_string(r.tp); }},
      {"comm_ms", [](const E2eRecord& r) { return profiled(r, r.m.comm_ms); }},
  };
  return f;
}

}  // namespace

std::vector<std::string> e2e_csv_columns() {
  std::vector<std::string> c;
  for (const auto& f : fields()) c.emplace_back(f.first);
  return c;
}

std::string e2e_csv_header() {
  std::string h;
  for (const auto& f : fields()) h += (h.empty() ? "" : ",") + std::string(f.first);
  return h;
}

std::string e2e_csv_row(const E2eRecord& r) {
  std::string row;
  bool first = true;
  for (const auto& f : fields()) {
    const std::string v = f.second(r);
    FT_CHECK(v.find_first_of(",\"\n") == std::string::npos, std::string("CSV field ") + f.first + " contains a separator: " + v);
    row += (first ? "" : ",") + v;
    first = false;
  }
  return row;
}

void append_e2e_csv(const std::string& path, const std::vector<E2eRecord>& rows) {
  std::error_code ec;
  const bool fresh = !std::filesystem::exists(path, ec) || std::filesystem::file_size(path, ec) == 0;
  if (!fresh) {
    std::ifstream in(path, std::ios::binary);
    FT_CHECK(in.good(), path + ": cannot read the CSV file");
    std::string first;
    std::getline(in, first);
    if (!first.empty() && first.back() == '\r') first.pop_back();
    FT_CHECK(first == e2e_csv_header(), path + ": existing CSV has other columns (first line: '" + first.substr(0, 80) +
                                            "'); use a new file");
  }
  std::string text;
  if (fresh) text += e2e_csv_header() + "\n";
  for (const E2eRecord& r : rows) text += e2e_csv_row(r) + "\n";
  std::ofstream out(path, std::ios::binary | std::ios::app);
  FT_CHECK(out.good(), path + ": cannot open the CSV file for writing");
  out << text;
  out.flush();
  FT_CHECK(out.good(), path + ": write failed");
}

nlohmann::ordered_json e2e_json(const E2eRecord& r) {
  nlohmann::ordered_json j;
  j["workload"] = r.workload;
  j["preset"] = r.preset;
  j["backend"] = r.backend;
  j["attention"] = r.attention;
  j["requests"] = r.m.requests;
  j["sequences"] = r.m.sequences;
  j["generated_tokens"] = r.m.generated_tokens;
  j["seconds"] = r.m.seconds;
  j["tokens_per_s"] = r.m.tokens_per_s;
  j["decode_steps"] = r.m.decode_steps;
  j["mean_batch"] = r.m.mean_batch;
  j["max_batch"] = r.m.max_batch;
  j["decode_step_ms"] = r.m.decode_step_ms;
  if (r.m.profiled_steps > 0) {
    j["attention_ms"] = r.m.attention_ms;
    j["gemm_ms"] = r.m.gemm_ms;
    j["other_ms"] = r.m.other_ms;
    j["rest_ms"] = r.m.rest_ms();
  }
  j["profiled_steps"] = r.m.profiled_steps;
  j["plan_ms_per_step"] = r.m.plan_ms_per_step;
  j["plan_share"] = r.m.plan_share();
  j["prefill_s"] = r.m.prefill_s;
  j["prefill_tokens"] = r.m.prefill_tokens;
  j["cache_hit_rate"] = r.m.cache_hit_rate;
  j["unique_kv_tokens"] = r.m.mean_unique_kv_tokens;
  j["floor_step_ms"] = r.m.floor_step_ms;
  j["step_vs_floor"] = r.m.step_vs_floor();
  j["max_new_tokens"] = r.max_new_tokens;
  j["scale"] = r.scale;
  j["length_scale"] = r.length_scale;
  j["kv_slots"] = r.kv_slots;
  j["commit"] = r.commit;
  j["tp"] = r.tp;
  if (r.m.profiled_steps > 0) {
    j["comm_ms"] = r.m.comm_ms;
    j["comm_share"] = r.m.decode_step_ms > 0 ? r.m.comm_ms / r.m.decode_step_ms : 0.0;
  }
  return j;
}

std::string e2e_table(const std::vector<E2eRecord>& rows) {
  std::string t = fmt::format("{:<3} {:<11} {:<11} {:>5} {:>8} {:>8} {:>9} {:>6} {:>9} {:>8} {:>8} {:>8} {:>8} {:>6} {:>5} {:>9} {:>7}\n",
                              "wl", "model", "attention", "reqs", "gen_tok", "seconds", "tok/s", "batch", "step_ms",
                              "attn_ms", "gemm_ms", "rest_ms", "plan_ms", "plan%", "hit", "floor_ms", "x_floor");
  auto opt = [](const E2eRecord& r, double v) { return r.m.profiled_steps > 0 ? fmt::format("{:.3f}", v) : std::string("-"); };
  for (const E2eRecord& r : rows)
    t += fmt::format("{:<3} {:<11} {:<11} {:>5} {:>8} {:>8.2f} {:>9.1f} {:>6.1f} {:>9.3f} {:>8} {:>8} {:>8} {:>8.4f} {:>6.2f} {:>5.3f} {:>9.3f} {:>7.2f}\n",
                     r.workload, r.preset, r.attention, r.m.requests, r.m.generated_tokens, r.m.seconds, r.m.tokens_per_s,
                     r.m.mean_batch, r.m.decode_step_ms, opt(r, r.m.attention_ms), opt(r, r.m.gemm_ms), opt(r, r.m.rest_ms()),
                     r.m.plan_ms_per_step, 100.0 * r.m.plan_share(), r.m.cache_hit_rate, r.m.floor_step_ms, r.m.step_vs_floor());
  for (const E2eRecord& r : rows)
    if (r.tp > 1 && r.m.profiled_steps > 0)
      t += fmt::format("all-reduce {} {} {} tp {}: {:.3f} ms of a {:.3f} ms step ({:.1f}%)\n", r.workload, r.preset,
                       r.attention, r.tp, r.m.comm_ms, r.m.decode_step_ms,
                       r.m.decode_step_ms > 0 ? 100.0 * r.m.comm_ms / r.m.decode_step_ms : 0.0);
  for (const E2eRecord& a : rows) {
    if (a.attention != "fasttree") continue;
    for (const E2eRecord& b : rows)
      if (b.attention == "per-request" && b.workload == a.workload && b.preset == a.preset && b.m.tokens_per_s > 0)
        t += fmt::format("speedup {} {}: fasttree {:.1f} tok/s vs per-request {:.1f} tok/s = {:.2f}x\n", a.workload,
                         a.preset, a.m.tokens_per_s, b.m.tokens_per_s, a.m.tokens_per_s / b.m.tokens_per_s);
  }
  return t;
}

nlohmann::ordered_json agreement_json(const std::string& workload, const std::string& preset, const AgreementCheck& c) {
  nlohmann::ordered_json j;
  j["check"] = "greedy-agreement";
  j["workload"] = workload;
  j["preset"] = preset;
  j["sequences"] = c.sequences;
  j["tokens"] = c.tokens_per_sequence;
  j["agree"] = c.agree;
  j["ties"] = c.ties;
  j["mismatches"] = c.mismatches;
  j["tie_tol"] = c.tie_tol;
  j["min_fasttree_margin"] = c.min_fasttree_margin;
  nlohmann::ordered_json d = nlohmann::json::array();
  for (const Divergence& v : c.divergences)
    d.push_back({{"request", v.request}, {"sample", v.sample}, {"index", v.index}, {"fasttree_token", v.fasttree_token},
                 {"per_request_token", v.per_request_token}, {"gap", v.gap}, {"tolerance", v.tolerance}, {"tie", v.tie()}});
  j["divergences"] = d;
  return j;
}

std::string agreement_text(const std::string& workload, const std::string& preset, const AgreementCheck& c) {
  std::string t = fmt::format(
      "check {} {}: {}/{} sequences agree on all {} greedy tokens; {} diverge within the bf16 tie tolerance "
      "(gap <= {}*max(1,|top logit|)), {} beyond it; smallest fasttree top-2 margin {:.4g}\n",
      workload, preset, c.agree, c.sequences, c.tokens_per_sequence, c.ties, c.tie_tol, c.mismatches, c.min_fasttree_margin);
  constexpr size_t kShown = 10;
  for (size_t i = 0; i < c.divergences.size() && i < kShown; ++i) {
    const Divergence& d = c.divergences[i];
    t += fmt::format("  request {} sample {}: first divergence at token {} (fasttree {} vs per-request {}), gap {:.4g} {} {:.4g} -> {}\n",
                     d.request, d.sample, d.index, d.fasttree_token, d.per_request_token, d.gap, d.tie() ? "<=" : ">",
                     d.tolerance, d.tie() ? "tie" : "MISMATCH");
  }
  if (c.divergences.size() > kShown) t += fmt::format("  ... {} more\n", c.divergences.size() - kShown);
  return t;
}

}  // namespace fasttree
