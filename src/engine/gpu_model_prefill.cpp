// Prefill of the GPU model (engine/gpu_model.h): one sequence (prefill) or a batch of sequences
// computed together (prefill_batch).
//
// prefill_batch packs the batch's new tokens into chunks of at most options.prefill_chunk rows, in
// sequence order; a sequence longer than the room left in a chunk continues in the next one (piece
// [a, b) of its tokens attends to its context and its tokens [0, b)). Per chunk: one embedding, the
// layers over all rows with the varlen prefill attention (one launch per layer: every piece's
// 64-row query blocks, heaviest first), then the final norm and ONE LM-head GEMM over the rows that
// end a sequence (gathered). Since every layer appends all rows' K/V before its attention, a piece
// may attend to slots written by an earlier piece of the same chunk (a prompt sharing the prefix
// another request of the batch computes), and earlier chunks are complete before later ones start.
#include "engine/gpu_model.h"

#include <vector>

#include "engine/gpu_model_impl.h"

namespace fasttree {

std::vector<float> GpuModel::prefill(std::span<const int32_t> tokens, std::span<const int32_t> positions,
                                     std::span<const int32_t> slots, std::span<const int32_t> context_slots,
                                     bool all_logits) {
  Impl& m = *impl_;
  const ModelConfig& c = m.config;
  FT_CHECK(!tokens.empty(), "prefill: no tokens");
  m.check_tokens(tokens, positions, slots, "prefill");
  const int64_t n = static_cast<int64_t>(tokens.size());
  const int64_t ctx = static_cast<int64_t>(context_slots.size());
  FT_CHECK(c.sliding_window == 0 || ctx + n <= c.sliding_window,
           "prefill: context of " + num(ctx + n) + " tokens exceeds the sliding window of " + num(c.sliding_window) +
               " (not supported)");
  for (int64_t i = 0; i < ctx; ++i) {
    const int32_t s = context_slots[static_cast<size_t>(i)];
    FT_CHECK(s >= 0 && s < m.num_slots, "prefill: context slot " + num(s) + " (index " + num(i) + ") out of range [0, " +
                                            num(m.num_slots) + ")");
  }
  if (ctx > 0) m.check_distinct(context_slots, slots, "prefill");
  FT_CHECK(n + ctx <= INT32_MAX, "prefill: too many tokens");

  const int64_t vocab = c.vocab_size;
  std::vector<float> out(static_cast<size_t>((all_logits ? n : 1) * vocab));
  m.guarded([&] {
    m.reduce_index = 0;
    const int64_t chunk = m.options.prefill_chunk;
    m.ensure_rows(std::min(n, chunk), all_logits ? std::min(n, chunk) : 1);
    m.marking = false;
    const int32_t* d = m.upload_ints({tokens, positions, slots, context_slots, slots});
    const int32_t* d_pos = d + n;
    const int32_t* d_slots = d + 2 * n;
    const int32_t* d_keys = d + 3 * n;  // context ++ new slots
    const float scale = c.attn_shape().default_sm_scale();
    for (int64_t cb = 0; cb < n; cb += chunk) {
      const int rows = static_cast<int>(std::min(chunk, n - cb));
      cuda_ops::embed(d + cb, rows, m.weights.embed, vocab, c.hidden_size, m.resid.as<float>(), m.s());
      m.run_layers(rows, d_pos + cb, d_slots + cb, [&](int l) {
        cuda_ops::prefill_attention(m.q.as<uint16_t>(), m.k_pool(l), m.v_pool(l), d_keys, ctx + cb + rows, rows,
                                    c.num_attention_heads, c.num_key_value_heads, m.dk, scale, m.attn.as<uint16_t>(),
                                    m.s());
      });
      if (all_logits) {
        m.lm_head(0, rows, [&](int64_t r, int64_t mr) {
          m.wait_device();  // the copy to pageable memory blocks the host
          copy_to_host(out.data() + (cb + r) * vocab, m.logits.data(), static_cast<size_t>(mr * vocab) * 4, m.s());
        });
      } else if (cb + rows == n) {
        m.lm_head(rows - 1, 1, [&](int64_t, int64_t) {
          m.wait_device();
          copy_to_host(out.data(), m.logits.data(), static_cast<size_t>(vocab) * 4, m.s());
        });
      }
    }
    m.sync();
  });
  return out;
}

std::vector<float> GpuModel::prefill_batch(std::span<const PrefillSeq> seqs) {
  Impl& m = *impl_;
  const ModelConfig& c = m.config;
  if (seqs.empty()) return {};
  // Checks, all before any device work (like prefill, per sequence; then across the batch).
  for (size_t i = 0; i < seqs.size(); ++i) {
    const PrefillSeq& q = seqs[i];
    const std::string w = "prefill_batch: sequence " + num(static_cast<int64_t>(i));
    FT_CHECK(!q.tokens.empty(), w + " has no tokens");
    m.check_tokens(q.tokens, q.positions, q.slots, w.c_str());
    const int64_t n = static_cast<int64_t>(q.tokens.size()), ctx = static_cast<int64_t>(q.context_slots.size());
    FT_CHECK(c.sliding_window == 0 || ctx + n <= c.sliding_window,
             w + ": context of " + num(ctx + n) + " tokens exceeds the sliding window of " + num(c.sliding_window) +
                 " (not supported)");
    FT_CHECK(n + ctx <= INT32_MAX - 64, w + ": too many tokens");
    for (int64_t k = 0; k < ctx; ++k) {
      const int32_t s = q.context_slots[static_cast<size_t>(k)];
      FT_CHECK(s >= 0 && s < m.num_slots, w + ": context slot " + num(s) + " (index " + num(k) + ") out of range [0, " +
                                              num(m.num_slots) + ")");
    }
    if (ctx > 0) m.check_distinct(q.context_slots, q.slots, w);
  }
  check_prefill_batch_slots(seqs, m.num_slots, m.slot_writer);

  // Pieces of sequences, packed into chunks of at most prefill_chunk rows.
  struct Piece {
    int32_t seq, a, b;
  };
  const int64_t chunk = m.options.prefill_chunk;
  std::vector<std::vector<Piece>> chunks(1);
  int64_t fill = 0;
  for (size_t i = 0; i < seqs.size(); ++i) {
    const int32_t n = static_cast<int32_t>(seqs[i].tokens.size());
    for (int32_t a = 0; a < n;) {
      if (fill == chunk) {
        chunks.emplace_back();
        fill = 0;
      }
      const int32_t b = static_cast<int32_t>(std::min<int64_t>(n, a + (chunk - fill)));
      chunks.back().push_back({static_cast<int32_t>(i), a, b});
      fill += b - a;
      a = b;
    }
  }

  const int64_t vocab = c.vocab_size, h = c.hidden_size;
  std::vector<float> out(seqs.size() * static_cast<size_t>(vocab));
  m.guarded([&] {
    m.reduce_index = 0;
    m.marking = false;
    const float scale = c.attn_shape().default_sm_scale();
    std::vector<int32_t> tok, pos, slt, keys, seq_rows, seq_keys, ends;
    for (size_t ci = 0; ci < chunks.size(); ++ci) {
      const std::vector<Piece>& pieces = chunks[ci];
      tok.clear(), pos.clear(), slt.clear(), keys.clear(), ends.clear();
      seq_rows.assign(1, 0);
      seq_keys.assign(1, 0);
      int32_t first_end_seq = -1;
      for (const Piece& pc : pieces) {
        const PrefillSeq& q = seqs[static_cast<size_t>(pc.seq)];
        tok.insert(tok.end(), q.tokens.begin() + pc.a, q.tokens.begin() + pc.b);
        pos.insert(pos.end(), q.positions.begin() + pc.a, q.positions.begin() + pc.b);
        slt.insert(slt.end(), q.slots.begin() + pc.a, q.slots.begin() + pc.b);
        keys.insert(keys.end(), q.context_slots.begin(), q.context_slots.end());
        keys.insert(keys.end(), q.slots.begin(), q.slots.begin() + pc.b);
        seq_rows.push_back(static_cast<int32_t>(tok.size()));
        seq_keys.push_back(static_cast<int32_t>(keys.size()));
        if (pc.b == static_cast<int32_t>(q.tokens.size())) {  // the sequence ends here: its last row's logits
          if (first_end_seq < 0) first_end_seq = pc.seq;
          ends.push_back(static_cast<int32_t>(tok.size()) - 1);
        }
      }
      const std::vector<int32_t> blocks = cuda_ops::prefill_varlen_blocks(seq_rows, seq_keys);
      const int rows = static_cast<int>(tok.size());
      if (ci > 0) m.sync();  // the staging buffers of the previous chunk are free again
      m.ensure_rows(rows, static_cast<int64_t>(ends.size()));
      const int32_t* d = m.upload_ints({tok, pos, slt, keys, seq_rows, seq_keys, blocks, ends});
      const int32_t* d_pos = d + rows;
      const int32_t* d_slots = d + 2 * rows;
      const int32_t* d_keys = d + 3 * rows;
      const int32_t* d_seq_rows = d_keys + keys.size();
      const int32_t* d_seq_keys = d_seq_rows + seq_rows.size();
      const int32_t* d_blocks = d_seq_keys + seq_keys.size();
      const int32_t* d_ends = d_blocks + blocks.size();
      cuda_ops::PrefillVarlen v;
      v.seq_rows = seq_rows.data();
      v.seq_keys = seq_keys.data();
      v.blocks = blocks.data();
      v.num_seqs = static_cast<int>(pieces.size());
      v.num_blocks = static_cast<int>(blocks.size() / 2);
      v.d_seq_rows = d_seq_rows;
      v.d_seq_keys = d_seq_keys;
      v.d_blocks = d_blocks;
      cuda_ops::embed(d, rows, m.weights.embed, vocab, h, m.resid.as<float>(), m.s());
      m.run_layers(rows, d_pos, d_slots, [&](int l) {
        cuda_ops::prefill_attention_varlen(m.q.as<uint16_t>(), m.k_pool(l), m.v_pool(l), d_keys, v,
                                           c.num_attention_heads, c.num_key_value_heads, m.dk, scale,
                                           m.attn.as<uint16_t>(), m.s());
      });
      if (ends.empty()) continue;
      // Final norm of every row, then the LM head on the gathered rows that end a sequence (the ends
      // of one chunk belong to consecutive sequences from first_end_seq on).
      cuda_ops::add_rms_norm(m.resid.as<float>(), m.delta_f32(), m.weights.final_norm,
                             static_cast<float>(c.rms_norm_eps), rows, h, m.x.as<uint16_t>(), m.s());
      m.x_last.reserve(static_cast<size_t>(kMaxLogitRows * h) * 2);
      const int64_t num_ends = static_cast<int64_t>(ends.size());
      for (int64_t r = 0; r < num_ends; r += kMaxLogitRows) {
        const int64_t mr = std::min<int64_t>(kMaxLogitRows, num_ends - r);
        cuda_ops::gather_rows_bf16(m.x.as<uint16_t>(), d_ends + r, static_cast<int>(mr), h, m.x_last.as<uint16_t>(), m.s());
        m.gemm.linear(m.x_last.as<uint16_t>(), m.weights.lm_head, mr, vocab, h, m.logits.as<float>());
        m.wait_device();  // the copy to pageable memory blocks the host
        copy_to_host(out.data() + (first_end_seq + r) * vocab, m.logits.data(), static_cast<size_t>(mr * vocab) * 4, m.s());
      }
    }
    m.sync();
  });
  return out;
}

}  // namespace fasttree
