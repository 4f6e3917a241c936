// Warp-per-unit tree-attention kernel for short units (CudaTreeAttentionOptions::warp_unit_max_kv).
//
// Units [counts->num_units, counts->num_all_units) (blocks of <= 16 rows whose chunk is at most
// warp_unit_max_kv tokens; upload() puts them after the main kernel's units) are processed one per
// warp, end to end, with no shared memory and no barriers: the warp reads the unit's record, loads
// Q, K and V straight from global memory into mma.sync fragments with 16-byte loads, runs the
// online softmax over 32-token chunks and writes its rows (to O or to partial rows, merged by the
// merge kernel). Many short units are thus in flight per SM (one per warp) instead of the main
// kernel's kStages per CTA.
//
// Fragment layouts (ptx.cuh; g = lane / 4, t = lane % 4):
//   S = Q K^T: the head dimension is permuted (any permutation applied to both Q and K leaves S
//     unchanged): lane t's 16-byte chunk s (dims 32s + 8t .. +7) supplies k-steps 2s (words x, y) and
//     2s + 1 (words z, w), so Q and K rows are read with 16-byte loads.
//   O += P V: output n-tile nt (8 dims) covers dims pi(nt, n) = 64 (nt / 8) + 8 n + nt % 8, so lane g
//     reads V[token][64 hh + 8 g .. +7] with 16-byte loads, token pairs are packed by byte_perm, and
//     lane t ends up holding 16 contiguous output dims 64 hh + 16 t .. +15 of its rows.
#pragma once
#include <cuda_runtime.h>

#include "cuda/tree_attention_common.cuh"

namespace fasttree::cuda_detail {

inline constexpr int kWarpUnitThreads = 64;
#ifndef FT_WARP_MIN_BLOCKS  // A/B builds: -DFT_WARP_MIN_BLOCKS=N (register cap 65536 / (64 N))
#define FT_WARP_MIN_BLOCKS 5
#endif
inline constexpr int kWarpUnitMinBlocks = FT_WARP_MIN_BLOCKS;

__device__ __forceinline__ uint32_t u4_word(const uint4& v, int i) {
  return i == 0 ? v.x : (i == 1 ? v.y : (i == 2 ? v.z : v.w));
}

// Index of the last window run (lane-distributed win_tb, nwin entries) starting at or before tok.
__device__ __forceinline__ int warp_run_search(int win_tb, int nwin, int tok) {
  int k = 0;
#pragma unroll
  for (int step = 16; step >= 1; step >>= 1) {
    const int cand = k + step;
    const int tb = __shfl_sync(kFullMask, win_tb, cand & 31);
    if (cand < nwin && tb <= tok) k = cand;
  }
  return k;
}

template <class T, int D>
__global__ void __launch_bounds__(kWarpUnitThreads, kWarpUnitMinBlocks) warp_unit_kernel(const TreeAttnParams p) {
  static_assert(D == 64 || D == 128, "warp-per-unit path: head_dim 64 or 128");
  constexpr int kKC = D / 32;  // 16-byte chunks of a Q/K row per lane (one per 32 dims)
  constexpr int kKS = D / 16;  // k-steps of S = Q K^T
  constexpr int kVH = D / 64;  // 16-byte chunks of a V row per lane
  constexpr int kNT = D / 8;   // output n-tiles
  const int lane = threadIdx.x & 31;
  const int g = lane >> 2, t = lane & 3;
  const int begin = p.counts->num_units, end = p.counts->num_all_units;
  const int wpb = blockDim.x / 32;
  const int nwarps = gridDim.x * wpb;
  const T* qg = static_cast<const T*>(p.q);
  const T* kg = static_cast<const T*>(p.k);
  const T* vg = static_cast<const T*>(p.v);
  const int64_t row_stride = p.kv_row_stride;

  for (int u = begin + static_cast<int>(blockIdx.x) * wpb + static_cast<int>(threadIdx.x) / 32; u < end; u += nwarps) {
    const int block = u / p.num_kv_heads, kvh = u % p.num_kv_heads;
    const BlockRecord* rec = p.records + block;
    const int4 da = __ldg(reinterpret_cast<const int4*>(&rec->desc));
    const int4 db = __ldg(reinterpret_cast<const int4*>(&rec->desc) + 1);
    const int4 run0 = __ldg(reinterpret_cast<const int4*>(&rec->runs[lane]));
    const int2 qi = __ldg(reinterpret_cast<const int2*>(&rec->rows[lane & 15]));
    const int seg_first = da.x, seg_end = da.y, kv_begin = da.z, kv_len = da.w;
    const int row0 = db.y, rows = db.z;

    // Q fragments (rows g and g + 8; rows >= `rows` are zero).
    uint32_t qa[kKS][4];
    int dst_r[2], head_r[2];
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const int r = g + 8 * hr;
      const int qq = __shfl_sync(kFullMask, qi.x, r);
      dst_r[hr] = __shfl_sync(kFullMask, qi.y, r);
      head_r[hr] = kvh * p.gqa + (row0 + r) % p.gqa;
      const bool valid = r < rows;
      const T* qrow = qg + (static_cast<int64_t>(qq) * p.num_qo_heads + head_r[hr]) * D + 8 * t;
#pragma unroll
      for (int s = 0; s < kKC; ++s) {
        const uint4 w = valid ? __ldg(reinterpret_cast<const uint4*>(qrow + 32 * s)) : make_uint4(0, 0, 0, 0);
        qa[2 * s][hr] = w.x;
        qa[2 * s][2 + hr] = w.y;
        qa[2 * s + 1][hr] = w.z;
        qa[2 * s + 1][2 + hr] = w.w;
      }
    }

    float o[kNT][4];
#pragma unroll
    for (int i = 0; i < kNT; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;
    float m[2] = {neg_inf(), neg_inf()}, l[2] = {0.0f, 0.0f};

    // Run window: runs [s0, s0 + nwin) lane-distributed; s0 = the run holding the chunk's first token.
    int s0 = seg_first;
    int nwin = min(kRecordRuns, seg_end - s0);
    int64_t win_slot = 0;
    int win_tb = 0x7fffffff, win_end = 0x7fffffff;
    if (lane < nwin) {
      win_slot = (static_cast<int64_t>(run0.y) << 32) | static_cast<uint32_t>(run0.x);
      win_tb = run0.z;
      win_end = run0.z + run0.w;
    }
    const int kv_end = kv_begin + kv_len;
    for (int base = kv_begin; base < kv_end; base += 32) {
      const int count = min(32, kv_end - base);
      // This lane's token base + lane: element offset of its K/V row (-1: beyond the chunk).
      int64_t off = -1;
      {
        const int tok = base + lane;
        const int k = warp_run_search(win_tb, nwin, tok);
        const int64_t sl = shfl_i64(win_slot, k);
        const int tb = __shfl_sync(kFullMask, win_tb, k);
        if (lane < count) off = (sl + (tok - tb)) * row_stride + static_cast<int64_t>(kvh) * p.kv_head_stride;
      }
      // S = Q K^T over 4 n-tiles of 8 tokens.
      float sc[4][4];
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) {
        sc[nt][0] = sc[nt][1] = sc[nt][2] = sc[nt][3] = 0.0f;
        const int64_t ko = shfl_i64(off, nt * 8 + g);
        if (nt * 8 < count) {  // warp-uniform
          uint4 kw[kKC];
#pragma unroll
          for (int s = 0; s < kKC; ++s)
            kw[s] = ko >= 0 ? __ldg(reinterpret_cast<const uint4*>(kg + ko + 32 * s + 8 * t)) : make_uint4(0, 0, 0, 0);
#pragma unroll
          for (int s = 0; s < kKC; ++s) {
            mma_16816<T>(sc[nt], qa[2 * s], kw[s].x, kw[s].y);
            mma_16816<T>(sc[nt], qa[2 * s + 1], kw[s].z, kw[s].w);
          }
        }
      }
      // Online softmax (log2 domain).
      float mx[2];
      scale_mask_max(sc, count, t, p.scale_log2, mx);
      float alpha[2];
      softmax_step(sc, mx, m, l, alpha);
      rescale_rows(o, alpha);
      // O += P V.
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        if (16 * j < count) {
          // V rows of tokens 16 j + 2 t + {0, 1, 8, 9} (beyond the chunk: zero).
          uint4 vw[4][kVH];
#pragma unroll
          for (int x = 0; x < 4; ++x) {
            const int64_t vo = shfl_i64(off, 16 * j + 2 * t + (x & 1) + 8 * (x >> 1));
#pragma unroll
            for (int hh = 0; hh < kVH; ++hh)
              vw[x][hh] = vo >= 0 ? __ldg(reinterpret_cast<const uint4*>(vg + vo + 64 * hh + 8 * g)) : make_uint4(0, 0, 0, 0);
          }
          uint32_t pa[4];
          pa[0] = pack2<T>(sc[2 * j][0], sc[2 * j][1]);
          pa[1] = pack2<T>(sc[2 * j][2], sc[2 * j][3]);
          pa[2] = pack2<T>(sc[2 * j + 1][0], sc[2 * j + 1][1]);
          pa[3] = pack2<T>(sc[2 * j + 1][2], sc[2 * j + 1][3]);
#pragma unroll
          for (int nt = 0; nt < kNT; ++nt) {
            const int hh = nt / 8, e = nt % 8;
            const uint32_t sel = (e & 1) ? 0x7632u : 0x5410u;
            const uint32_t b0 = __byte_perm(u4_word(vw[0][hh], e / 2), u4_word(vw[1][hh], e / 2), sel);
            const uint32_t b1 = __byte_perm(u4_word(vw[2][hh], e / 2), u4_word(vw[3][hh], e / 2), sel);
            mma_16816<T>(o[nt], pa, b0, b1);
          }
        }
      }
      // Next chunk's window: the run holding base + 32.
      if (base + 32 < kv_end) {
        const int nxt = base + 32;
        const int last_end = __shfl_sync(kFullMask, win_end, (nwin - 1) & 31);
        const int adv = nxt < last_end ? warp_run_search(win_tb, nwin, nxt) : nwin;
        if (adv > 0) {
          s0 += adv;
          nwin = min(32, seg_end - s0);
          win_slot = 0;
          win_tb = 0x7fffffff;
          win_end = 0x7fffffff;
          if (lane < nwin) {
            const int4 run = __ldg(reinterpret_cast<const int4*>(p.runs + s0 + lane));
            win_slot = (static_cast<int64_t>(run.y) << 32) | static_cast<uint32_t>(run.x);
            win_tb = run.z;
            win_end = run.z + run.w;
          }
        }
      }
    }

    // Epilogue: rows g (c0, c1) and g + 8 (c2, c3); lane t holds dims 64 hh + 16 t + [0, 16).
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      float lt = l[hr];
      lt += __shfl_xor_sync(kFullMask, lt, 1);
      lt += __shfl_xor_sync(kFullMask, lt, 2);
      const int r = g + 8 * hr;
      if (r < rows) {
        const int dst = dst_r[hr], h = head_r[hr];
        float *orow, *lrow;
        row_pointers<D>(p, dst, h, orow, lrow);
        const float inv = lt > 0.0f ? 1.0f / lt : 0.0f;
#pragma unroll
        for (int hh = 0; hh < kVH; ++hh) {
          float4* dp = reinterpret_cast<float4*>(orow + 64 * hh + 16 * t);
#pragma unroll
          for (int q4 = 0; q4 < 4; ++q4) {
            // dims 16 t + 4 q4 + i: i < 8 -> n-tile hh * 8 + i (c0 / c2); else hh * 8 + i - 8 (c1 / c3).
            const int c = 2 * hr + (q4 >= 2 ? 1 : 0);
            const int e0 = (q4 & 1) * 4;
            dp[q4] = make_float4(o[hh * 8 + e0][c] * inv, o[hh * 8 + e0 + 1][c] * inv, o[hh * 8 + e0 + 2][c] * inv,
                                 o[hh * 8 + e0 + 3][c] * inv);
          }
        }
        if (t == 0 && lrow != nullptr)
          *lrow = lt > 0.0f ? (m[hr] + fast_log2(lt)) * 0.69314718055994531f : neg_inf();
      }
    }
  }
}

}  // namespace fasttree::cuda_detail
