// Reports of `fasttree bench-e2e`: one record per (workload, model, attention) run as a CSV row
// (bench/results/h200-e2e.csv), a one-line JSON object and a row of the human table.
#pragma once
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "apps/e2e_run.h"

namespace fasttree {

struct E2eRecord {
  std::string workload, preset, backend, attention;  // attention: fasttree | per-request
  int max_new_tokens = 0;
  double scale = 1.0, length_scale = 1.0;
  int64_t kv_slots = 0;
  int profile_every = 0;
  std::string commit;
  int tp = 1;  // tensor-parallel ranks
  E2eMeasurement m;
};

// CSV columns, in order: workload,preset,backend,attention,requests,sequences,generated_tokens,
// seconds,tokens_per_s,decode_steps,mean_batch,max_batch,decode_step_ms,attention_ms,gemm_ms,
// other_ms,rest_ms,profiled_steps,plan_ms_per_step,plan_share,prefill_s,prefill_tokens,
// cache_hit_rate,unique_kv_tokens,floor_step_ms,step_vs_floor,max_new_tokens,scale,length_scale,
// kv_slots,profile_every,commit,tp,comm_ms (tp and comm_ms appended last so readers of the older
// columns stay valid; comm_ms: the tensor-parallel all-reduces of rank 0 per profiled step, inside
// rest_ms). attention/gemm/other/rest/comm are empty when no step was profiled.
std::vector<std::string> e2e_csv_columns();
std::string e2e_csv_header();  // the columns joined by ',' (no newline)
std::string e2e_csv_row(const E2eRecord& r);
// Appends rows to `path`, writing the header first when the file is missing or empty; a file whose
// first line is another header is an error (nothing is written).
void append_e2e_csv(const std::string& path, const std::vector<E2eRecord>& rows);

nlohmann::ordered_json e2e_json(const E2eRecord& r);
// Aligned text table of the runs, then "speedup" lines for every (workload, preset) with both
// attentions: FastTree tokens/s over per-request tokens/s.
std::string e2e_table(const std::vector<E2eRecord>& rows);

nlohmann::ordered_json agreement_json(const std::string& workload, const std::string& preset, const AgreementCheck& c);
std::string agreement_text(const std::string& workload, const std::string& preset, const AgreementCheck& c);

}  // namespace fasttree
