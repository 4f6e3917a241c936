// Raw launchers of the engine kernels (engine_ops.cu, prefill_attention.cu). No CUDA header: each
// returns the cudaError_t of the launch as int (0 = success); streams are CUstream_st*. They assume
// shapes already validated by the public wrappers in cuda/engine_ops.h (engine_ops_check.cpp), which
// own all argument checking and error reporting.
#pragma once
#include <cstdint>

struct CUstream_st;

namespace fasttree::cuda_detail {

int embed_launch(const int32_t* tokens, int n, const uint16_t* table, int64_t vocab, int64_t h, float* resid,
                 CUstream_st* stream);
int add_rms_norm_launch(float* resid, const float* delta, const uint16_t* weight, float eps, int n, int64_t h,
                        uint16_t* out, CUstream_st* stream);
int rope_qkv_append_launch(const float* qkv, const float* bias, const int32_t* positions, const int32_t* slots, int n,
                           int num_q_heads, int num_kv_heads, int head_dim, const float* inv_freq, uint16_t* q_out,
                           uint16_t* k_pool, uint16_t* v_pool, CUstream_st* stream);
int silu_mul_launch(const uint16_t* gate_up, int n, int64_t inter, uint16_t* out, CUstream_st* stream);
int add_bias_launch(float* x, const float* bias, int n, int64_t dim, CUstream_st* stream);
int f32_to_bf16_launch(const float* x, int64_t count, uint16_t* out, CUstream_st* stream);
int argmax_rows_launch(const float* logits, int n, int64_t vocab, int32_t* out, CUstream_st* stream);
int gather_rows_bf16_launch(const uint16_t* x, const int32_t* rows, int n, int64_t dim, uint16_t* out,
                            CUstream_st* stream);
int fill_uniform_bf16_launch(uint16_t* data, int64_t count, float lo, float hi, uint64_t seed, CUstream_st* stream);

// Prefill attention (prefill_attention.cu): the tensor-core kernel (head_dim 64/128/256) and the
// simple one-warp-per-(query, head) fp32 kernel (any head_dim that is a multiple of 32, <= 256).
struct PrefillParams {
  const uint16_t* q;         // bf16 [n, Hq, d]
  const uint16_t* k_pool;    // bf16 [num_slots, Hkv, d]
  const uint16_t* v_pool;    // bf16 [num_slots, Hkv, d]
  const int32_t* key_slots;  // [num_keys]
  int64_t num_keys;
  int n;
  int num_q_heads;
  int num_kv_heads;
  int head_dim;
  float sm_scale;
  uint16_t* out;  // bf16 [n, Hq, d]
  // Batched (varlen) form when blocks != nullptr (cuda/engine_ops.h prefill_attention_varlen):
  // sequence s owns rows [seq_rows[s], seq_rows[s+1]) of q / out and keys key_slots[seq_keys[s] ..
  // seq_keys[s+1]); grid.y = num_blocks 64-row query blocks (sequence, first row) = blocks[2 b ..];
  // n = all rows, num_keys = all keys. Device arrays.
  const int32_t* seq_rows = nullptr;
  const int32_t* seq_keys = nullptr;
  const int32_t* blocks = nullptr;
  int num_seqs = 0;
  int num_blocks = 0;
};
int prefill_attention_launch(const PrefillParams& p, CUstream_st* stream);
int prefill_attention_simple_launch(const PrefillParams& p, CUstream_st* stream);

}  // namespace fasttree::cuda_detail
