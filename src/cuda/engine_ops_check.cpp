// Public launchers of cuda/engine_ops.h: every argument is checked on the host BEFORE any CUDA call
// (so bad shapes throw fasttree::Error even without a device), n == 0 (count == 0) is a no-op, then
// the raw launcher (engine_ops_launch.h) runs and a launch error throws naming the kernel.
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "core/error.h"
#include "cuda/engine_ops.h"
#include "cuda/engine_ops_launch.h"

namespace fasttree::cuda_ops {
namespace {

using namespace cuda_detail;

std::string str(int64_t x) { return std::to_string(x); }

// Throws naming `op` when cond is false.
void check(bool cond, const char* op, const std::string& what) {
  if (!cond) throw_error(std::string("cuda_ops::") + op + ": " + what, __FILE__, __LINE__);
}

// Row count: negative is an error; returns false (nothing to do) for 0.
bool rows(int64_t n, const char* op, const char* name = "n") {
  check(n >= 0, op, std::string(name) + " = " + str(n) + " is negative");
  return n > 0;
}

void positive(int64_t x, const char* op, const char* name) {
  check(x > 0, op, std::string(name) + " = " + str(x) + " must be positive");
}

void non_null(const void* p, const char* op, const char* name) {
  check(p != nullptr, op, std::string(name) + " is a null pointer");
}

// Element count of a [rows, cols] tensor must fit int64 (and our index arithmetic).
void fits(int64_t rows_, int64_t cols, const char* op) {
  check(cols <= (INT64_MAX / 4) / std::max<int64_t>(rows_, 1), op,
        "tensor of " + str(rows_) + " x " + str(cols) + " elements is too large");
}

void launched(int err, const char* op) {
  if (err != cudaSuccess) {
    const auto e = static_cast<cudaError_t>(err);
    throw_error(std::string("cuda_ops::") + op + ": kernel launch failed: " + cudaGetErrorName(e) + " (" +
                    cudaGetErrorString(e) + ")",
                __FILE__, __LINE__);
  }
}

void check_prefill(const uint16_t* q, const uint16_t* k_pool, const uint16_t* v_pool, const int32_t* key_slots,
                   int64_t num_keys, int n, int num_q_heads, int num_kv_heads, int head_dim, float sm_scale,
                   const uint16_t* out, const char* op) {
  positive(num_q_heads, op, "num_q_heads");
  positive(num_kv_heads, op, "num_kv_heads");
  check(num_q_heads % num_kv_heads == 0, op,
        "num_q_heads " + str(num_q_heads) + " is not a multiple of num_kv_heads " + str(num_kv_heads));
  check(num_q_heads <= 65535, op, "num_q_heads " + str(num_q_heads) + " exceeds 65535");
  check(num_keys >= n, op, "num_keys " + str(num_keys) + " < n " + str(n) + " (the new tokens are keys too)");
  check(num_keys <= INT_MAX - 64, op, "num_keys " + str(num_keys) + " is too large");
  check(std::isfinite(sm_scale), op, "sm_scale is not finite");
  fits(static_cast<int64_t>(n) * num_q_heads, head_dim, op);
  non_null(q, op, "q");
  non_null(k_pool, op, "k_pool");
  non_null(v_pool, op, "v_pool");
  non_null(key_slots, op, "key_slots");
  non_null(out, op, "out");
}

}  // namespace

void embed(const int32_t* tokens, int n, const uint16_t* table, int64_t vocab, int64_t h, float* resid, Stream stream) {
  const char* op = "embed";
  if (!rows(n, op)) return;
  positive(vocab, op, "vocab");
  positive(h, op, "h");
  fits(std::max<int64_t>(n, vocab), h, op);
  non_null(tokens, op, "tokens");
  non_null(table, op, "table");
  non_null(resid, op, "resid");
  launched(embed_launch(tokens, n, table, vocab, h, resid, stream), op);
}

void add_rms_norm(float* resid, const float* delta, const uint16_t* weight, float eps, int n, int64_t h,
                  uint16_t* out, Stream stream) {
  const char* op = "add_rms_norm";
  if (!rows(n, op)) return;
  positive(h, op, "h");
  fits(n, h, op);
  check(std::isfinite(eps) && eps >= 0.0f, op, "eps must be finite and non-negative");
  non_null(resid, op, "resid");
  non_null(weight, op, "weight");
  non_null(out, op, "out");
  launched(add_rms_norm_launch(resid, delta, weight, eps, n, h, out, stream), op);
}

void rope_qkv_append(const float* qkv, const float* bias, const int32_t* positions, const int32_t* slots, int n,
                     int num_q_heads, int num_kv_heads, int head_dim, const float* inv_freq, uint16_t* q_out,
                     uint16_t* k_pool, uint16_t* v_pool, Stream stream) {
  const char* op = "rope_qkv_append";
  if (!rows(n, op)) return;
  positive(num_q_heads, op, "num_q_heads");
  positive(num_kv_heads, op, "num_kv_heads");
  positive(head_dim, op, "head_dim");
  check(head_dim % 2 == 0, op, "head_dim " + str(head_dim) + " must be even");
  check(static_cast<int64_t>(num_q_heads + 2LL * num_kv_heads) * head_dim <= INT_MAX / 2, op,
        "row width (Hq + 2 Hkv) * d is too large");
  fits(n, static_cast<int64_t>(num_q_heads + 2LL * num_kv_heads) * head_dim, op);
  non_null(qkv, op, "qkv");
  non_null(positions, op, "positions");
  non_null(slots, op, "slots");
  non_null(inv_freq, op, "inv_freq");
  non_null(q_out, op, "q_out");
  non_null(k_pool, op, "k_pool");
  non_null(v_pool, op, "v_pool");
  launched(rope_qkv_append_launch(qkv, bias, positions, slots, n, num_q_heads, num_kv_heads, head_dim, inv_freq,
                                  q_out, k_pool, v_pool, stream),
           op);
}

void silu_mul(const uint16_t* gate_up, int n, int64_t inter, uint16_t* out, Stream stream) {
  const char* op = "silu_mul";
  if (!rows(n, op)) return;
  positive(inter, op, "inter");
  fits(n, 2 * inter, op);
  non_null(gate_up, op, "gate_up");
  non_null(out, op, "out");
  launched(silu_mul_launch(gate_up, n, inter, out, stream), op);
}

void add_bias(float* x, const float* bias, int n, int64_t dim, Stream stream) {
  const char* op = "add_bias";
  if (!rows(n, op)) return;
  positive(dim, op, "dim");
  fits(n, dim, op);
  non_null(x, op, "x");
  non_null(bias, op, "bias");
  launched(add_bias_launch(x, bias, n, dim, stream), op);
}

void f32_to_bf16(const float* x, int64_t count, uint16_t* out, Stream stream) {
  const char* op = "f32_to_bf16";
  if (!rows(count, op, "count")) return;
  fits(1, count, op);
  non_null(x, op, "x");
  non_null(out, op, "out");
  launched(f32_to_bf16_launch(x, count, out, stream), op);
}

void argmax_rows(const float* logits, int n, int64_t vocab, int32_t* out, Stream stream) {
  const char* op = "argmax_rows";
  if (!rows(n, op)) return;
  positive(vocab, op, "vocab");
  check(vocab <= INT_MAX - 1024, op, "vocab " + str(vocab) + " does not fit int32 indices");
  fits(n, vocab, op);
  non_null(logits, op, "logits");
  non_null(out, op, "out");
  launched(argmax_rows_launch(logits, n, vocab, out, stream), op);
}

void fill_uniform_bf16(uint16_t* data, int64_t count, float lo, float hi, uint64_t seed, Stream stream) {
  const char* op = "fill_uniform_bf16";
  if (!rows(count, op, "count")) return;
  fits(1, count, op);
  check(std::isfinite(lo) && std::isfinite(hi) && lo < hi, op,
        "needs finite lo < hi, got [" + std::to_string(lo) + ", " + std::to_string(hi) + ")");
  non_null(data, op, "data");
  launched(fill_uniform_bf16_launch(data, count, lo, hi, seed, stream), op);
}

void prefill_attention(const uint16_t* q, const uint16_t* k_pool, const uint16_t* v_pool, const int32_t* key_slots,
                       int64_t num_keys, int n, int num_q_heads, int num_kv_heads, int head_dim, float sm_scale,
                       uint16_t* out, Stream stream) {
  const char* op = "prefill_attention";
  if (!rows(n, op)) return;
  check(head_dim == 64 || head_dim == 128 || head_dim == 256, op,
        "head_dim " + str(head_dim) + " is not 64, 128 or 256");
  check_prefill(q, k_pool, v_pool, key_slots, num_keys, n, num_q_heads, num_kv_heads, head_dim, sm_scale, out, op);
  const PrefillParams p{q, k_pool, v_pool, key_slots, num_keys, n, num_q_heads, num_kv_heads, head_dim, sm_scale, out};
  launched(prefill_attention_launch(p, stream), op);
}

void prefill_attention_simple(const uint16_t* q, const uint16_t* k_pool, const uint16_t* v_pool,
                              const int32_t* key_slots, int64_t num_keys, int n, int num_q_heads, int num_kv_heads,
                              int head_dim, float sm_scale, uint16_t* out, Stream stream) {
  const char* op = "prefill_attention_simple";
  if (!rows(n, op)) return;
  check(head_dim > 0 && head_dim % 32 == 0 && head_dim <= 256, op,
        "head_dim " + str(head_dim) + " is not a positive multiple of 32 up to 256");
  check_prefill(q, k_pool, v_pool, key_slots, num_keys, n, num_q_heads, num_kv_heads, head_dim, sm_scale, out, op);
  const PrefillParams p{q, k_pool, v_pool, key_slots, num_keys, n, num_q_heads, num_kv_heads, head_dim, sm_scale, out};
  launched(prefill_attention_simple_launch(p, stream), op);
}

std::vector<int32_t> prefill_varlen_blocks(std::span<const int32_t> seq_rows, std::span<const int32_t> seq_keys) {
  const char* op = "prefill_varlen_blocks";
  check(!seq_rows.empty() && seq_rows.size() == seq_keys.size(), op,
        "seq_rows and seq_keys must both hold S + 1 entries (" + str(static_cast<int64_t>(seq_rows.size())) + " vs " +
            str(static_cast<int64_t>(seq_keys.size())) + ")");
  struct Block {
    int64_t last_key;
    int32_t seq, row;
  };
  std::vector<Block> blocks;
  for (size_t s = 0; s + 1 < seq_rows.size(); ++s) {
    const int32_t n = seq_rows[s + 1] - seq_rows[s];
    const int64_t ctx = int64_t{seq_keys[s + 1]} - seq_keys[s] - n;
    for (int32_t r = 0; r < n; r += kPrefillBlockRows)
      blocks.push_back({ctx + std::min(n, r + kPrefillBlockRows), static_cast<int32_t>(s), r});
  }
  std::stable_sort(blocks.begin(), blocks.end(), [](const Block& a, const Block& b) { return a.last_key > b.last_key; });
  std::vector<int32_t> out;
  out.reserve(2 * blocks.size());
  for (const Block& b : blocks) {
    out.push_back(b.seq);
    out.push_back(b.row);
  }
  return out;
}

void prefill_attention_varlen(const uint16_t* q, const uint16_t* k_pool, const uint16_t* v_pool,
                              const int32_t* key_slots, const PrefillVarlen& v, int num_q_heads, int num_kv_heads,
                              int head_dim, float sm_scale, uint16_t* out, Stream stream, bool simple) {
  const char* op = simple ? "prefill_attention_varlen(simple)" : "prefill_attention_varlen";
  check(v.num_seqs >= 0 && v.num_blocks >= 0, op, "negative sequence or block count");
  if (v.num_seqs == 0) return;
  non_null(v.seq_rows, op, "seq_rows");
  non_null(v.seq_keys, op, "seq_keys");
  non_null(v.d_seq_rows, op, "d_seq_rows");
  non_null(v.d_seq_keys, op, "d_seq_keys");
  check(v.seq_rows[0] == 0 && v.seq_keys[0] == 0, op, "seq_rows[0] and seq_keys[0] must be 0");
  std::vector<int32_t> covered(static_cast<size_t>(v.num_seqs), 0);
  for (int s = 0; s < v.num_seqs; ++s) {
    const int64_t n = int64_t{v.seq_rows[s + 1]} - v.seq_rows[s];
    const int64_t keys = int64_t{v.seq_keys[s + 1]} - v.seq_keys[s];
    check(n >= 0 && keys >= 0, op, "seq_rows / seq_keys decrease at sequence " + str(s));
    check(keys >= n, op, "sequence " + str(s) + " has " + str(keys) + " keys for " + str(n) +
                             " rows (the new tokens are keys too)");
    check(keys <= INT_MAX - 64, op, "sequence " + str(s) + " has too many keys");
  }
  const int n = v.seq_rows[v.num_seqs];
  if (n == 0) return;
  const int64_t total_keys = v.seq_keys[v.num_seqs];
  if (!simple)
    check(head_dim == 64 || head_dim == 128 || head_dim == 256, op, "head_dim " + str(head_dim) + " is not 64, 128 or 256");
  else
    check(head_dim > 0 && head_dim % 32 == 0 && head_dim <= 256, op,
          "head_dim " + str(head_dim) + " is not a positive multiple of 32 up to 256");
  check_prefill(q, k_pool, v_pool, key_slots, total_keys, n, num_q_heads, num_kv_heads, head_dim, sm_scale, out, op);
  non_null(v.blocks, op, "blocks");
  non_null(v.d_blocks, op, "d_blocks");
  for (int b = 0; b < v.num_blocks; ++b) {
    const int s = v.blocks[2 * b], r = v.blocks[2 * b + 1];
    check(s >= 0 && s < v.num_seqs, op, "block " + str(b) + " names sequence " + str(s) + " of " + str(v.num_seqs));
    check(r >= 0 && r % kPrefillBlockRows == 0 && r < v.seq_rows[s + 1] - v.seq_rows[s], op,
          "block " + str(b) + " starts at row " + str(r) + ", not a block of sequence " + str(s));
    covered[static_cast<size_t>(s)] += std::min(kPrefillBlockRows, v.seq_rows[s + 1] - v.seq_rows[s] - r);
  }
  for (int s = 0; s < v.num_seqs; ++s)
    check(covered[static_cast<size_t>(s)] == v.seq_rows[s + 1] - v.seq_rows[s], op,
          "the blocks cover " + str(covered[static_cast<size_t>(s)]) + " rows of sequence " + str(s) + ", which has " +
              str(v.seq_rows[s + 1] - v.seq_rows[s]));
  PrefillParams p{q, k_pool, v_pool, key_slots, total_keys, n, num_q_heads, num_kv_heads, head_dim, sm_scale, out};
  p.seq_rows = v.d_seq_rows;
  p.seq_keys = v.d_seq_keys;
  p.blocks = v.d_blocks;
  p.num_seqs = v.num_seqs;
  p.num_blocks = v.num_blocks;
  launched(simple ? prefill_attention_simple_launch(p, stream) : prefill_attention_launch(p, stream), op);
}

void gather_rows_bf16(const uint16_t* x, const int32_t* rows_, int n, int64_t dim, uint16_t* out, Stream stream) {
  const char* op = "gather_rows_bf16";
  if (!rows(n, op)) return;
  positive(dim, op, "dim");
  fits(n, dim, op);
  non_null(x, op, "x");
  non_null(rows_, op, "rows");
  non_null(out, op, "out");
  launched(gather_rows_bf16_launch(x, rows_, n, dim, out, stream), op);
}

}  // namespace fasttree::cuda_ops
