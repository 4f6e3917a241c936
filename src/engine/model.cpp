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

std::vector<float> DecoderModel::prefill_batch(std::span<const PrefillSeq> seqs) {
  const size_t vocab = static_cast<size_t>(config().vocab_size);
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
