// Tensor-core causal prefill attention (FlashAttention-2 style; contract: cuda/engine_ops.h).
//
// CTA = 4 warps = kM = 64 query rows of ONE q head; warp w owns rows [16 w, +16). Grid (Hq, query
// blocks): blockIdx.x = head (heads of one kv head adjacent, so their K/V tiles meet in L2),
// blockIdx.y = query block, heaviest (last) block first. Per CTA:
//   Q tile [kM][D] bf16 -> shared (cp.async, rows beyond n zero-filled); d <= 128 keeps the warp's Q
//   fragments in registers, d = 256 re-reads them from shared every tile.
//   K/V tiles of kN keys, gathered row by row through key_slots (cp.async, 16-byte chunks, XOR
//   swizzle of cuda/tree_attention_common.cuh), double-buffered: tile t+1 loads while t computes.
//   Only tiles up to the block's last query's diagonal are visited; a warp skips tiles (and 16-key
//   sub-tiles) entirely above its own rows' diagonal, and masks a tile only when it crosses it.
//   S = Q K^T (mma.sync m16n8k16 bf16, fp32 accumulate; K via ldmatrix), online softmax in fp32 in
//   the log2 domain (scale * log2(e) folded, masked scores -inf, all -inf cases guarded),
//   O += P V (P re-packed to bf16 from the S accumulators, V via ldmatrix.trans).
//   Epilogue: O / l -> bf16 into the warp's own rows of the Q tile in shared, then 16-byte stores.
// Varlen (PrefillParams::blocks set): several sequences packed row-wise; blockIdx.y indexes the
// host-built (sequence, first row) block list, heaviest first, and each block reads its own
// sequence's rows, keys and output rows; everything else is as above.
// Keys beyond num_keys are zero-filled (never garbage that could be NaN) and masked.
// Shared memory: Q [kM][D] + K [2][kN][D] + V [2][kN][D] bf16: d 64: 40 KB, d 128: 80 KB,
// d 256 (kN = 32): 96 KB.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/engine_ops_launch.h"
#include "cuda/ptx.cuh"
#include "cuda/tree_attention_common.cuh"

namespace fasttree::cuda_detail {

template <int D>
struct PrefillConfig {
  static_assert(D == 64 || D == 128 || D == 256, "head_dim must be 64, 128 or 256");
  static constexpr int kM = 64;                 // query rows per CTA
  static constexpr int kN = D == 256 ? 32 : 64;  // keys per K/V tile
  static constexpr int kThreads = 128;
  static constexpr bool kQInRegs = D <= 128;
  static constexpr int kChunks = D / 8;  // 16-byte chunks per row
  static constexpr int kQBytes = kM * D * 2;
  static constexpr int kTileBytes = kN * D * 2;
  static constexpr int kSmemBytes = kQBytes + 4 * kTileBytes;  // Q, K[2], V[2]
};

template <int D>
__global__ void __launch_bounds__(128) prefill_attention_kernel(PrefillParams p, float scale_log2) {
  using Cfg = PrefillConfig<D>;
  using T = __nv_bfloat16;
  constexpr int kM = Cfg::kM, kN = Cfg::kN, kChunks = Cfg::kChunks;
  constexpr int kNT = kN / 8;       // n-tiles of 8 keys
  constexpr int kDT = D / 8;        // n-tiles of 8 output columns
  constexpr int kKSteps = D / 16;   // k-steps of S = Q K^T
  extern __shared__ __align__(128) unsigned char smem[];
  uint16_t* sq = reinterpret_cast<uint16_t*>(smem);
  uint16_t* sk = reinterpret_cast<uint16_t*>(smem + Cfg::kQBytes);                       // [2][kN][D]
  uint16_t* sv = reinterpret_cast<uint16_t*>(smem + Cfg::kQBytes + 2 * Cfg::kTileBytes);  // [2][kN][D]

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int h = blockIdx.x;
  const int kvh = h / (p.num_q_heads / p.num_kv_heads);
  const int64_t q_stride = static_cast<int64_t>(p.num_q_heads) * D;   // elements per token row of q / out
  const int64_t kv_stride = static_cast<int64_t>(p.num_kv_heads) * D;  // elements per pool slot
  // This block's sequence: the whole call, or (varlen) blocks[blockIdx.y]'s sequence.
  int q0, n, num_keys;
  const int32_t* key_slots = p.key_slots;
  const uint16_t* qg = p.q;
  uint16_t* og = p.out;
  if (p.blocks != nullptr) {
    const int seq = p.blocks[2 * blockIdx.y];
    q0 = p.blocks[2 * blockIdx.y + 1];
    const int r0 = p.seq_rows[seq], k0 = p.seq_keys[seq];
    n = p.seq_rows[seq + 1] - r0;
    num_keys = p.seq_keys[seq + 1] - k0;
    key_slots += k0;
    qg += r0 * q_stride;
    og += r0 * q_stride;
  } else {
    q0 = (gridDim.y - 1 - blockIdx.y) * kM;
    n = p.n;
    num_keys = static_cast<int>(p.num_keys);
  }
  const int ctx = num_keys - n;
  const int rows = min(kM, n - q0);
  const int block_last_key = ctx + q0 + rows - 1;  // inclusive
  const int ntiles = block_last_key / kN + 1;

  // Q tile -> shared (rows beyond n: zeros).
  for (int idx = tid; idx < kM * kChunks; idx += Cfg::kThreads) {
    const int r = idx / kChunks, c = idx - r * kChunks;
    const bool ok = r < rows;
    const uint16_t* src = ok ? qg + (q0 + r) * q_stride + static_cast<int64_t>(h) * D + c * 8 : p.q;
    cp_async_16(smem_addr(sq + swz<D>(r, c * 8)), src, ok ? 16u : 0u);
  }
  auto load_kv = [&](int tile, int stage) {
    uint16_t* dk = sk + stage * kN * D;
    uint16_t* dv = sv + stage * kN * D;
    for (int idx = tid; idx < kN * kChunks; idx += Cfg::kThreads) {
      const int r = idx / kChunks, c = idx - r * kChunks;
      const int key = tile * kN + r;
      const bool ok = key < num_keys;
      const int64_t off = ok ? static_cast<int64_t>(key_slots[key]) * kv_stride + static_cast<int64_t>(kvh) * D + c * 8 : 0;
      const int e = swz<D>(r, c * 8);
      cp_async_16(smem_addr(dk + e), p.k_pool + off, ok ? 16u : 0u);
      cp_async_16(smem_addr(dv + e), p.v_pool + off, ok ? 16u : 0u);
    }
  };
  load_kv(0, 0);
  cp_async_commit();

  // This warp's rows: query rows wr0..wr0+15 (those >= n are padding: computed, never written).
  const int wr0 = q0 + warp * 16;
  const bool warp_active = wr0 < n;
  const int warp_max_key = min(ctx + wr0 + 15, num_keys - 1);  // last key any of its rows sees
  const int warp_min_lim = ctx + wr0;                           // every row sees keys <= this
  const int g = lane >> 2, tq = lane & 3;
  const int lim[2] = {min(ctx + wr0 + g, num_keys - 1), min(ctx + wr0 + g + 8, num_keys - 1)};

  float o[kDT][4];
#pragma unroll
  for (int i = 0; i < kDT; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;
  float m[2] = {neg_inf(), neg_inf()};
  float l[2] = {0.0f, 0.0f};
  uint32_t qf[Cfg::kQInRegs ? kKSteps : 1][4];
  const uint32_t q_base = smem_addr(sq);
  const int qrow = warp * 16 + (lane & 15);

  for (int t = 0; t < ntiles; ++t) {
    const int stage = t & 1;
    if (t + 1 < ntiles) {
      load_kv(t + 1, stage ^ 1);
      cp_async_commit();
      cp_async_wait_group<1>();
    } else {
      cp_async_wait_group<0>();
    }
    __syncthreads();
    const int key0 = t * kN;
    if (warp_active && key0 <= warp_max_key) {
      if constexpr (Cfg::kQInRegs) {
        if (t == 0) {
#pragma unroll
          for (int kk = 0; kk < kKSteps; ++kk) ldmatrix_x4(qf[kk], q_base + swz<D>(qrow, kk * 16 + (lane >> 4) * 8) * 2);
        }
      }
      const uint32_t k_base = smem_addr(sk + stage * kN * D);
      const uint32_t v_base = smem_addr(sv + stage * kN * D);

      // S = Q K^T over the 16-key sub-tiles this warp can see.
      float sc[kNT][4];
#pragma unroll
      for (int i = 0; i < kNT; ++i) sc[i][0] = sc[i][1] = sc[i][2] = sc[i][3] = 0.0f;
#pragma unroll
      for (int kk = 0; kk < kKSteps; ++kk) {
        uint32_t a[4];
        if constexpr (Cfg::kQInRegs) {
          a[0] = qf[kk][0];
          a[1] = qf[kk][1];
          a[2] = qf[kk][2];
          a[3] = qf[kk][3];
        } else {
          ldmatrix_x4(a, q_base + swz<D>(qrow, kk * 16 + (lane >> 4) * 8) * 2);
        }
#pragma unroll
        for (int j = 0; j < kNT / 2; ++j) {
          if (key0 + 16 * j <= warp_max_key) {
            const int row = 16 * j + ((lane >> 4) << 3) + (lane & 7);
            const int col = kk * 16 + (((lane >> 3) & 1) << 3);
            uint32_t bk[4];
            ldmatrix_x4(bk, k_base + swz<D>(row, col) * 2);
            mma_16816<T>(sc[2 * j], a, bk[0], bk[1]);
            mma_16816<T>(sc[2 * j + 1], a, bk[2], bk[3]);
          }
        }
      }

      // Online softmax (log2 domain). Mask only when the tile crosses some row's diagonal.
      const bool masked = key0 + kN - 1 > warp_min_lim;
      float mx[2] = {neg_inf(), neg_inf()};
#pragma unroll
      for (int i = 0; i < kNT; ++i) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int key = key0 + i * 8 + 2 * tq + (e & 1);
          const float x = (!masked || key <= lim[e >> 1]) ? sc[i][e] * scale_log2 : neg_inf();
          sc[i][e] = x;
          mx[e >> 1] = fmaxf(mx[e >> 1], x);
        }
      }
      float alpha[2];
      softmax_step(sc, mx, m, l, alpha);
      rescale_rows(o, alpha);

      // O += P V, 16 keys per k-step.
#pragma unroll
      for (int j = 0; j < kNT / 2; ++j) {
        if (key0 + 16 * j <= warp_max_key) {
          uint32_t a[4];
          a[0] = pack2<T>(sc[2 * j][0], sc[2 * j][1]);
          a[1] = pack2<T>(sc[2 * j][2], sc[2 * j][3]);
          a[2] = pack2<T>(sc[2 * j + 1][0], sc[2 * j + 1][1]);
          a[3] = pack2<T>(sc[2 * j + 1][2], sc[2 * j + 1][3]);
          const int row = 16 * j + (((lane >> 3) & 1) << 3) + (lane & 7);
#pragma unroll
          for (int dn = 0; dn < D / 16; ++dn) {
            uint32_t bv[4];
            ldmatrix_x4_trans(bv, v_base + swz<D>(row, (2 * dn + (lane >> 4)) * 8) * 2);
            mma_16816<T>(o[2 * dn], a, bv[0], bv[1]);
            mma_16816<T>(o[2 * dn + 1], a, bv[2], bv[3]);
          }
        }
      }
    }
    __syncthreads();  // every warp is done with this stage before the next iteration refills it
  }

  // Epilogue: normalized bf16 rows into the warp's own Q rows in shared, then 16-byte stores.
  if (!warp_active) return;
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    float lt = l[hr];
    lt += __shfl_xor_sync(kFullMask, lt, 1);
    lt += __shfl_xor_sync(kFullMask, lt, 2);
    const float inv = lt > 0.0f ? 1.0f / lt : 0.0f;
    const int r = warp * 16 + g + 8 * hr;
#pragma unroll
    for (int i = 0; i < kDT; ++i)
      *reinterpret_cast<uint32_t*>(sq + swz<D>(r, i * 8 + 2 * tq)) =
          pack2<T>(o[i][2 * hr] * inv, o[i][2 * hr + 1] * inv);
  }
  __syncwarp();
  for (int idx = lane; idx < 16 * kChunks; idx += 32) {
    const int r = idx / kChunks, c = idx - r * kChunks;
    const int qi = wr0 + r;
    if (qi < n) {
      *reinterpret_cast<uint4*>(og + qi * q_stride + static_cast<int64_t>(h) * D + c * 8) =
          *reinterpret_cast<const uint4*>(sq + swz<D>(warp * 16 + r, c * 8));
    }
  }
}

}  // namespace fasttree::cuda_detail
