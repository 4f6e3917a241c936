// Kernels and raw launchers of the engine's fused elementwise ops (declared in engine_ops_launch.h;
// the checked public API is cuda/engine_ops.h, engine_ops_check.cpp). Row-major; n = token rows.
// Vectorized paths (16-byte fp32 / 8-byte bf16 accesses) are taken when the row length is a multiple
// of 4 and the pointers are 16-byte aligned; otherwise a scalar path computes the same values.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cstdint>

#include "cuda/engine_ops_launch.h"

namespace fasttree::cuda_detail {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxGrid = 65535 * 16;

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }
bool aligned8(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 7u) == 0; }

int grid_for(int64_t work, int threads = kThreads) {
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>((work + threads - 1) / threads, kMaxGrid)));
}

__device__ __forceinline__ float bf(uint16_t x) { return __uint_as_float(static_cast<uint32_t>(x) << 16); }
__device__ __forceinline__ uint16_t to_bf(float x) { return __bfloat16_as_ushort(__float2bfloat16_rn(x)); }

// 4 bf16 (8 bytes) <-> float4.
__device__ __forceinline__ float4 bf4(uint2 u) {
  return make_float4(__uint_as_float(u.x << 16), __uint_as_float(u.x & 0xffff0000u), __uint_as_float(u.y << 16),
                     __uint_as_float(u.y & 0xffff0000u));
}
__device__ __forceinline__ uint2 to_bf4(float4 v) {
  return make_uint2(static_cast<uint32_t>(to_bf(v.x)) | (static_cast<uint32_t>(to_bf(v.y)) << 16),
                    static_cast<uint32_t>(to_bf(v.z)) | (static_cast<uint32_t>(to_bf(v.w)) << 16));
}

// ---- embed: resid [n, h] fp32 = table [vocab, h] bf16 rows; grid (row chunks), grid-stride ------

template <bool kVec>
__global__ void embed_kernel(const int32_t* tokens, int n, const uint16_t* table, int64_t vocab, int64_t h,
                             float* resid) {
  const int64_t per_row = kVec ? h / 4 : h;
  const int64_t total = static_cast<int64_t>(n) * per_row;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t row = i / per_row, c = i - row * per_row;
    int64_t tok = tokens[row];
    if (tok < 0 || tok >= vocab) tok = 0;
    if constexpr (kVec) {
      const uint2 u = reinterpret_cast<const uint2*>(table + tok * h)[c];
      reinterpret_cast<float4*>(resid + row * h)[c] = bf4(u);
    } else {
      resid[row * h + c] = bf(table[tok * h + c]);
    }
  }
}

// ---- add_rms_norm: one CTA (kThreads) per row -----------------------------------------------------

__device__ float block_sum(float x, float* red) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  __syncthreads();  // red may still be read from a previous call
  if (lane == 0) red[warp] = x;
  __syncthreads();
  float t = 0.0f;
  for (int w = 0; w < static_cast<int>(blockDim.x / 32); ++w) t += red[w];
  return t;
}

// Register-cached path: row of h = 4 * kThreads * kV4 floats at most (h % 4 == 0, aligned).
template <int kV4>
__global__ void __launch_bounds__(kThreads) add_rms_norm_vec_kernel(float* resid, const float* delta,
                                                                    const uint16_t* weight, float eps, int64_t h,
                                                                    uint16_t* out) {
  __shared__ float red[kThreads / 32];
  const int64_t row = blockIdx.x;
  float4* r4 = reinterpret_cast<float4*>(resid + row * h);
  const float4* d4 = delta != nullptr ? reinterpret_cast<const float4*>(delta + row * h) : nullptr;
  const int64_t nv = h / 4;
  float4 x[kV4] = {};
  float ss = 0.0f;
#pragma unroll
  for (int k = 0; k < kV4; ++k) {
    const int64_t c = threadIdx.x + static_cast<int64_t>(k) * kThreads;
    if (c < nv) {
      x[k] = r4[c];
      if (d4 != nullptr) {
        const float4 d = d4[c];
        x[k].x += d.x;
        x[k].y += d.y;
        x[k].z += d.z;
        x[k].w += d.w;
        r4[c] = x[k];
      }
      ss += x[k].x * x[k].x + x[k].y * x[k].y + x[k].z * x[k].z + x[k].w * x[k].w;
    }
  }
  const float inv = 1.0f / sqrtf(block_sum(ss, red) / static_cast<float>(h) + eps);
  const uint2* w4 = reinterpret_cast<const uint2*>(weight);
  uint2* o4 = reinterpret_cast<uint2*>(out + row * h);
#pragma unroll
  for (int k = 0; k < kV4; ++k) {
    const int64_t c = threadIdx.x + static_cast<int64_t>(k) * kThreads;
    if (c < nv) {
      const float4 w = bf4(w4[c]);
      o4[c] = to_bf4(make_float4(w.x * (x[k].x * inv), w.y * (x[k].y * inv), w.z * (x[k].z * inv),
                                 w.w * (x[k].w * inv)));
    }
  }
}

// Any h: two passes over the row (the second re-reads resid from L1/L2).
__global__ void __launch_bounds__(kThreads) add_rms_norm_any_kernel(float* resid, const float* delta,
                                                                    const uint16_t* weight, float eps, int64_t h,
                                                                    uint16_t* out) {
  __shared__ float red[kThreads / 32];
  const int64_t row = blockIdx.x;
  float* r = resid + row * h;
  float ss = 0.0f;
  for (int64_t c = threadIdx.x; c < h; c += kThreads) {
    float x = r[c];
    if (delta != nullptr) {
      x += delta[row * h + c];
      r[c] = x;
    }
    ss += x * x;
  }
  const float inv = 1.0f / sqrtf(block_sum(ss, red) / static_cast<float>(h) + eps);
  for (int64_t c = threadIdx.x; c < h; c += kThreads) out[row * h + c] = to_bf(bf(weight[c]) * (r[c] * inv));
}

// ---- rope_qkv_append: one CTA per token row --------------------------------------------------------
// Work unit u < (Hq + 2 Hkv) * d/2: head = u / (d/2), j = u % (d/2); q and k heads rotate the pair
// (j, j + d/2), v heads copy it. cos/sin in double of the fp32 angle, rounded to fp32, and the
// rotation in fp32 without FMA contraction: bit-identical to engine/rope.cpp.
__global__ void rope_qkv_append_kernel(const float* qkv, const float* bias, const int32_t* positions,
                                       const int32_t* slots, int hq, int hkv, int d, const float* inv_freq,
                                       uint16_t* q_out, uint16_t* k_pool, uint16_t* v_pool) {
  const int64_t row = blockIdx.x;
  const int half = d / 2;
  const int heads = hq + 2 * hkv;
  const int64_t width = static_cast<int64_t>(heads) * d;
  const float* x = qkv + row * width;
  const float pos = static_cast<float>(positions[row]);
  const int64_t slot = slots[row];
  for (int u = threadIdx.x; u < heads * half; u += blockDim.x) {
    const int head = u / half, j = u - head * half;
    const int64_t c1 = static_cast<int64_t>(head) * d + j, c2 = c1 + half;
    float x1 = x[c1], x2 = x[c2];
    if (bias != nullptr) {
      x1 = __fadd_rn(x1, bias[c1]);
      x2 = __fadd_rn(x2, bias[c2]);
    }
    if (head < hq + hkv) {
      const float angle = __fmul_rn(inv_freq[j], pos);
      double sd, cd;
      sincos(static_cast<double>(angle), &sd, &cd);
      const float c = static_cast<float>(cd), s = static_cast<float>(sd);
      const float y1 = __fsub_rn(__fmul_rn(x1, c), __fmul_rn(x2, s));
      const float y2 = __fadd_rn(__fmul_rn(x2, c), __fmul_rn(x1, s));
      uint16_t* dst = head < hq ? q_out + (row * hq + head) * d
                                : k_pool + (slot * hkv + (head - hq)) * d;
      dst[j] = to_bf(y1);
      dst[j + half] = to_bf(y2);
    } else {
      uint16_t* dst = v_pool + (slot * hkv + (head - hq - hkv)) * d;
      dst[j] = to_bf(x1);
      dst[j + half] = to_bf(x2);
    }
  }
}

// ---- silu_mul: out [n, I] = silu(gate) * up, gate_up [n, 2I]; grid-stride -----------------------

__device__ __forceinline__ float silu(float g) { return g / (1.0f + expf(-g)); }

template <bool kVec>
__global__ void silu_mul_kernel(const uint16_t* gate_up, int n, int64_t inter, uint16_t* out) {
  const int64_t per_row = kVec ? inter / 4 : inter;
  const int64_t total = static_cast<int64_t>(n) * per_row;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t row = i / per_row, c = i - row * per_row;
    if constexpr (kVec) {
      const uint2* g4 = reinterpret_cast<const uint2*>(gate_up + row * 2 * inter);
      const float4 g = bf4(g4[c]), u = bf4(g4[per_row + c]);
      reinterpret_cast<uint2*>(out + row * inter)[c] =
          to_bf4(make_float4(silu(g.x) * u.x, silu(g.y) * u.y, silu(g.z) * u.z, silu(g.w) * u.w));
    } else {
      const uint16_t* gu = gate_up + row * 2 * inter;
      out[row * inter + c] = to_bf(silu(bf(gu[c])) * bf(gu[inter + c]));
    }
  }
}

// ---- add_bias: x [n, dim] += bias [dim] --------------------------------------------------------------

template <bool kVec>
__global__ void add_bias_kernel(float* x, const float* bias, int n, int64_t dim) {
  const int64_t per_row = kVec ? dim / 4 : dim;
  const int64_t total = static_cast<int64_t>(n) * per_row;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t c = i % per_row;
    if constexpr (kVec) {
      float4 v = reinterpret_cast<float4*>(x)[i];
      const float4 b = reinterpret_cast<const float4*>(bias)[c];
      v.x += b.x;
      v.y += b.y;
      v.z += b.z;
      v.w += b.w;
      reinterpret_cast<float4*>(x)[i] = v;
    } else {
      x[i] += bias[c];
    }
  }
}

// ---- f32_to_bf16 ---------------------------------------------------------------------------------------

template <bool kVec>
__global__ void f32_to_bf16_kernel(const float* x, int64_t count, uint16_t* out) {
  const int64_t total = kVec ? count / 4 : count;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    if constexpr (kVec) {
      reinterpret_cast<uint2*>(out)[i] = to_bf4(reinterpret_cast<const float4*>(x)[i]);
    } else {
      out[i] = to_bf(x[i]);
    }
  }
}

// ---- argmax_rows: one CTA per row ----------------------------------------------------------------------
// (value, index) pairs; `better` orders by value, then lower index; NaN never wins; index INT_MAX =
// nothing seen yet (an all-NaN row writes 0).

__device__ __forceinline__ bool better(float v, int j, float bv, int bj) {
  return v > bv || (v == bv && j < bj);  // false for NaN v
}

constexpr int kArgmaxThreads = 512;

__global__ void __launch_bounds__(kArgmaxThreads) argmax_rows_kernel(const float* logits, int64_t vocab, int32_t* out) {
  __shared__ float sv[kArgmaxThreads / 32];
  __shared__ int sj[kArgmaxThreads / 32];
  const float* x = logits + static_cast<int64_t>(blockIdx.x) * vocab;
  float bv = -INFINITY;
  int bj = INT_MAX;
  const int nv = static_cast<int>(vocab);
  for (int j = threadIdx.x; j < nv; j += kArgmaxThreads) {
    const float v = x[j];
    if (better(v, j, bv, bj)) {
      bv = v;
      bj = j;
    }
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
    const int oj = __shfl_xor_sync(0xffffffffu, bj, o);
    if (better(ov, oj, bv, bj)) {
      bv = ov;
      bj = oj;
    }
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) {
    sv[warp] = bv;
    sj[warp] = bj;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kArgmaxThreads / 32; ++w) {
      if (better(sv[w], sj[w], bv, bj)) {
        bv = sv[w];
        bj = sj[w];
      }
    }
    out[blockIdx.x] = bj == INT_MAX ? 0 : bj;
  }
}

// ---- fill_uniform_bf16 ------------------------------------------------------------------------------------
// u = top 24 bits of splitmix64(seed ^ (k * golden)) in [0, 1); value = bf16(lo + (hi - lo) u), rounded
// down instead when round-to-nearest reaches hi, up when it falls below lo (so the value is in
// [lo, hi) whenever that interval holds a bf16 value).

__device__ __forceinline__ uint64_t splitmix64(uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

__global__ void fill_uniform_bf16_kernel(uint16_t* data, int64_t count, float lo, float hi, uint64_t seed) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const uint64_t z = splitmix64(seed ^ (static_cast<uint64_t>(i) * 0xd1b54a32d192ed03ull));
    const float u = static_cast<float>(z >> 40) * (1.0f / 16777216.0f);
    const float v = fmaf(u, hi, (1.0f - u) * lo);  // lo (1 - u) + hi u: no overflow for any finite lo, hi
    __nv_bfloat16 r = __float2bfloat16_rn(v);
    if (__bfloat162float(r) >= hi) r = __float2bfloat16_rd(v);  // rd(v) <= v < hi
    if (__bfloat162float(r) < lo) r = __float2bfloat16_ru(v);   // ru(v) >= v >= lo
    data[i] = __bfloat16_as_ushort(r);
  }
}

}  // namespace

int embed_launch(const int32_t* tokens, int n, const uint16_t* table, int64_t vocab, int64_t h, float* resid,
                 CUstream_st* stream) {
  if (h % 4 == 0 && aligned8(table) && aligned16(resid)) {
    embed_kernel<true><<<grid_for(n * (h / 4)), kThreads, 0, stream>>>(tokens, n, table, vocab, h, resid);
  } else {
    embed_kernel<false><<<grid_for(n * h), kThreads, 0, stream>>>(tokens, n, table, vocab, h, resid);
  }
  return cudaGetLastError();
}

int add_rms_norm_launch(float* resid, const float* delta, const uint16_t* weight, float eps, int n, int64_t h,
                        uint16_t* out, CUstream_st* stream) {
  const bool vec = h % 4 == 0 && aligned16(resid) && aligned16(delta) && aligned8(weight) && aligned8(out);
  const int64_t per_thread = (h / 4 + kThreads - 1) / kThreads;
  if (vec && per_thread <= 1) {
    add_rms_norm_vec_kernel<1><<<n, kThreads, 0, stream>>>(resid, delta, weight, eps, h, out);
  } else if (vec && per_thread <= 2) {
    add_rms_norm_vec_kernel<2><<<n, kThreads, 0, stream>>>(resid, delta, weight, eps, h, out);
  } else if (vec && per_thread <= 4) {
    add_rms_norm_vec_kernel<4><<<n, kThreads, 0, stream>>>(resid, delta, weight, eps, h, out);
  } else if (vec && per_thread <= 8) {
    add_rms_norm_vec_kernel<8><<<n, kThreads, 0, stream>>>(resid, delta, weight, eps, h, out);
  } else {
    add_rms_norm_any_kernel<<<n, kThreads, 0, stream>>>(resid, delta, weight, eps, h, out);
  }
  return cudaGetLastError();
}

int rope_qkv_append_launch(const float* qkv, const float* bias, const int32_t* positions, const int32_t* slots, int n,
                           int num_q_heads, int num_kv_heads, int head_dim, const float* inv_freq, uint16_t* q_out,
                           uint16_t* k_pool, uint16_t* v_pool, CUstream_st* stream) {
  const int units = (num_q_heads + 2 * num_kv_heads) * (head_dim / 2);
  const int threads = std::min(kThreads, (units + 31) / 32 * 32);
  rope_qkv_append_kernel<<<n, threads, 0, stream>>>(qkv, bias, positions, slots, num_q_heads, num_kv_heads, head_dim,
                                                    inv_freq, q_out, k_pool, v_pool);
  return cudaGetLastError();
}

int silu_mul_launch(const uint16_t* gate_up, int n, int64_t inter, uint16_t* out, CUstream_st* stream) {
  if (inter % 4 == 0 && aligned8(gate_up) && aligned8(out)) {
    silu_mul_kernel<true><<<grid_for(n * (inter / 4)), kThreads, 0, stream>>>(gate_up, n, inter, out);
  } else {
    silu_mul_kernel<false><<<grid_for(n * inter), kThreads, 0, stream>>>(gate_up, n, inter, out);
  }
  return cudaGetLastError();
}

int add_bias_launch(float* x, const float* bias, int n, int64_t dim, CUstream_st* stream) {
  if (dim % 4 == 0 && aligned16(x) && aligned16(bias)) {
    add_bias_kernel<true><<<grid_for(n * (dim / 4)), kThreads, 0, stream>>>(x, bias, n, dim);
  } else {
    add_bias_kernel<false><<<grid_for(n * dim), kThreads, 0, stream>>>(x, bias, n, dim);
  }
  return cudaGetLastError();
}

int f32_to_bf16_launch(const float* x, int64_t count, uint16_t* out, CUstream_st* stream) {
  if (count % 4 == 0 && aligned16(x) && aligned8(out)) {
    f32_to_bf16_kernel<true><<<grid_for(count / 4), kThreads, 0, stream>>>(x, count, out);
  } else {
    f32_to_bf16_kernel<false><<<grid_for(count), kThreads, 0, stream>>>(x, count, out);
  }
  return cudaGetLastError();
}

// One thread per 16-byte chunk (8 bf16) of an output row when dim % 8 == 0 and both tensors are
// 16-byte aligned, else per element.
template <bool kVec>
__global__ void gather_rows_bf16_kernel(const uint16_t* __restrict__ x, const int32_t* __restrict__ rows, int n,
                                        int64_t dim, uint16_t* __restrict__ out) {
  const int64_t per_row = kVec ? dim / 8 : dim;
  const int64_t total = static_cast<int64_t>(n) * per_row;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / per_row, c = i - r * per_row;
    const int64_t src = static_cast<int64_t>(rows[r]) * per_row + c;
    if constexpr (kVec) {
      reinterpret_cast<uint4*>(out)[i] = reinterpret_cast<const uint4*>(x)[src];
    } else {
      out[i] = x[src];
    }
  }
}

int gather_rows_bf16_launch(const uint16_t* x, const int32_t* rows, int n, int64_t dim, uint16_t* out,
                            CUstream_st* stream) {
  if (dim % 8 == 0 && aligned16(x) && aligned16(out)) {
    gather_rows_bf16_kernel<true><<<grid_for(n * (dim / 8)), kThreads, 0, stream>>>(x, rows, n, dim, out);
  } else {
    gather_rows_bf16_kernel<false><<<grid_for(n * dim), kThreads, 0, stream>>>(x, rows, n, dim, out);
  }
  return cudaGetLastError();
}

int argmax_rows_launch(const float* logits, int n, int64_t vocab, int32_t* out, CUstream_st* stream) {
  argmax_rows_kernel<<<n, kArgmaxThreads, 0, stream>>>(logits, vocab, out);
  return cudaGetLastError();
}

int fill_uniform_bf16_launch(uint16_t* data, int64_t count, float lo, float hi, uint64_t seed, CUstream_st* stream) {
  fill_uniform_bf16_kernel<<<grid_for(count), kThreads, 0, stream>>>(data, count, lo, hi, seed);
  return cudaGetLastError();
}

}  // namespace fasttree::cuda_detail
