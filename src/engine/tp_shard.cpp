#include "engine/tp_shard.h"

#include <algorithm>
#include <string>
#include <vector>

#include "core/error.h"

namespace fasttree {

namespace {

std::string str(int64_t v) { return std::to_string(v); }

void check_size(const std::vector<float>& t, int64_t numel, const std::string& name) {
  FT_CHECK(t.size() == static_cast<size_t>(numel), "shard_weights: " + name + " holds " + str(static_cast<int64_t>(t.size())) +
                                                       " floats, the config implies " + str(numel));
}

// Rows [begin, begin + count) of w [rows, cols] -> [count, cols].
std::vector<float> row_block(const std::vector<float>& w, int64_t rows, int64_t cols, int64_t begin, int64_t count,
                             const std::string& name) {
  check_size(w, rows * cols, name);
  return std::vector<float>(w.begin() + begin * cols, w.begin() + (begin + count) * cols);
}

// Columns [begin, begin + count) of w [rows, cols] -> [rows, count].
std::vector<float> col_block(const std::vector<float>& w, int64_t rows, int64_t cols, int64_t begin, int64_t count,
                             const std::string& name) {
  check_size(w, rows * cols, name);
  std::vector<float> out(static_cast<size_t>(rows * count));
  for (int64_t r = 0; r < rows; ++r)
    std::copy_n(w.begin() + r * cols + begin, count, out.begin() + r * count);
  return out;
}

}  // namespace

void check_tp(const ModelConfig& c, int tp) {
  FT_CHECK(tp >= 1, "tensor parallelism: tp must be at least 1, got " + str(tp));
  const int hq = c.num_attention_heads, hkv = c.num_key_value_heads;
  FT_CHECK(hq > 0 && hkv > 0 && c.head_dim > 0 && c.intermediate_size > 0,
           "tensor parallelism: the config has no heads or no intermediate size");
  FT_CHECK(hq % tp == 0, "tensor parallelism: " + str(hq) + " attention heads cannot be split over tp " + str(tp) +
                             " ranks (num_attention_heads must be a multiple of tp)");
  FT_CHECK(hkv % tp == 0 || tp % hkv == 0,
           "tensor parallelism: " + str(hkv) + " kv heads cannot be split over tp " + str(tp) +
               " ranks (num_key_value_heads must be a multiple of tp, or tp a multiple of it to replicate them)");
  FT_CHECK(c.intermediate_size % tp == 0, "tensor parallelism: intermediate_size " + str(c.intermediate_size) +
                                              " is not a multiple of tp " + str(tp));
}

TpShard tp_shard(const ModelConfig& c, int rank, int tp) {
  check_tp(c, tp);
  FT_CHECK(rank >= 0 && rank < tp, "tensor parallelism: rank " + str(rank) + " outside [0, " + str(tp) + ")");
  TpShard s;
  s.rank = rank;
  s.size = tp;
  s.head_dim = c.head_dim;
  s.num_q_heads = c.num_attention_heads / tp;
  s.q_head_begin = rank * s.num_q_heads;
  const int hkv = c.num_key_value_heads;
  if (hkv % tp == 0) {
    s.num_kv_heads = hkv / tp;
    s.kv_head_begin = rank * s.num_kv_heads;
    s.kv_replicas = 1;
  } else {  // tp % hkv == 0: one replicated kv head, the one this rank's qo heads read
    s.kv_replicas = tp / hkv;
    s.num_kv_heads = 1;
    s.kv_head_begin = rank / s.kv_replicas;
  }
  s.inter_size = c.intermediate_size / tp;
  s.inter_begin = rank * s.inter_size;
  return s;
}

ModelConfig tp_local_config(const ModelConfig& c, int tp) {
  const TpShard s = tp_shard(c, 0, tp);
  ModelConfig local = c;
  local.num_attention_heads = s.num_q_heads;
  local.num_key_value_heads = s.num_kv_heads;
  local.intermediate_size = s.inter_size;
  return local;
}

TpBlock tp_block(const TpShard& s, std::string_view name, std::span<const int64_t> shape) {
  const std::string nm(name);
  FT_CHECK(shape.size() == 1 || shape.size() == 2, "tp_block: tensor '" + nm + "' has rank " + str(static_cast<int64_t>(shape.size())));
  const int64_t rows = shape[0], cols = shape.size() == 2 ? shape[1] : 1;
  auto ends = [&](std::string_view suffix) {
    return name.size() >= suffix.size() && name.substr(name.size() - suffix.size()) == suffix;
  };
  TpBlock b;
  b.rows = rows;
  b.cols = cols;
  auto row_split = [&](int64_t begin, int64_t count, int64_t total) {
    FT_CHECK(rows == total, "tp_block: tensor '" + nm + "' has " + str(rows) + " rows, the shard expects " + str(total));
    b.row_begin = begin;
    b.rows = count;
  };
  auto col_split = [&](int64_t begin, int64_t count, int64_t total) {
    FT_CHECK(shape.size() == 2 && cols == total,
             "tp_block: tensor '" + nm + "' has " + str(cols) + " columns, the shard expects " + str(total));
    b.col_begin = begin;
    b.cols = count;
  };
  const int64_t qd = int64_t{s.num_q_heads} * s.size * s.head_dim;
  const int64_t kvd = int64_t{s.num_kv_heads} * s.size / s.kv_replicas * s.head_dim;
  const int64_t inter = s.inter_size * s.size;
  if (ends(".self_attn.q_proj.weight") || ends(".self_attn.q_proj.bias")) {
    row_split(s.q_row_begin(), s.q_rows(), qd);
  } else if (ends(".self_attn.k_proj.weight") || ends(".self_attn.k_proj.bias") || ends(".self_attn.v_proj.weight") ||
             ends(".self_attn.v_proj.bias")) {
    row_split(s.kv_row_begin(), s.kv_rows(), kvd);
  } else if (ends(".self_attn.o_proj.weight")) {
    col_split(s.q_row_begin(), s.q_rows(), qd);
  } else if (ends(".self_attn.o_proj.bias")) {
    b.zeros = s.rank != 0;  // added after the all-reduce's inputs: counted once, on rank 0
  } else if (ends(".mlp.gate_proj.weight") || ends(".mlp.up_proj.weight")) {
    row_split(s.inter_begin, s.inter_size, inter);
  } else if (ends(".mlp.down_proj.weight")) {
    col_split(s.inter_begin, s.inter_size, inter);
  } else {
    FT_CHECK(ends("_layernorm.weight") || name == "model.embed_tokens.weight" || name == "model.norm.weight" ||
                 name == "lm_head.weight",
             "tp_block: '" + nm + "' is not a tensor of a Llama-family model");
  }
  return b;
}

ModelWeights shard_weights(const ModelWeights& w, int rank, int tp) {
  const ModelConfig& c = w.config;
  const TpShard s = tp_shard(c, rank, tp);
  FT_CHECK(w.layers.size() == static_cast<size_t>(c.num_hidden_layers),
           "shard_weights: " + str(static_cast<int64_t>(w.layers.size())) + " layers, the config has " +
               str(c.num_hidden_layers));
  const int64_t h = c.hidden_size, qd = c.q_dim(), kvd = c.kv_dim(), inter = c.intermediate_size;
  ModelWeights out;
  out.config = tp_local_config(c, tp);
  check_size(w.embed, c.vocab_size * h, "embed");
  out.embed = w.embed;
  check_size(w.final_norm, h, "final_norm");
  out.final_norm = w.final_norm;
  if (!c.tie_word_embeddings) {
    check_size(w.lm_head, c.vocab_size * h, "lm_head");
    out.lm_head = w.lm_head;
  }
  out.layers.resize(w.layers.size());
  for (size_t l = 0; l < w.layers.size(); ++l) {
    const LayerWeights& src = w.layers[l];
    LayerWeights& dst = out.layers[l];
    const std::string p = "layer " + str(static_cast<int64_t>(l)) + " ";
    check_size(src.input_norm, h, p + "input_norm");
    check_size(src.post_norm, h, p + "post_norm");
    dst.input_norm = src.input_norm;
    dst.post_norm = src.post_norm;
    // Column-parallel: row blocks.
    dst.wq = row_block(src.wq, qd, h, s.q_row_begin(), s.q_rows(), p + "q_proj");
    dst.wk = row_block(src.wk, kvd, h, s.kv_row_begin(), s.kv_rows(), p + "k_proj");
    dst.wv = row_block(src.wv, kvd, h, s.kv_row_begin(), s.kv_rows(), p + "v_proj");
    if (c.attention_bias) {
      dst.bq = row_block(src.bq, qd, 1, s.q_row_begin(), s.q_rows(), p + "q_proj bias");
      dst.bk = row_block(src.bk, kvd, 1, s.kv_row_begin(), s.kv_rows(), p + "k_proj bias");
      dst.bv = row_block(src.bv, kvd, 1, s.kv_row_begin(), s.kv_rows(), p + "v_proj bias");
    }
    dst.w_gate = row_block(src.w_gate, inter, h, s.inter_begin, s.inter_size, p + "gate_proj");
    dst.w_up = row_block(src.w_up, inter, h, s.inter_begin, s.inter_size, p + "up_proj");
    // Row-parallel: column blocks; a bias after the GEMM counts once, on rank 0.
    dst.wo = col_block(src.wo, h, qd, s.q_row_begin(), s.q_rows(), p + "o_proj");
    dst.w_down = col_block(src.w_down, h, inter, s.inter_begin, s.inter_size, p + "down_proj");
    if (c.o_proj_bias()) {
      check_size(src.bo, h, p + "o_proj bias");
      dst.bo = rank == 0 ? src.bo : std::vector<float>(static_cast<size_t>(h), 0.0f);
    }
  }
  return out;
}

}  // namespace fasttree
