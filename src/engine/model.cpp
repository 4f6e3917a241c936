#include "engine/model.h"

#include "core/error.h"
#include "engine/sampler.h"

namespace fasttree {

std::vector<int32_t> DecoderModel::decode_greedy(const DecodeBatch& batch, DecodeAttention attention) {
  const std::vector<float> logits = decode(batch, attention);
  const size_t b = batch.tokens.size();
  const size_t vocab = static_cast<size_t>(config().vocab_size);
  FT_CHECK(logits.size() == b * vocab, "decode_greedy: model returned " + std::to_string(logits.size()) +
                                           " logits for a batch of " + std::to_string(b));
  std::vector<int32_t> tokens(b);
  for (size_t i = 0; i < b; ++i) tokens[i] = greedy_token(std::span<const float>(logits).subspan(i * vocab, vocab));
  return tokens;
}

int64_t check_decode_tree(const DecodeBatch& batch, const ModelConfig& config, int32_t num_slots) {
  FT_CHECK(batch.tree != nullptr, "decode: batch has no tree");
  const KvTree& tree = *batch.tree;
  const int64_t b = static_cast<int64_t>(batch.tokens.size());
  FT_CHECK(tree.num_queries() == b, "decode: tree has " + std::to_string(tree.num_queries()) + " queries for " +
                                        std::to_string(b) + " requests");
  if (b == 0) return 0;
  validate_tree(tree, num_slots);
  // Each query's path must end with its own new slot (the token attends to itself).
  for (int64_t r = 0; r < b; ++r) {
    int v = tree.query_node[static_cast<size_t>(r)];
    int64_t path_len = 0;
    int32_t last = -1;
    for (; v >= 0; v = tree.parent[v]) {
      if (last < 0 && tree.node_len(v) > 0) last = tree.node_slots(v).back();
      path_len += tree.node_len(v);
    }
    FT_CHECK(last == batch.slots[static_cast<size_t>(r)],
             "decode: request " + std::to_string(r) + "'s context path ends with slot " + std::to_string(last) +
                 ", not with its new slot " + std::to_string(batch.slots[static_cast<size_t>(r)]));
    FT_CHECK(config.sliding_window == 0 || path_len <= config.sliding_window,
             "decode: request " + std::to_string(r) + "'s context of " + std::to_string(path_len) +
                 " tokens exceeds the sliding window of " + std::to_string(config.sliding_window) + " (not supported)");
  }
  return b;
}

void check_prefill_batch_slots(std::span<const PrefillSeq> seqs, int32_t num_slots, std::vector<int32_t>& writer) {
  if (writer.size() != static_cast<size_t>(num_slots)) writer.assign(static_cast<size_t>(num_slots), -1);
  size_t marked = 0;  // sequences whose slots are (at least partly) marked: [0, marked]
  // Every slot touched belongs to a sequence in [0, marked]: resetting all of theirs restores all -1.
  auto undo = [&] {
    for (size_t s = 0; s <= marked && s < seqs.size(); ++s)
      for (int32_t slot : seqs[s].slots) writer[static_cast<size_t>(slot)] = -1;
  };
  try {
    for (; marked < seqs.size(); ++marked) {
      for (int32_t slot : seqs[marked].slots) {
        int32_t& w = writer[static_cast<size_t>(slot)];
        FT_CHECK(w < 0 || w == static_cast<int32_t>(marked),
                 "prefill_batch: slot " + std::to_string(slot) + " is written by sequences " + std::to_string(w) +
                     " and " + std::to_string(marked));
        w = static_cast<int32_t>(marked);
      }
    }
    for (size_t s = 0; s < seqs.size(); ++s)
      for (int32_t slot : seqs[s].context_slots) {
        const int32_t w = writer[static_cast<size_t>(slot)];
        FT_CHECK(w < static_cast<int32_t>(s),
                 "prefill_batch: sequence " + std::to_string(s) + "'s context slot " + std::to_string(slot) +
                     " is written by sequence " + std::to_string(w) + " of the same batch, which does not come before it");
      }
  } catch (...) {
    undo();
    throw;
  }
  undo();
}

std::vector<float> DecoderModel::prefill_batch(std::span<const PrefillSeq> seqs) {
  const size_t vocab = static_cast<size_t>(config().vocab_size);
  // Slot ranges first (each prefill() checks its own again), then the batch-level rules.
  for (size_t i = 0; i < seqs.size(); ++i)
    for (std::span<const int32_t> part : {seqs[i].slots, seqs[i].context_slots})
      for (int32_t slot : part)
        FT_CHECK(slot >= 0 && slot < num_slots(), "prefill_batch: sequence " + std::to_string(i) + ": slot " +
                                                      std::to_string(slot) + " out of range [0, " +
                                                      std::to_string(num_slots()) + ")");
  std::vector<int32_t> writer;
  check_prefill_batch_slots(seqs, num_slots(), writer);
  std::vector<float> out;
  out.reserve(seqs.size() * vocab);
  for (const PrefillSeq& s : seqs) {
    const std::vector<float> logits = prefill(s.tokens, s.positions, s.slots, s.context_slots);
    FT_CHECK(logits.size() == vocab, "prefill_batch: model returned " + std::to_string(logits.size()) +
                                         " logits for one sequence, expected " + std::to_string(vocab));
    out.insert(out.end(), logits.begin(), logits.end());
  }
  return out;
}

}  // namespace fasttree
