// Simple causal prefill attention (contract: cuda/engine_ops.h prefill_attention): one warp per
// (query, q head), lane l owns dims [l * kPer, +kPer) of head_dim = 32 * kPer. Per key: partial dot
// product, butterfly reduction, online softmax with precise expf, O update; all fp32. No tensor
// cores: the fallback and a second opinion for the tensor-core kernel (prefill_attention.cuh).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/engine_ops_launch.h"

namespace fasttree::cuda_detail {
namespace {

constexpr int kWarps = 4;

template <int kPer>
__global__ void __launch_bounds__(kWarps * 32) prefill_simple_kernel(PrefillParams p) {
  constexpr int kD = 32 * kPer;
  const int lane = threadIdx.x % 32;
  const int64_t item = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;  // query * Hq + head
  if (item >= static_cast<int64_t>(p.n) * p.num_q_heads) return;
  const int row = static_cast<int>(item / p.num_q_heads);  // row of q / out
  const int h = static_cast<int>(item - static_cast<int64_t>(row) * p.num_q_heads);
  const int kvh = h / (p.num_q_heads / p.num_kv_heads);
  // Row `row` is query i of its sequence: the whole call, or (varlen) the sequence s with
  // seq_rows[s] <= row < seq_rows[s + 1] (binary search; empty sequences are skipped over).
  int i = row;
  int64_t n = p.n, num_keys = p.num_keys;
  const int32_t* key_slots = p.key_slots;
  if (p.blocks != nullptr) {
    int lo = 0, hi = p.num_seqs - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (p.seq_rows[mid] <= row) lo = mid; else hi = mid - 1;
    }
    i = row - p.seq_rows[lo];
    n = p.seq_rows[lo + 1] - p.seq_rows[lo];
    num_keys = p.seq_keys[lo + 1] - p.seq_keys[lo];
    key_slots += p.seq_keys[lo];
  }
  const int64_t ctx = num_keys - n;
  const int64_t keys = ctx + i + 1;  // keys [0, ctx + i]

  float q[kPer], o[kPer];
  const uint16_t* qrow = p.q + item * kD + lane * kPer;
#pragma unroll
  for (int e = 0; e < kPer; ++e) {
    q[e] = __uint_as_float(static_cast<uint32_t>(qrow[e]) << 16);
    o[e] = 0.0f;
  }
  float m = -INFINITY, l = 0.0f;
  for (int64_t j0 = 0; j0 < keys; j0 += 32) {
    const int my_slot = j0 + lane < keys ? key_slots[j0 + lane] : 0;
    const int cnt = static_cast<int>(keys - j0 < 32 ? keys - j0 : 32);
    for (int jj = 0; jj < cnt; ++jj) {
      const int64_t slot = __shfl_sync(0xffffffffu, my_slot, jj);
      const int64_t base = (slot * p.num_kv_heads + kvh) * kD + lane * kPer;
      float dot = 0.0f;
#pragma unroll
      for (int e = 0; e < kPer; ++e) dot += q[e] * __uint_as_float(static_cast<uint32_t>(p.k_pool[base + e]) << 16);
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, off);
      const float s = dot * p.sm_scale;
      const float m_new = fmaxf(m, s);
      const float alpha = expf(m - m_new);  // m = -inf at the first key -> 0
      const float pe = expf(s - m_new);
      l = l * alpha + pe;
#pragma unroll
      for (int e = 0; e < kPer; ++e)
        o[e] = o[e] * alpha + pe * __uint_as_float(static_cast<uint32_t>(p.v_pool[base + e]) << 16);
      m = m_new;
    }
  }
  const float inv = l > 0.0f ? 1.0f / l : 0.0f;
  uint16_t* orow = p.out + item * kD + lane * kPer;
#pragma unroll
  for (int e = 0; e < kPer; ++e) orow[e] = __bfloat16_as_ushort(__float2bfloat16_rn(o[e] * inv));
}

}  // namespace

int prefill_attention_simple_launch(const PrefillParams& p, CUstream_st* stream) {
  const int64_t items = static_cast<int64_t>(p.n) * p.num_q_heads;
  const int64_t grid64 = (items + kWarps - 1) / kWarps;
  if (grid64 > 0x7fffffff) return cudaErrorInvalidValue;
  const int grid = static_cast<int>(grid64);
  switch (p.head_dim) {
    case 32: prefill_simple_kernel<1><<<grid, kWarps * 32, 0, stream>>>(p); break;
    case 64: prefill_simple_kernel<2><<<grid, kWarps * 32, 0, stream>>>(p); break;
    case 96: prefill_simple_kernel<3><<<grid, kWarps * 32, 0, stream>>>(p); break;
    case 128: prefill_simple_kernel<4><<<grid, kWarps * 32, 0, stream>>>(p); break;
    case 160: prefill_simple_kernel<5><<<grid, kWarps * 32, 0, stream>>>(p); break;
    case 192: prefill_simple_kernel<6><<<grid, kWarps * 32, 0, stream>>>(p); break;
    case 224: prefill_simple_kernel<7><<<grid, kWarps * 32, 0, stream>>>(p); break;
    case 256: prefill_simple_kernel<8><<<grid, kWarps * 32, 0, stream>>>(p); break;
    default: return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

}  // namespace fasttree::cuda_detail
