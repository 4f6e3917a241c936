// Merge of partial results (DESIGN.md §3.5): one warp per (non-direct query, qo head), grid-stride.
//   out[q, h, :] = Σ_r w_r · partial[r, h, :] / Σ_r w_r,   w_r = exp(lse_r - max_r lse_r)
//   lse[q, h]    = max_r lse_r + log Σ_r w_r
// over the query's partial rows r. A query with no rows, or whose rows are all empty (lse = -inf),
// gets out = 0 and lse = -inf; empty rows contribute nothing and never produce NaN.
#pragma once
#include <cuda_runtime.h>

#include "cuda/device_plan.h"

namespace fasttree::cuda_detail {

inline constexpr int kMergeThreads = 256;

template <int D>
__global__ void __launch_bounds__(kMergeThreads) merge_kernel(const MergeParams p) {
  constexpr int kV4 = D / 4;                 // float4 per row
  constexpr int kPerLane = (kV4 + 31) / 32;  // float4 per lane
  const int hq = p.num_qo_heads;
  const int total = p.counts->num_merge * hq;
  const int lane = threadIdx.x % 32;
  const int warps = gridDim.x * (kMergeThreads / 32);
  const float neg_inf = __int_as_float(0xff800000);
  for (int w = blockIdx.x * (kMergeThreads / 32) + threadIdx.x / 32; w < total; w += warps) {
    const int q = p.merge_queries[w / hq];
    const int h = w - (w / hq) * hq;
    const int rb = p.merge_begin[q], n = p.merge_begin[q + 1] - rb;
    float mx = neg_inf;
    for (int i = lane; i < n; i += 32) mx = fmaxf(mx, p.partial_lse[static_cast<int64_t>(p.merge_rows[rb + i]) * hq + h]);
#pragma unroll
    for (int off = 16; off >= 1; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
    const float mu = mx == neg_inf ? 0.0f : mx;
    float4 acc[kPerLane];
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) acc[j] = make_float4(0.f, 0.f, 0.f, 0.f);
    float sum = 0.0f;
    for (int i = 0; i < n; ++i) {
      const int64_t r = static_cast<int64_t>(p.merge_rows[rb + i]) * hq + h;
      const float wgt = exp2f((p.partial_lse[r] - mu) * 1.4426950408889634f);  // lse = -inf -> 0
      if (wgt == 0.0f) continue;  // uniform over the warp
      sum += wgt;
      const float4* src = reinterpret_cast<const float4*>(p.partial + r * D);
#pragma unroll
      for (int j = 0; j < kPerLane; ++j) {
        const int c = lane + 32 * j;
        if (c < kV4) {
          const float4 x = src[c];
          acc[j].x += wgt * x.x;
          acc[j].y += wgt * x.y;
          acc[j].z += wgt * x.z;
          acc[j].w += wgt * x.w;
        }
      }
    }
    const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
    float4* dst = reinterpret_cast<float4*>(p.out + (static_cast<int64_t>(q) * hq + h) * D);
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      const int c = lane + 32 * j;
      if (c < kV4) dst[c] = make_float4(acc[j].x * inv, acc[j].y * inv, acc[j].z * inv, acc[j].w * inv);
    }
    if (lane == 0 && p.lse != nullptr) p.lse[static_cast<int64_t>(q) * hq + h] = sum > 0.0f ? mx + logf(sum) : neg_inf;
  }
}

}  // namespace fasttree::cuda_detail
