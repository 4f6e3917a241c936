// Public launchers of cuda/engine_ops.h: every argument is checked on the host BEFORE any CUDA call
// (so bad shapes throw fasttree::Error even without a device), n == 0 (count == 0) is a no-op, then
// the raw launcher (engine_ops_launch.h) runs and a launch error throws naming the kernel.
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <string>

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

}  // namespace fasttree::cuda_ops
