// Merge of partial results (DESIGN.md §3.5), for one (query q, qo head h) "job":
//   out[q, h, :] = Σ_r w_r · partial[r, h, :] / Σ_r w_r,   w_r = exp(lse_r - max_r lse_r)
//   lse[q, h]    = max_r lse_r + log Σ_r w_r
// over the query's partial rows r = merge_rows[rb .. rb + n). A job with no rows, or whose rows are
// all empty (lse = -inf), gets out = 0 and lse = -inf; empty rows contribute nothing and never
// produce NaN.
//
// A group of kLpj = D / 8 lanes merges one job; lane k of a group owns float4 columns k and
// k + kLpj of the row. merge_rows_online: one pass with a running maximum, kMergeStep rows' LSEs
// and data loaded together, the next rows' ids prefetched: few dependent L2 round trips for
// queries with many partial rows (PERF_NOTES.md). Partials are read with ld.global.cg (L2).
// (A merge fused into the tree kernel, by the CTA that wrote a query's last piece, was measured
// slower on every cell in every round and removed; so was a merge in the tree kernel's tail after
// a grid barrier: PERF_NOTES.md.)
//
// merge_kernel: the separate launch, grid-stride over (non-direct query, head) jobs. It may be
// launched as a programmatic dependent of the tree kernel (merge_kernel_launch pdl = true): its CTAs
// are placed as the tree kernel's CTAs retire and wait (griddep_wait) for the partials.
#pragma once
#include <cuda_runtime.h>

#include "cuda/device_plan.h"
#include "cuda/kernels.h"
#include "cuda/ptx.cuh"
#include "cuda/trace.cuh"

namespace fasttree::cuda_detail {

// CTA shape of both separate merge kernels: kMergeThreads, kMergeBlocksPerSm, kMergeStep (kernels.h).

template <int D>
struct MergeShape {
  static constexpr int kLpj = D / 8;      // lanes per job: 8, 16, 32
  static constexpr int kJpw = 32 / kLpj;  // jobs per warp: 4, 2, 1
  static_assert(2 * kLpj * 4 == D, "two float4 per lane");
};

// acc += w x for one partial row (this lane's two float4). w = 0: the row is empty or absent and
// may hold anything (NaN poison included): skipped without multiplying.
__device__ __forceinline__ void add_weighted(float4 (&acc)[2], float w, const float4 (&x)[2]) {
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    acc[e].x = w != 0.0f ? fmaf(w, x[e].x, acc[e].x) : acc[e].x;
    acc[e].y = w != 0.0f ? fmaf(w, x[e].y, acc[e].y) : acc[e].y;
    acc[e].z = w != 0.0f ? fmaf(w, x[e].z, acc[e].z) : acc[e].z;
    acc[e].w = w != 0.0f ? fmaf(w, x[e].w, acc[e].w) : acc[e].w;
  }
}

// Stores a merged job: out[q, h, :] = acc / sum from lane k's two float4 (columns k and k + kLpj),
// lse[q, h] = mx + ln(sum) (lane k == 0); sum = 0 (no non-empty row): out = 0, lse = -inf.
template <int D>
__device__ __forceinline__ void merge_store(float* out, float* lse, int hq, int q, int h, int k, const float4 (&acc)[2],
                                            float sum, float mx) {
  constexpr int kLpj = MergeShape<D>::kLpj;
  const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
  float4* dst = reinterpret_cast<float4*>(out + (static_cast<int64_t>(q) * hq + h) * D);
#pragma unroll
  for (int e = 0; e < 2; ++e)
    dst[k + e * kLpj] = make_float4(acc[e].x * inv, acc[e].y * inv, acc[e].z * inv, acc[e].w * inv);
  if (k == 0 && lse != nullptr) lse[static_cast<int64_t>(q) * hq + h] = sum > 0.0f ? mx + logf(sum) : __int_as_float(0xff800000);
}

// Running state of an online merge over some partial rows of one job: Σ w_r x_r (this lane's two
// float4), Σ w_r and the max LSE m, with w_r = 2^((lse_r - m) log2 e).
struct MergeState {
  float4 acc[2];
  float sum, mx;
};

// merge_rows_online: rows are taken kStep at a time (one pass with a running maximum); every lane of
// the group loads the step's row ids (broadcast), their LSEs and its two float4 of each row
// together, so a step costs one dependent L2 round trip after its row ids, and the next step's row
// ids are loaded while this step's data is in flight. On a new maximum m' the sums are rescaled by
// 2^(m - m'); rows with lse = -inf (or beyond n) weigh 0 and are skipped without multiplying.
// It merges rows merge_rows[rb .. rb + n) into a MergeState (not yet normalized; lane k of its
// group of kLpj lanes holds float4 columns k and k + kLpj).
// The row ids of the first step (merge_rows[rb .. rb + min(n, kStep)), -1 beyond n): plan data,
// which the separate merge kernel loads before it waits for the tree kernel's partials.
template <int D, int Step>
__device__ __forceinline__ void first_merge_rows(const int32_t* __restrict__ merge_rows, int rb, int n, int (&rows)[Step]) {
#pragma unroll
  for (int j = 0; j < Step; ++j) rows[j] = j < n ? __ldg(merge_rows + rb + j) : -1;
}

// rows: the first step's ids from first_merge_rows (consumed).
template <int D, int Step>
__device__ __forceinline__ MergeState merge_rows_online(const int32_t* __restrict__ merge_rows, const float* partial,
                                                        const float* partial_lse, int hq, int h, int rb, int n, int k,
                                                        int (&rows)[Step]) {
  constexpr int kStep = Step;
  constexpr int kLpj = MergeShape<D>::kLpj;
  constexpr float kLog2e = 1.4426950408889634f;
  const float ninf = __int_as_float(0xff800000);
  float4 acc[2] = {make_float4(0.f, 0.f, 0.f, 0.f), make_float4(0.f, 0.f, 0.f, 0.f)};
  float sum = 0.0f, mx = ninf;  // running max of lse (natural log units) and Σ 2^((lse - mx) log2 e)
  for (int i0 = 0; i0 < n; i0 += kStep) {  // n is the same in every lane of the group
    float l[kStep];
    float4 x[kStep][2];
#pragma unroll
    for (int j = 0; j < kStep; ++j) {
      l[j] = ninf;
      x[j][0] = x[j][1] = make_float4(0.f, 0.f, 0.f, 0.f);
      if (rows[j] >= 0) {
        const int64_t r = rows[j];
        l[j] = __ldcg(partial_lse + r * hq + h);
        const float4* src = reinterpret_cast<const float4*>(partial + (r * hq + h) * D);
        x[j][0] = __ldcg(src + k);
        x[j][1] = __ldcg(src + k + kLpj);
      }
    }
#pragma unroll
    for (int j = 0; j < kStep; ++j) {  // the next step's row ids, while this step's loads land
      const int i = i0 + kStep + j;
      rows[j] = i < n ? __ldg(merge_rows + rb + i) : -1;
    }
    float m_new = mx;
#pragma unroll
    for (int j = 0; j < kStep; ++j) m_new = fmaxf(m_new, l[j]);
    if (m_new == ninf) continue;  // every row so far empty
    const float scale = mx == ninf ? 0.0f : exp2f((mx - m_new) * kLog2e);
    mx = m_new;
    sum *= scale;
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      acc[e].x *= scale;
      acc[e].y *= scale;
      acc[e].z *= scale;
      acc[e].w *= scale;
    }
#pragma unroll
    for (int j = 0; j < kStep; ++j) {
      const float wt = exp2f((l[j] - m_new) * kLog2e);  // lse = -inf (or no row) -> 0
      sum += wt;
      add_weighted(acc, wt, x[j]);
    }
  }
  return MergeState{{acc[0], acc[1]}, sum, mx};
}

// A merge job's plan data: query, head, its merge rows [rb, rb + n) (n = 0: inactive) and the
// first step's row ids.
template <int D, int Step>
struct MergeJob {
  int q = 0, h = 0, rb = 0, n = 0;
  int rows[Step];

  __device__ void load(const MergeParams& p, int job, int total, int hq) {
    q = h = rb = n = 0;
    if (job < total) {
      q = p.merge_queries[job / hq];
      h = job % hq;
      rb = p.merge_begin[q];
      n = p.merge_begin[q + 1] - rb;
    }
  }
  // Narrows the job to its rows [b, e) (the wide kernel's lane groups) and loads their first ids.
  __device__ void first_rows(const MergeParams& p, int b, int e) {
    rb += b;
    n = e - b;
    first_merge_rows<D, Step>(p.merge_rows, rb, n, rows);
  }
};

// Every chain of plan loads (counts -> merge_queries -> merge_begin -> merge_rows) for a CTA's first
// job runs before griddep_wait: as a programmatic dependent, the kernel's CTAs do that while the
// tree kernel drains, and only the partial rows are read after the wait.
template <int D>
__global__ void __launch_bounds__(kMergeThreads, kMergeBlocksPerSm) merge_kernel(const MergeParams p) {
  constexpr int kLpj = MergeShape<D>::kLpj, kJpw = MergeShape<D>::kJpw;
  const int hq = p.num_qo_heads;
  const int total = p.counts->num_merge * hq;
  const int lane = threadIdx.x % 32, k = lane % kLpj;
  const int warp = blockIdx.x * (kMergeThreads / 32) + threadIdx.x / 32;
  const int warps = gridDim.x * (kMergeThreads / 32);
  if (threadIdx.x == 0) trace_mark(p.trace, kTraceMerge, kTrMergeStart);
  MergeJob<D, kMergeStep> job;
  int j0 = warp * kJpw;
  job.load(p, j0 + lane / kLpj, total, hq);
  job.first_rows(p, 0, job.n);
  griddep_wait();  // launched as a programmatic dependent of the tree kernel: its partials first
  if (threadIdx.x == 0) trace_mark(p.trace, kTraceMerge, kTrMergeWaited);
  for (; j0 < total; j0 += warps * kJpw) {  // warp-uniform
    if (j0 != warp * kJpw) {
      job.load(p, j0 + lane / kLpj, total, hq);
      job.first_rows(p, 0, job.n);
    }
    const MergeState st =
        merge_rows_online<D, kMergeStep>(p.merge_rows, p.partial, p.partial_lse, hq, job.h, job.rb, job.n, k, job.rows);
    if (j0 + lane / kLpj < total)  // active (a job with no rows stores O = 0, LSE = -inf)
      merge_store<D>(p.out, p.lse, hq, job.q, job.h, k, st.acc, st.sum, st.mx);
  }
  if (threadIdx.x == 0) trace_mark(p.trace, kTraceMerge, kTrMergeEnd);
}

// merge_kernel_wide: the separate launch for plans with many partial rows per job (few queries
// split into many chunks, e.g. one long shared context): one CTA per job (grid-stride), its
// kGroups lane groups each merge a contiguous share of the job's rows (merge_rows_online), then
// the kGroups states are combined through shared memory, so a job costs about one L2 round trip
// instead of one per 8 rows.
template <int D>
__global__ void __launch_bounds__(kMergeThreads, kMergeBlocksPerSm) merge_kernel_wide(const MergeParams p) {
  constexpr int kLpj = MergeShape<D>::kLpj;
  constexpr int kGroups = kMergeThreads / kLpj;  // 16, 8, 4
  constexpr float kLog2e = 1.4426950408889634f;
  __shared__ float4 s_acc[kGroups][2 * kLpj];  // group g's float4 columns (column c at index c)
  __shared__ float2 s_ms[kGroups];             // (mx, sum) of group g
  const float ninf = __int_as_float(0xff800000);
  const int hq = p.num_qo_heads;
  const int total = p.counts->num_merge * hq;
  const int grp = threadIdx.x / kLpj, k = threadIdx.x % kLpj;
  MergeJob<D, kMergeStep> jb;
  // This group's share [b, e) of a job's n rows.
  auto narrow = [&] {
    const int n = jb.n, share = (n + kGroups - 1) / kGroups;
    const int b = min(n, grp * share);
    jb.first_rows(p, b, min(n, b + share));
  };
  if (threadIdx.x == 0) trace_mark(p.trace, kTraceMerge, kTrMergeStart);
  jb.load(p, blockIdx.x, total, hq);  // plan data before the wait (see merge_kernel)
  narrow();
  griddep_wait();
  if (threadIdx.x == 0) trace_mark(p.trace, kTraceMerge, kTrMergeWaited);
  for (int job = blockIdx.x; job < total; job += gridDim.x) {  // CTA-uniform
    if (job != static_cast<int>(blockIdx.x)) {
      jb.load(p, job, total, hq);
      narrow();
    }
    const int q = jb.q, h = jb.h;
    const MergeState st =
        merge_rows_online<D, kMergeStep>(p.merge_rows, p.partial, p.partial_lse, hq, h, jb.rb, jb.n, k, jb.rows);
    s_acc[grp][k] = st.acc[0];
    s_acc[grp][k + kLpj] = st.acc[1];
    if (k == 0) s_ms[grp] = make_float2(st.mx, st.sum);
    __syncthreads();
    if (grp == 0) {  // lanes 0 .. kLpj - 1: combine the groups for their two float4 columns
      float mx = ninf;
#pragma unroll 8
      for (int g = 0; g < kGroups; ++g) mx = fmaxf(mx, s_ms[g].x);
      float4 acc[2] = {make_float4(0.f, 0.f, 0.f, 0.f), make_float4(0.f, 0.f, 0.f, 0.f)};
      float sum = 0.0f;
      if (mx != ninf) {
#pragma unroll 4
        for (int g = 0; g < kGroups; ++g) {
          const float2 ms = s_ms[g];
          if (ms.y == 0.0f) continue;  // a group with no non-empty row (its acc is 0, its mx may be -inf)
          const float w = exp2f((ms.x - mx) * kLog2e);
          sum = fmaf(w, ms.y, sum);
#pragma unroll
          for (int c = 0; c < 2; ++c) {
            const float4 x = s_acc[g][k + c * kLpj];
            acc[c] = make_float4(fmaf(w, x.x, acc[c].x), fmaf(w, x.y, acc[c].y), fmaf(w, x.z, acc[c].z), fmaf(w, x.w, acc[c].w));
          }
        }
      }
      merge_store<D>(p.out, p.lse, hq, q, h, k, acc, sum, mx);
    }
    __syncthreads();  // the next job overwrites s_acc / s_ms
  }
  if (threadIdx.x == 0) trace_mark(p.trace, kTraceMerge, kTrMergeEnd);
}

}  // namespace fasttree::cuda_detail
