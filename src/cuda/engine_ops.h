// Host-side launchers of the engine's fused elementwise kernels and the prefill attention kernel
// (engine_ops.cu, prefill_attention.cu). No CUDA header here: streams are CUstream_st*
// (= cudaStream_t); bf16 tensors are uint16_t (the upper half of an fp32, core/half.h). Every
// launcher enqueues on `stream` and throws fasttree::Error (naming the kernel and the CUDA error)
// when the launch fails; shapes are checked on the host (non-positive sizes, head_dim not even, ...).
// Pointers are device memory. Row-major everywhere; n = number of token rows.
//
// The model's data flow per layer (engine/gpu_model.h):
//   resid fp32 [n, h] --add_rms_norm--> x bf16 [n, h] --GEMM--> qkv fp32 [n, qd + 2 kvd]
//   --rope_qkv_append--> q bf16 [n, Hq, d] (+ K/V rows written into the pool at `slots`)
//   --attention--> o (decode: fp32 [n, Hq, d] -> f32_to_bf16; prefill: bf16) --GEMM--> delta fp32 [n, h]
//   --add_rms_norm (resid += delta)--> x bf16 --GEMM--> gate_up bf16 [n, 2I] --silu_mul--> act bf16 [n, I]
//   --GEMM--> delta fp32 [n, h] --> next layer's add_rms_norm
#pragma once
#include <cstdint>
#include <span>
#include <vector>

struct CUstream_st;

namespace fasttree::cuda_ops {

using Stream = CUstream_st*;

// resid[i, :] = fp32(table[tokens[i], :]) for i < n. table bf16 [vocab, h]. Token ids are checked
// by the caller (out-of-range ids are clamped to 0 here, never read out of bounds).
void embed(const int32_t* tokens, int n, const uint16_t* table, int64_t vocab, int64_t h, float* resid, Stream stream);

// HF LlamaRMSNorm with an optional residual add first:
//   if delta: resid += delta (fp32, in place)
//   out = bf16(weight * (resid / sqrt(mean(resid²) + eps)))      (fp32 math, bf16 weight)
// resid fp32 [n, h], delta fp32 [n, h] or nullptr, weight bf16 [h], out bf16 [n, h].
void add_rms_norm(float* resid, const float* delta, const uint16_t* weight, float eps, int n, int64_t h,
                  uint16_t* out, Stream stream);

// qkv fp32 [n, (Hq + 2 Hkv) * d]: row i = [q heads | k heads | v heads] (the fused QKV GEMM output).
// bias fp32 [(Hq + 2 Hkv) * d] or nullptr (added first). RoPE (rotate_half convention of
// engine/rope.h, angle = float(inv_freq[j] * positions[i]), precise cosf/sinf) on q and k, then:
//   q_out[i, hq, :]        = bf16(rope(q))
//   k_pool[slots[i], hk, :] = bf16(rope(k)),  v_pool[slots[i], hk, :] = bf16(v)
// inv_freq fp32 [d / 2] (device). k_pool / v_pool bf16 [num_slots, Hkv, d] (one layer); slots are
// checked by the caller.
void rope_qkv_append(const float* qkv, const float* bias, const int32_t* positions, const int32_t* slots, int n,
                     int num_q_heads, int num_kv_heads, int head_dim, const float* inv_freq, uint16_t* q_out,
                     uint16_t* k_pool, uint16_t* v_pool, Stream stream);

// SwiGLU: gate_up bf16 [n, 2 I] (row = [gate | up]) -> out bf16 [n, I] = silu(gate) * up, fp32 math.
void silu_mul(const uint16_t* gate_up, int n, int64_t inter, uint16_t* out, Stream stream);

// x fp32 [n, dim] += bias fp32 [dim] (broadcast over rows).
void add_bias(float* x, const float* bias, int n, int64_t dim, Stream stream);

// out bf16 [count] = bf16(x fp32 [count]), round to nearest even.
void f32_to_bf16(const float* x, int64_t count, uint16_t* out, Stream stream);

// out[i] = argmax_j logits[i, j] (lowest j on exact ties, NaN never wins), logits fp32 [n, vocab].
void argmax_rows(const float* logits, int n, int64_t vocab, int32_t* out, Stream stream);

// Deterministic pseudo-random bf16 values uniform in [lo, hi): value k depends only on (seed, k)
// (a counter-based hash), so random weights need no host memory.
void fill_uniform_bf16(uint16_t* data, int64_t count, float lo, float hi, uint64_t seed, Stream stream);

// Causal prefill attention of n new tokens over a gathered key list (one layer):
//   key_slots int32 [num_keys]: the cached context's slots, then the n new tokens' slots (their K/V
//   already written by rope_qkv_append), so query i sees keys [0, num_keys - n + i] (inclusive).
//   q bf16 [n, Hq, d]; k_pool / v_pool bf16 [num_slots, Hkv, d]; out bf16 [n, Hq, d].
//   GQA: q head h reads kv head h / (Hq / Hkv). fp32 online softmax, tensor cores where it pays.
// head_dim 64, 128 or 256. n <= num_keys. sm_scale as given (the caller passes 1/sqrt(d)).
void prefill_attention(const uint16_t* q, const uint16_t* k_pool, const uint16_t* v_pool, const int32_t* key_slots,
                       int64_t num_keys, int n, int num_q_heads, int num_kv_heads, int head_dim, float sm_scale,
                       uint16_t* out, Stream stream);

// Batched (varlen) causal prefill attention: S sequences packed row-wise in q / out, each with the
// contract of prefill_attention for its own rows and keys. Host arrays (validated here) and their
// device copies (same values; the kernel reads those):
//   seq_rows [S + 1]   sequence s owns rows [seq_rows[s], seq_rows[s+1]) of q / out; seq_rows[0] = 0,
//                      non-decreasing (empty sequences allowed); n = seq_rows[S] rows in all.
//   seq_keys [S + 1]   its keys are key_slots[seq_keys[s] .. seq_keys[s+1]) (context, then its own
//                      new tokens' slots), at least as many as its rows; seq_keys[0] = 0.
//   blocks [2 B]       (sequence, first row within it) of every kPrefillBlockRows-row query block:
//                      prefill_varlen_blocks() builds them, heaviest first.
// simple = true runs the fp32 one-warp-per-(query, head) kernel instead (tests, second opinion).
inline constexpr int kPrefillBlockRows = 64;
struct PrefillVarlen {
  const int32_t* seq_rows = nullptr;    // host [S + 1]
  const int32_t* seq_keys = nullptr;    // host [S + 1]
  const int32_t* blocks = nullptr;      // host [2 B]
  int num_seqs = 0;                     // S
  int num_blocks = 0;                   // B
  const int32_t* d_seq_rows = nullptr;  // device copies of the three arrays
  const int32_t* d_seq_keys = nullptr;
  const int32_t* d_blocks = nullptr;
};
// Blocks of prefill_attention_varlen for these sequences, heaviest (most keys) first: [2 B].
std::vector<int32_t> prefill_varlen_blocks(std::span<const int32_t> seq_rows, std::span<const int32_t> seq_keys);
void prefill_attention_varlen(const uint16_t* q, const uint16_t* k_pool, const uint16_t* v_pool,
                              const int32_t* key_slots, const PrefillVarlen& v, int num_q_heads, int num_kv_heads,
                              int head_dim, float sm_scale, uint16_t* out, Stream stream, bool simple = false);

// out[i, :] = x[rows[i], :] for i < n: bf16 rows [*, dim] gathered by the device index list rows [n]
// (every index must be a valid row of x; the caller checks them).
void gather_rows_bf16(const uint16_t* x, const int32_t* rows, int n, int64_t dim, uint16_t* out, Stream stream);

}  // namespace fasttree::cuda_ops

namespace fasttree::cuda_ops {

// Added by the kernels' author (engine_ops_check.cpp):
// - argmax_rows writes 0 for a row whose values are all NaN.
// - prefill_attention_simple: same contract as prefill_attention, computed by a plain fp32 kernel
//   (one warp per (query, head), no tensor cores; ~10x slower). The fallback when the tensor-core
//   kernel is suspected, and a second opinion in tests. head_dim a multiple of 32, at most 256.
void prefill_attention_simple(const uint16_t* q, const uint16_t* k_pool, const uint16_t* v_pool,
                              const int32_t* key_slots, int64_t num_keys, int n, int num_q_heads, int num_kv_heads,
                              int head_dim, float sm_scale, uint16_t* out, Stream stream);

}  // namespace fasttree::cuda_ops
