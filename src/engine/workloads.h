// End-to-end workloads of the FastTree paper (Pan et al., MLSys 2025, §6 end-to-end evaluation;
// DESIGN.md §7), as engine requests with synthetic token ids. The paper gives token counts and
// branching; the per-level lengths below are ours where it gives only totals.
//
//   A  multi-level system prompt: a 3193-token shared prompt in a 3-level tree
//        system prompt 2048 -> 4 variants x 1145 (2048 + 1145 = 3193 shared per request)
//        -> 128 questions x 64 each                                  512 requests, 512 sequences
//   B  multi few-shot: system prompt 512 -> 8 twenty-shot blocks x 1600 (20 shots x 80 tokens)
//        -> 16 questions x 64 each                                   128 requests, 128 sequences
//   C  multi-chain reasoning: system prompt 1024 -> 32 questions x 128 -> 4 chains each
//        32 requests with GenerationRequest::n = 4 (the chains are n-sample forks of the question
//        prompt: under greedy decoding their tokens are identical, but each chain keeps its own KV
//        tail, so the decode batch and the KV tree are the paper's)  128 sequences
//   D  multi-document QA: 16 branches, each a chain of 4 documents of ~1100 tokens (1100 +- 50,
//        drawn per document) -> 8 questions x 64 each               128 requests, 128 sequences
//   Every request generates max_new_tokens (default 256) greedily, no stop tokens (no early stop).
//
// Token ids are uniform in [0, vocab_size) from a std::mt19937_64 seeded with `seed`, drawn node by
// node in depth-first order, so a workload is a pure function of its spec. A node's ids are drawn
// once and every request below it repeats them exactly (shared prefixes are exactly shared); the
// first tokens of siblings are distinct, so the radix tree of the prompts is exactly the workload
// tree. Requests come in depth-first order (A: variant 0's questions first).
//
// Scaling for small runs (CI): `scale` in (0, 1] multiplies every fan-out (rounded, never below
// min(2, fan-out), so a scaled workload still branches at every level); `length_scale` in (0, 1]
// multiplies every token length and jitter (rounded, at least 1 token). Bad specs (unknown name,
// vocab smaller than the largest fan-out, scales outside (0, 1], max_new_tokens < 1) are one-line
// fasttree::Errors.
#pragma once
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "engine/scheduler.h"

namespace fasttree {

struct WorkloadSpec {
  std::string name = "A";      // A | B | C | D
  int64_t vocab_size = 32000;  // ids are drawn in [0, vocab_size)
  uint64_t seed = 0;
  int max_new_tokens = 256;
  double scale = 1.0;          // fan-out fraction
  double length_scale = 1.0;   // token-length fraction
};

// One level of a workload tree: every node of the previous level gets `fanout` children of
// `tokens` (+- `jitter`, uniform per node) tokens each.
struct WorkloadLevel {
  std::string what;
  int fanout = 1;
  int64_t tokens = 0;
  int64_t jitter = 0;
};

// The (scaled) shape of a workload: its levels, root level first, and the samples per request.
struct WorkloadShape {
  std::string name;
  std::string title;
  std::vector<WorkloadLevel> levels;
  int samples = 1;  // GenerationRequest::n
  std::string describe() const;  // e.g. "system prompt 2048 -> 4 x variant 1145 -> 128 x question 64"
};

std::vector<std::string> workload_names();  // A, B, C, D
// Validates the spec and returns its scaled shape.
WorkloadShape workload_shape(const WorkloadSpec& spec);
std::vector<GenerationRequest> make_workload(const WorkloadSpec& spec);

// Figures of a request set (any requests, not only make_workload's).
struct WorkloadStats {
  int64_t requests = 0;
  int64_t sequences = 0;              // Σ n
  int64_t prompt_tokens = 0;          // Σ prompt lengths (per request, not per sample)
  int64_t unique_prompt_tokens = 0;   // nodes of the prompts' token trie: what a prefix cache stores
  int64_t min_prompt = 0, max_prompt = 0;
  int64_t generated_tokens = 0;       // Σ n · max_new_tokens (no early stop)
  int64_t max_request_slots = 0;      // max over requests of prompt + n · (max_new_tokens - 1)
  // KV slots to hold the whole workload at once: unique prompt tokens + Σ n · max_new_tokens.
  int64_t kv_slots_all_at_once() const { return unique_prompt_tokens + generated_tokens; }
  double sharing() const {            // prompt tokens per stored prompt token
    return unique_prompt_tokens > 0 ? static_cast<double>(prompt_tokens) / static_cast<double>(unique_prompt_tokens) : 0.0;
  }
};
WorkloadStats workload_stats(std::span<const GenerationRequest> requests);

}  // namespace fasttree
