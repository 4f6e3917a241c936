#include "engine/scheduler.h"

#include <algorithm>
#include <chrono>
#include <string>

#include "core/cache_tree.h"
#include "core/error.h"
#include "engine/plan_extend.h"

namespace fasttree {

namespace {

std::string num(int64_t v) { return std::to_string(v); }

}  // namespace

Scheduler::Scheduler(DecoderModel& model, SchedulerOptions options)
    : model_(model), options_(options), pool_(model.num_slots()), cache_(pool_), planner_(options.planner) {
  FT_CHECK(options_.max_running > 0, "scheduler: max_running must be positive, got " + num(options_.max_running));
  FT_CHECK(options_.max_prefill_tokens > 0,
           "scheduler: max_prefill_tokens must be positive, got " + num(options_.max_prefill_tokens));
}

int64_t Scheduler::submit(GenerationRequest request) {
  const ModelConfig& c = model_.config();
  const int64_t id = next_id_;
  const std::string where = "request " + num(id) + ": ";
  const int64_t p = static_cast<int64_t>(request.prompt.size());
  FT_CHECK(p > 0, where + "empty prompt");
  for (size_t i = 0; i < request.prompt.size(); ++i) {
    const int32_t t = request.prompt[i];
    FT_CHECK(t >= 0 && t < c.vocab_size, where + "prompt token " + num(t) + " at position " + num(static_cast<int64_t>(i)) +
                                             " is outside the vocabulary [0, " + num(c.vocab_size) + ")");
  }
  FT_CHECK(request.max_new_tokens >= 0, where + "max_new_tokens must be >= 0, got " + num(request.max_new_tokens));
  FT_CHECK(request.n >= 1 && request.n <= options_.max_running,
           where + "n must be in [1, " + num(options_.max_running) + "] (max running sequences), got " + num(request.n));
  try {
    request.sampling.validate();
  } catch (const Error& e) {
    FT_FAIL(where + e.message());
  }
  const int64_t context = p + std::max(0, request.max_new_tokens - 1);  // longest context attended
  FT_CHECK(c.sliding_window == 0 || context <= c.sliding_window,
           where + "prompt " + num(p) + " + max_new_tokens " + num(request.max_new_tokens) + " needs a context of " +
               num(context) + " tokens, beyond the model's sliding window of " + num(c.sliding_window) +
               " (not supported)");
  const int64_t slots = p + int64_t{request.n} * std::max(0, request.max_new_tokens - 1);
  FT_CHECK(slots <= pool_.capacity(),
           where + "needs " + num(slots) + " KV slots (prompt " + num(p) + " + n " + num(request.n) +
               " x (max_new_tokens - 1)) but the KV pool holds " + num(pool_.capacity()) + ": it can never run");

  ++next_id_;
  ++stats_.requests_submitted;
  auto g = std::make_unique<Group>();
  g->id = id;
  g->result.id = id;
  g->result.prompt_tokens = p;
  g->result.samples.assign(static_cast<size_t>(request.n), {});
  g->request = std::move(request);
  if (g->request.max_new_tokens == 0) {  // nothing to compute
    ++stats_.requests_finished;
    finished_.push_back(std::move(g->result));
    return id;
  }
  waiting_.push_back(std::move(g));
  return id;
}

std::vector<int32_t> Scheduler::path_slots(NodeId node) const {
  std::vector<NodeId> path;
  for (NodeId v = node; v != kRootNode; v = cache_.node_parent(v)) path.push_back(v);
  std::vector<int32_t> out;
  for (auto it = path.rbegin(); it != path.rend(); ++it) {
    const auto s = cache_.node_slots(*it);
    out.insert(out.end(), s.begin(), s.end());
  }
  return out;
}

void Scheduler::ensure_free(int64_t n) {
  if (pool_.num_free() >= n) return;
  stats_.evicted_tokens += cache_.evict(n - pool_.num_free());
  FT_CHECK(pool_.num_free() >= n, "scheduler: KV pool accounting broken: need " + num(n) + " slots, " +
                                      num(pool_.num_free()) + " free after eviction");
}

bool Scheduler::admit(Group& group) {
  const GenerationRequest& req = group.request;
  const int64_t p = static_cast<int64_t>(req.prompt.size());
  if (static_cast<int64_t>(running_.size()) + pending_seqs_ + req.n > options_.max_running) return false;
  const std::span<const int32_t> prompt(req.prompt);
  // The last prompt token is always computed: its logits give the first generated token.
  RadixCache::MatchResult m = cache_.match_prefix(prompt.first(static_cast<size_t>(p - 1)));
  cache_.lock(m.node);
  const int64_t compute = p - m.length;
  const int64_t need = compute + int64_t{req.n} * (req.max_new_tokens - 1);
  const int64_t available = pool_.num_free() + cache_.evictable_tokens();
  if (need > available) {
    cache_.unlock(m.node);
    return false;
  }
  ensure_free(need);
  PendingPrefill pend;
  pend.group = &group;
  pend.offset = m.length;
  pend.new_slots = pool_.alloc(compute);
  pend.tails.resize(static_cast<size_t>(req.n));
  for (auto& t : pend.tails) t = pool_.alloc(req.max_new_tokens - 1);
  pend.positions.resize(static_cast<size_t>(compute));
  for (int64_t i = 0; i < compute; ++i) pend.positions[static_cast<size_t>(i)] = static_cast<int32_t>(m.length + i);
  pend.context_slots = m.slots;
  stats_.prompt_tokens += p;
  stats_.cached_prompt_tokens += m.length;
  group.result.cached_tokens = m.length;

  // Into the cache now: a later request of the same batch reuses this prompt's prefix (its K/V is
  // computed by the batch's prefill, in order, before anything else reads it).
  std::vector<int32_t> all_slots = std::move(m.slots);
  all_slots.insert(all_slots.end(), pend.new_slots.begin(), pend.new_slots.end());
  const RadixCache::InsertResult ins = cache_.insert(prompt, all_slots);
  // Positions the cache already held (beyond the match: the last token of a fully cached prompt)
  // keep the cache's slots; our duplicates are still written by the prefill, so they go back to the
  // pool only after it.
  if (ins.cached_prefix > m.length) {
    const auto dup = std::span<const int32_t>(pend.new_slots).first(static_cast<size_t>(ins.cached_prefix - m.length));
    deferred_free_.insert(deferred_free_.end(), dup.begin(), dup.end());
  }
  for (int i = 0; i < req.n; ++i) cache_.lock(ins.node);
  cache_.unlock(m.node);
  pend.node = ins.node;
  group.unfinished = req.n;
  pending_tokens_ += compute;
  pending_seqs_ += req.n;
  pending_.push_back(std::move(pend));
  return true;
}

void Scheduler::flush_prefill() {
  if (pending_.empty()) return;
  std::vector<PrefillSeq> seqs;
  seqs.reserve(pending_.size());
  for (const PendingPrefill& p : pending_) {
    const std::span<const int32_t> prompt(p.group->request.prompt);
    seqs.push_back({prompt.subspan(static_cast<size_t>(p.offset)), p.positions, p.new_slots, p.context_slots});
  }
  const auto t0 = std::chrono::steady_clock::now();
  const std::vector<float> logits = model_.prefill_batch(seqs);
  stats_.prefill_ms += std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  ++stats_.prefill_calls;
  stats_.prefill_tokens += pending_tokens_;
  const size_t vocab = static_cast<size_t>(model_.config().vocab_size);
  FT_CHECK(logits.size() == pending_.size() * vocab,
           "scheduler: model returned " + num(static_cast<int64_t>(logits.size())) + " prefill logits for " +
               num(static_cast<int64_t>(pending_.size())) + " sequences");
  pool_.free(deferred_free_);
  deferred_free_.clear();
  std::vector<PendingPrefill> batch = std::move(pending_);
  pending_.clear();
  pending_tokens_ = 0;
  pending_seqs_ = 0;
  for (size_t i = 0; i < batch.size(); ++i) start_group(batch[i], std::span<const float>(logits).subspan(i * vocab, vocab));
}

void Scheduler::start_group(PendingPrefill& p, std::span<const float> logits) {
  Group& group = *p.group;
  const GenerationRequest& req = group.request;
  const int64_t plen = static_cast<int64_t>(req.prompt.size());
  // The group may finish (and be destroyed) with its last sample: nothing reads it after that.
  const int n = req.n;
  for (int i = 0; i < n; ++i) {
    auto seq = std::make_unique<Sequence>();
    seq->group = &group;
    seq->sample = i;
    seq->node = p.node;
    seq->prompt_len = plen;
    seq->tail_alloc = std::move(p.tails[static_cast<size_t>(i)]);
    seq->reserve_left = static_cast<int64_t>(seq->tail_alloc.size());
    reserved_ += seq->reserve_left;
    SamplingParams sp = req.sampling;
    sp.seed = req.sampling.seed + static_cast<uint64_t>(i);
    seq->sampler = std::make_unique<Sampler>(sp);
    sample_into(*seq, logits);
    if (is_done(*seq)) {
      finish(*seq);
    } else {
      running_.push_back(std::move(seq));
      batch_changed_ = true;
    }
  }
}

void Scheduler::sample_into(Sequence& seq, std::span<const float> logits) {
  auto& out = seq.group->result.samples[static_cast<size_t>(seq.sample)];
  if (options_.on_token_logits)
    options_.on_token_logits({seq.group->id, seq.sample, static_cast<int64_t>(out.size()), logits});
  out.push_back(seq.sampler->sample(logits));
  ++stats_.generated_tokens;
}

bool Scheduler::is_done(const Sequence& seq) const {
  const auto& out = seq.group->result.samples[static_cast<size_t>(seq.sample)];
  const auto& stop = seq.group->request.stop_tokens;
  return static_cast<int>(out.size()) >= seq.group->request.max_new_tokens ||
         (!out.empty() && std::find(stop.begin(), stop.end(), out.back()) != stop.end());
}

void Scheduler::finish(Sequence& seq) {
  Group& g = *seq.group;
  const auto& out = g.result.samples[static_cast<size_t>(seq.sample)];
  if (!seq.tail_slots.empty()) {
    if (options_.cache_generated) {
      // Fed tokens: the prompt and every generated token but the last (its K/V was never computed).
      std::vector<int32_t> tokens = g.request.prompt;
      tokens.insert(tokens.end(), out.begin(), out.begin() + static_cast<std::ptrdiff_t>(seq.tail_slots.size()));
      std::vector<int32_t> slots = path_slots(seq.node);
      FT_CHECK(static_cast<int64_t>(slots.size()) == seq.prompt_len, "scheduler: cache path of a sequence changed length");
      slots.insert(slots.end(), seq.tail_slots.begin(), seq.tail_slots.end());
      const RadixCache::InsertResult ins = cache_.insert(tokens, slots);
      if (ins.cached_prefix > seq.prompt_len)
        pool_.free(std::span<const int32_t>(seq.tail_slots).first(static_cast<size_t>(ins.cached_prefix - seq.prompt_len)));
    } else {
      pool_.free(seq.tail_slots);
    }
    seq.tail_slots.clear();
  }
  cache_.unlock(seq.node);
  // The generated-token slots never fed go back to the pool.
  pool_.free(std::span<const int32_t>(seq.tail_alloc).last(static_cast<size_t>(seq.reserve_left)));
  reserved_ -= seq.reserve_left;
  seq.reserve_left = 0;
  --g.unfinished;
  finish_group_if_done(g);
}

void Scheduler::finish_group_if_done(Group& g) {
  if (g.unfinished > 0) return;
  ++stats_.requests_finished;
  finished_.push_back(std::move(g.result));
  auto it = std::find_if(active_.begin(), active_.end(), [&](const auto& p) { return p.get() == &g; });
  if (it != active_.end()) active_.erase(it);
}

void Scheduler::decode_step() {
  const size_t b = running_.size();
  step_slots_.resize(b);
  step_tokens_.resize(b);
  step_positions_.resize(b);
  for (size_t i = 0; i < b; ++i) {
    Sequence& s = *running_[i];
    FT_CHECK(s.reserve_left > 0, "scheduler: a running sequence has no allocated slot left");
    step_slots_[i] = s.tail_alloc[s.tail_alloc.size() - static_cast<size_t>(s.reserve_left)];
    s.tail_slots.push_back(step_slots_[i]);
    --s.reserve_left;
    --reserved_;
    step_tokens_[i] = s.group->result.samples[static_cast<size_t>(s.sample)].back();
    step_positions_[i] = static_cast<int32_t>(s.prompt_len + static_cast<int64_t>(s.tail_slots.size()) - 1);
  }
  const bool fasttree = options_.attention == DecodeAttention::kFastTree;
  const auto plan_t0 = std::chrono::steady_clock::now();
  bool planned = false;
  if (batch_changed_ || !options_.extend_plans) {
    ++stats_.tree_rebuilds;
    if (options_.sharing == PathSharing::kShared) {
      std::vector<LiveRequest> live(b);
      for (size_t i = 0; i < b; ++i) live[i] = {running_[i]->node, running_[i]->tail_slots};
      tree_ = build_kv_tree(cache_, live);
    } else {
      std::vector<std::vector<int32_t>> paths(b);
      for (size_t i = 0; i < b; ++i) {
        paths[i] = path_slots(running_[i]->node);
        paths[i].insert(paths[i].end(), running_[i]->tail_slots.begin(), running_[i]->tail_slots.end());
      }
      tree_ = kv_tree_from_paths(paths, PathSharing::kPerRequest);
    }
    batch_changed_ = false;
  } else {
    grow_query_leaves(tree_, step_slots_, &extend_scratch_);
    if (fasttree) {
      if (extend_plan(plan_, tree_, options_.planner, &extend_scratch_)) {
        ++stats_.plan_extensions;
        planned = true;
      }
    }
  }
  if (fasttree && !planned) {
    planner_.build(tree_, model_.config().attn_shape(), plan_);
    ++stats_.plans;
  }
  const auto plan_t1 = std::chrono::steady_clock::now();
  stats_.plan_ms += std::chrono::duration<double, std::milli>(plan_t1 - plan_t0).count();
  DecodeBatch batch{step_tokens_, step_positions_, step_slots_, &tree_, fasttree ? &plan_ : nullptr};
  // All greedy: the model picks the tokens (on the device for the GPU model), no logits cross over
  // (unless a logits observer wants them).
  const bool all_greedy = !options_.on_token_logits && std::all_of(running_.begin(), running_.end(), [](const auto& s) {
    return s->sampler->params().temperature == 0.0f;
  });
  std::vector<float> logits;
  std::vector<int32_t> greedy;
  if (all_greedy) {
    greedy = model_.decode_greedy(batch, options_.attention);
    FT_CHECK(greedy.size() == b, "scheduler: model returned " + num(static_cast<int64_t>(greedy.size())) +
                                     " tokens for a batch of " + num(static_cast<int64_t>(b)));
  } else {
    logits = model_.decode(batch, options_.attention);
  }
  stats_.decode_ms += std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - plan_t1).count();
  ++stats_.decode_steps;
  stats_.decode_tokens += static_cast<int64_t>(b);
  stats_.max_batch = std::max(stats_.max_batch, static_cast<int>(b));

  const size_t vocab = static_cast<size_t>(model_.config().vocab_size);
  FT_CHECK(all_greedy || logits.size() == b * vocab,
           "scheduler: model returned " + num(static_cast<int64_t>(logits.size())) + " logits for a batch of " +
               num(static_cast<int64_t>(b)));
  std::vector<std::unique_ptr<Sequence>> still;
  still.reserve(b);
  for (size_t i = 0; i < b; ++i) {
    Sequence& s = *running_[i];
    if (all_greedy) {
      const int32_t token = greedy[i];
      FT_CHECK(token >= 0 && token < model_.config().vocab_size,
               "scheduler: model returned token " + num(token) + " outside the vocabulary");
      s.group->result.samples[static_cast<size_t>(s.sample)].push_back(token);
      ++stats_.generated_tokens;
    } else {
      sample_into(s, std::span<const float>(logits).subspan(i * vocab, vocab));
    }
    if (is_done(s)) {
      finish(s);
      batch_changed_ = true;
    } else {
      still.push_back(std::move(running_[i]));
    }
  }
  running_ = std::move(still);
}

bool Scheduler::step() {
  if (idle()) return false;
  while (!waiting_.empty()) {
    Group& g = *waiting_.front();
    if (!admit(g)) {
      if (!pending_.empty()) {  // settle the batch first (its samples may finish at once), then retry
        flush_prefill();
        continue;
      }
      if (static_cast<int64_t>(running_.size()) + g.request.n <= options_.max_running) ++stats_.admission_waits;
      FT_CHECK(!running_.empty(), "scheduler: request " + num(g.id) + " cannot be admitted into an idle engine");
      break;
    }
    active_.push_back(std::move(waiting_.front()));  // finish_group_if_done() removes it again
    waiting_.pop_front();
    if (pending_tokens_ >= options_.max_prefill_tokens) flush_prefill();
  }
  flush_prefill();
  if (!running_.empty()) decode_step();
  return true;
}

std::vector<GenerationResult> Scheduler::run() {
  while (step()) {
  }
  std::vector<GenerationResult> out = take_finished();
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.id < b.id; });
  return out;
}

std::vector<GenerationResult> Scheduler::take_finished() {
  std::vector<GenerationResult> out = std::move(finished_);
  finished_.clear();
  return out;
}

void Scheduler::check_invariants() const {
  cache_.check_invariants();
  int64_t tails = 0, reserved = 0;
  for (const auto& s : running_) {
    tails += static_cast<int64_t>(s->tail_slots.size());
    reserved += s->reserve_left;
    FT_CHECK(cache_.node_lock_ref(s->node) > 0 || s->node == kRootNode, "scheduler: a running sequence's node is unlocked");
    for (int32_t slot : s->tail_slots) FT_CHECK(pool_.is_in_use(slot), "scheduler: tail slot " + num(slot) + " is free");
  }
  FT_CHECK(reserved == reserved_, "scheduler: reserved " + num(reserved_) + " != Σ sequences' " + num(reserved));
  FT_CHECK(pool_.num_used() == cache_.total_tokens() + tails + reserved_,
           "scheduler: " + num(pool_.num_used()) + " slots used, cache holds " + num(cache_.total_tokens()) +
               ", tails " + num(tails) + " and allocated-unfed " + num(reserved_));
}

}  // namespace fasttree
