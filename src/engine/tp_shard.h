// Tensor-parallel sharding of a Llama-family model (Megatron-style): what rank `rank` of `tp` ranks
// owns, and its slice of the weights. HF layouts are [out, in] (engine/weights.h); d = head_dim.
//
//   attention   column-parallel q/k/v: rank r owns qo heads [r·Hq/tp, (r+1)·Hq/tp) -> rows
//               [q_head_begin·d, +num_q_heads·d) of q_proj (and of its bias), and its kv heads ->
//               the same row blocks of k_proj / v_proj. Row-parallel o_proj: the columns of o_proj
//               that read the rank's qo heads, [q_head_begin·d, +num_q_heads·d).
//   MLP         column-parallel gate/up: rows [r·I/tp, (r+1)·I/tp); row-parallel down: the same
//               columns of down_proj.
//   combine     after each row-parallel GEMM (o_proj, down_proj) every rank holds a partial
//               y_r [n, h] with Σ_r y_r = the unsharded output; an all-reduce (sum) gives every
//               rank the full y before the residual add. A bias added after a row-parallel GEMM
//               (o_proj's, llama with attention_bias) lives on rank 0 only, so the sum counts it
//               exactly once (down_proj has no bias: mlp_bias is rejected by ModelConfig).
//   replicated  embedding, norms, final norm and lm_head are whole on every rank: at these vocab
//               sizes (32k-128k x h) an all-gather of a vocab-sharded lm_head costs a collective
//               per step whose latency exceeds the GEMM time it saves on one node; every rank
//               computes identical logits. (A decision to re-measure on the GPU.)
//
// Head counts: Hq must be a multiple of tp. KV heads are partitioned when Hkv % tp == 0
// (rank r owns kv heads [r·Hkv/tp, (r+1)·Hkv/tp)); when tp > Hkv and tp % Hkv == 0 they are
// replicated instead: each rank holds the ONE kv head its qo heads read (kv head r / (tp/Hkv)),
// shared by tp/Hkv ranks, and keeps its own copy of that head's K/V. Any other combination, an
// intermediate size not divisible by tp, tp < 1 or a rank outside [0, tp) throws fasttree::Error.
// GQA stays consistent: qo head h reads kv head h / (Hq/Hkv) globally and local head h - q_head_begin
// reads local kv head (h - q_head_begin) / (local Hq / local Hkv).
#pragma once
#include <cstdint>
#include <span>
#include <string_view>

#include "engine/model_config.h"
#include "engine/weights.h"

namespace fasttree {

struct TpShard {
  int rank = 0;
  int size = 1;                // tp
  int head_dim = 0;
  int q_head_begin = 0;        // qo heads [q_head_begin, q_head_begin + num_q_heads)
  int num_q_heads = 0;
  int kv_head_begin = 0;       // kv heads [kv_head_begin, kv_head_begin + num_kv_heads) held by the rank
  int num_kv_heads = 0;
  int kv_replicas = 1;         // ranks holding each of these kv heads (1: partitioned, tp/Hkv: replicated)
  int64_t inter_begin = 0;     // intermediate columns [inter_begin, inter_begin + inter_size)
  int64_t inter_size = 0;

  // Rows of q_proj (columns of o_proj) and rows of k_proj / v_proj the rank owns.
  int64_t q_row_begin() const { return int64_t{q_head_begin} * head_dim; }
  int64_t q_rows() const { return int64_t{num_q_heads} * head_dim; }
  int64_t kv_row_begin() const { return int64_t{kv_head_begin} * head_dim; }
  int64_t kv_rows() const { return int64_t{num_kv_heads} * head_dim; }
};

// Throws fasttree::Error (naming the sizes) unless `config` can be split over tp ranks (see above).
void check_tp(const ModelConfig& config, int tp);

// Rank `rank`'s share of the model; checks as check_tp plus 0 <= rank < tp.
TpShard tp_shard(const ModelConfig& config, int rank, int tp);

// The config of one rank's slice: num_attention_heads, num_key_value_heads and intermediate_size
// are the rank's (the same on every rank); hidden, vocab, layers, RoPE etc. unchanged.
ModelConfig tp_local_config(const ModelConfig& config, int tp);

// The block of a checkpoint tensor (HF name, whole-model shape [out, in] or [n]) that `shard`
// holds: rows [row_begin, row_begin + rows) x columns [col_begin, col_begin + cols), or, with zeros,
// a zero tensor of that shape (o_proj's bias off rank 0). Replicated tensors give the whole tensor.
// A loader reads just this block from the mmap'd checkpoint (row blocks are contiguous, column
// blocks have row pitch shape[1]), so no rank ever holds the whole model. Throws for a name that
// is not a Llama-family tensor or a shape that disagrees with the shard (head or column counts).
struct TpBlock {
  int64_t row_begin = 0, rows = 0;
  int64_t col_begin = 0, cols = 1;
  bool zeros = false;
};
TpBlock tp_block(const TpShard& shard, std::string_view name, std::span<const int64_t> shape);

// Rank `rank`'s weights with config = tp_local_config(w.config, tp): row blocks of q/k/v (+ biases)
// and gate/up, column blocks of o_proj and down_proj, o_proj's bias on rank 0 only (the other
// ranks get zeros, so the shard is a valid model of the local config), embedding / norms / lm_head
// copied whole. Throws when a tensor's size disagrees with w.config.
ModelWeights shard_weights(const ModelWeights& w, int rank, int tp);

}  // namespace fasttree
