#include "engine/workloads.h"

#include <algorithm>
#include <cmath>
#include <random>

#include "core/error.h"

namespace fasttree {

namespace {

WorkloadShape full_shape(const std::string& name) {
  if (name == "A")
    return {"A", "multi-level system prompt", {{"system prompt", 1, 2048, 0}, {"variant", 4, 1145, 0}, {"question", 128, 64, 0}}, 1};
  if (name == "B")
    return {"B", "multi few-shot", {{"system prompt", 1, 512, 0}, {"twenty-shot block", 8, 1600, 0}, {"question", 16, 64, 0}}, 1};
  if (name == "C")
    return {"C", "multi-chain reasoning", {{"system prompt", 1, 1024, 0}, {"question", 32, 128, 0}}, 4};
  if (name == "D")
    return {"D",
            "multi-document QA",
            {{"document 1", 16, 1100, 50},
             {"document 2", 1, 1100, 50},
             {"document 3", 1, 1100, 50},
             {"document 4", 1, 1100, 50},
             {"question", 8, 64, 0}},
            1};
  FT_FAIL("unknown workload '" + name + "' (known: A, B, C, D)");
}

int scaled_fanout(int fanout, double scale) {
  if (fanout <= 1) return fanout;
  return std::max(std::min(2, fanout), static_cast<int>(std::lround(fanout * scale)));
}

int64_t scaled_length(int64_t tokens, double scale, int64_t at_least) {
  return std::max<int64_t>(at_least, std::llround(static_cast<double>(tokens) * scale));
}

struct Builder {
  const WorkloadShape& shape;
  const WorkloadSpec& spec;
  std::mt19937_64 rng;
  std::vector<int32_t> prefix;
  std::vector<GenerationRequest> out;

  int32_t token() { return static_cast<int32_t>(rng() % static_cast<uint64_t>(spec.vocab_size)); }

  // Appends the children of the current prefix at `level`, recursing depth first.
  void expand(size_t level) {
    if (level == shape.levels.size()) {
      GenerationRequest r;
      r.prompt = prefix;
      r.max_new_tokens = spec.max_new_tokens;
      r.n = shape.samples;
      out.push_back(std::move(r));
      return;
    }
    const WorkloadLevel& l = shape.levels[level];
    const int32_t first_base = token();  // sibling i starts with (first_base + i) mod vocab: distinct
    for (int i = 0; i < l.fanout; ++i) {
      int64_t len = l.tokens;
      if (l.jitter > 0)
        len += static_cast<int64_t>(rng() % static_cast<uint64_t>(2 * l.jitter + 1)) - l.jitter;
      const size_t mark = prefix.size();
      prefix.push_back(static_cast<int32_t>((int64_t{first_base} + i) % spec.vocab_size));
      for (int64_t t = 1; t < len; ++t) prefix.push_back(token());
      expand(level + 1);
      prefix.resize(mark);
    }
  }
};

}  // namespace

std::string WorkloadShape::describe() const {
  std::string s;
  for (size_t i = 0; i < levels.size(); ++i) {
    const WorkloadLevel& l = levels[i];
    if (i > 0) s += " -> ";
    if (l.fanout != 1 || i == 0) s += std::to_string(l.fanout) + " x ";
    s += l.what + " " + std::to_string(l.tokens);
    if (l.jitter > 0) s += "+-" + std::to_string(l.jitter);
  }
  if (samples > 1) s += " -> n " + std::to_string(samples);
  return s;
}

std::vector<std::string> workload_names() { return {"A", "B", "C", "D"}; }

WorkloadShape workload_shape(const WorkloadSpec& spec) {
  WorkloadShape shape = full_shape(spec.name);
  const std::string where = "workload " + spec.name + ": ";
  FT_CHECK(spec.scale > 0.0 && spec.scale <= 1.0, where + "scale must be in (0, 1], got " + std::to_string(spec.scale));
  FT_CHECK(spec.length_scale > 0.0 && spec.length_scale <= 1.0,
           where + "length scale must be in (0, 1], got " + std::to_string(spec.length_scale));
  FT_CHECK(spec.max_new_tokens >= 1, where + "max_new_tokens must be >= 1, got " + std::to_string(spec.max_new_tokens));
  int max_fanout = 1;
  for (WorkloadLevel& l : shape.levels) {
    l.fanout = scaled_fanout(l.fanout, spec.scale);
    l.tokens = scaled_length(l.tokens, spec.length_scale, 1);
    l.jitter = l.jitter > 0 ? std::min(l.tokens - 1, scaled_length(l.jitter, spec.length_scale, 0)) : 0;
    max_fanout = std::max(max_fanout, l.fanout);
  }
  shape.samples = scaled_fanout(shape.samples, spec.scale);
  FT_CHECK(spec.vocab_size >= max_fanout,
           where + "vocabulary of " + std::to_string(spec.vocab_size) + " tokens is smaller than the fan-out " +
               std::to_string(max_fanout) + " (siblings need distinct first tokens)");
  return shape;
}

std::vector<GenerationRequest> make_workload(const WorkloadSpec& spec) {
  const WorkloadShape shape = workload_shape(spec);
  Builder b{shape, spec, std::mt19937_64(spec.seed), {}, {}};
  b.expand(0);
  return std::move(b.out);
}

WorkloadStats workload_stats(std::span<const GenerationRequest> requests) {
  WorkloadStats s;
  s.requests = static_cast<int64_t>(requests.size());
  if (requests.empty()) return s;
  std::vector<const std::vector<int32_t>*> prompts;
  prompts.reserve(requests.size());
  s.min_prompt = static_cast<int64_t>(requests.front().prompt.size());
  for (const GenerationRequest& r : requests) {
    const int64_t p = static_cast<int64_t>(r.prompt.size());
    s.sequences += r.n;
    s.prompt_tokens += p;
    s.min_prompt = std::min(s.min_prompt, p);
    s.max_prompt = std::max(s.max_prompt, p);
    s.generated_tokens += int64_t{r.n} * std::max(0, r.max_new_tokens);
    s.max_request_slots = std::max(s.max_request_slots, p + int64_t{r.n} * std::max(0, r.max_new_tokens - 1));
    prompts.push_back(&r.prompt);
  }
  // Nodes of the token trie = Σ lengths - Σ longest common prefixes of neighbours in sorted order.
  std::sort(prompts.begin(), prompts.end(), [](const auto* a, const auto* b) { return *a < *b; });
  s.unique_prompt_tokens = static_cast<int64_t>(prompts[0]->size());
  for (size_t i = 1; i < prompts.size(); ++i) {
    const auto& a = *prompts[i - 1];
    const auto& b = *prompts[i];
    const auto mm = std::mismatch(a.begin(), a.end(), b.begin(), b.end());
    s.unique_prompt_tokens += static_cast<int64_t>(b.size()) - static_cast<int64_t>(mm.second - b.begin());
  }
  return s;
}

}  // namespace fasttree
