// Consumer warps (0-3) of the tree-attention kernel (tree_attention_kernel.cuh).
//
// A block of `rows` query rows (row = query_in_tile * g + head_in_group) is R = 1, 2 or 4 groups of
// 16 rows; the 4 warps are R row groups x C = 4/R column groups, so warp w owns rows
// [16 (w / C), +16) of the Q tile and columns [(w % C) * kN / C, +kN / C) of every KV tile. Per
// tile: S = Q K^T (mma.sync m16n8k16, fp32 accumulate; A = Q from registers or shared, B = K via
// ldmatrix), online softmax in fp32 (exp2 with sm_scale*log2(e) folded in, masked columns -inf,
// every -inf case guarded), O += P V (P re-packed from the S accumulators, V via ldmatrix.trans).
// After a unit's last tile: R = 4 writes the normalized rows straight from registers; R < 4 first
// combines the C column groups of each row through shared memory (LSE-weighted, in the
// just-consumed stage's K/V space) and writes coalesced float4 rows. Rows go to O[query] (+ LSE)
// for direct queries, else to partial rows, which the merge kernel (merge_kernel.cuh) combines.
// 64-row tiles (R = 4, d <= 128) run instead as one warpgroup on wgmma (compute_wgmma: S with Q
// from the registers loaded at the unit's first tile and K from the swizzled shared tile, then
// O += P V with V from shared memory), which reads each K/V tile from shared memory once instead
// of once per warp; the same online softmax (masked for partial tiles
// and private tokens) and epilogue follow, since the wgmma accumulator layout per warp is the
// mma.sync one.
#pragma once
#include "cuda/tree_attention_common.cuh"
#include "cuda/wgmma.cuh"

namespace fasttree::cuda_detail {

// Column mask of a partial tile, for this thread's rows g (vis[0]) and g + 8 (vis[1]): bit c is
// set iff tile column c is visible, i.e. c < shared (a column every row reads, below the tile's
// token count) or lo <= c < hi (the row's own private tokens, folded leaves, below the count). A
// tile without private tokens shows its first count columns. One bit test per score replaced the
// two-interval compare (~4 instructions per score) of the masked tiles.
struct TreeMask {
  uint64_t vis[2];
};

// Bits [0, n) of a 64-bit mask (n <= 0: none, n >= 64: all).
__device__ __forceinline__ uint64_t low_bits(int n) {
  return n <= 0 ? 0ull : n >= 64 ? ~0ull : (1ull << n) - 1ull;
}

// Lazy rescaling threshold of the consumer's online softmax (log2 units; FlashAttention-4 uses 8):
// a tile whose row max exceeds the running max by at most this keeps the running max, so the O
// rescale (one FMUL per accumulator) is skipped.
inline constexpr float kRescaleSlack = 8.0f;

template <class T, int D, bool kDeep>
struct Consumer {
  using Cfg = TreeKernelConfig<D, kDeep>;
  static constexpr int kN = Cfg::kN;
  static constexpr int kDT = D / 8;  // n-tiles of 8 output columns
  static constexpr int kKSteps = D / 16;

  const TreeAttnParams& p;
  const SmemLayout& s;
  int warp, lane;

  float o[kDT][4];  // O accumulator of rows g, g + 8 of the warp's 16-row group (unnormalized)
  float m[2];       // running max of the scaled (log2) scores of rows g, g + 8
  float l[2];       // running Σ 2^(s - m), per thread (reduced over the quad at the end)
  uint32_t qf[Cfg::kQInRegs ? kKSteps : 1][4];
  // This lane's ldmatrix byte offsets inside a swz64 column block, by k-step (K) or 16-column
  // group (V) modulo 4: the swizzle term depends only on that and on lane % 8, so every K / V
  // fragment address is a stage base plus one of these plus a compile-time offset.
  uint32_t ko[4], vo[4];
  int head0 = 0, r0g = 0;  // current unit: first query head of its kv head, block row0 % g

  __device__ Consumer(const TreeAttnParams& params, const SmemLayout& smem, int w, int ln)
      : p(params), s(smem), warp(w), lane(ln) {
    const int r7 = lane & 7;
    const int rk = ((lane >> 4) << 3) + r7, bk = (lane >> 3) & 1;  // K: row in the 16-row group, 8-column half
    const int rv = (((lane >> 3) & 1) << 3) + r7, cv = lane >> 4;  // V (transposed): row, 8-column half
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      ko[q] = static_cast<uint32_t>((rk * 64 + (((2 * q + bk) ^ r7) << 3)) * 2);
      vo[q] = static_cast<uint32_t>((rv * 64 + (((2 * q + cv) ^ r7) << 3)) * 2);
    }
  }

  __device__ void reset() {
#pragma unroll
    for (int i = 0; i < kDT; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;
    m[0] = m[1] = neg_inf();
    l[0] = l[1] = 0.0f;
  }

  __device__ void load_q_regs(uint32_t q_base, int qslot, int row_base, int rows) {
    if constexpr (Cfg::kQGlobal) {
      // Rows g and g + 8 of the warp's 16, the mma A-fragment layout (= ldmatrix_x4's): a0 / a1 =
      // rows g / g + 8 at columns 16 kk + 2 tq, a2 / a3 the same 8 columns further; rows beyond
      // the block are zero.
      const int g = lane >> 2, tq = lane & 3;
      const uint32_t* qr[2];
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        const int r = row_base + g + 8 * hr;
        qr[hr] = nullptr;
        if (r < rows) {
          const int64_t off = (static_cast<int64_t>(row_tab(kRowQuery, qslot, r)) * p.num_qo_heads +
                               row_tab(kRowHead, qslot, r)) * D + 2 * tq;
          qr[hr] = reinterpret_cast<const uint32_t*>(static_cast<const T*>(p.q) + off);
        }
      }
#pragma unroll
      for (int kk = 0; kk < kKSteps; ++kk) {
        qf[kk][0] = qr[0] != nullptr ? __ldg(qr[0] + kk * 8) : 0u;
        qf[kk][1] = qr[1] != nullptr ? __ldg(qr[1] + kk * 8) : 0u;
        qf[kk][2] = qr[0] != nullptr ? __ldg(qr[0] + kk * 8 + 4) : 0u;
        qf[kk][3] = qr[1] != nullptr ? __ldg(qr[1] + kk * 8 + 4) : 0u;
      }
    } else if constexpr (Cfg::kQInRegs) {
      const int row = row_base + (lane & 15);
#pragma unroll
      for (int kk = 0; kk < kKSteps; ++kk) ldmatrix_x4(qf[kk], q_base + swz64<D>(row, kk * 16 + (lane >> 4) * 8) * 2);
    }
  }

  // Online softmax of an S tile of raw scores (NT n-tiles of 8 columns starting at column cb; with
  // kMask, columns >= count are masked) in the log2 domain: row max over the quad, m / l updated
  // (m in scaled units), sc becomes P = 2^(s * scale - m) (one FFMA per element), and O is
  // rescaled unless this is the unit's first tile (O still zero) or no row max of the warp moved.
  // The scale (sm_scale * log2 e) is positive, so the max of the raw scores scales to the max.
  // kMask: columns outside tm's visible set are masked.
  template <int NT, bool kMask = true>
  __device__ __forceinline__ void online_softmax(float (&sc)[NT][4], int cb, bool first, const TreeMask& tm) {
    const int tq = lane & 3;
    const float scale = p.scale_log2;
    float mx[2] = {neg_inf(), neg_inf()};
    uint64_t vis[2] = {0, 0};  // this thread's columns cb + 2 tq + {0, 1} + 8 i at bits 8 i + {0, 1}
    if constexpr (kMask) {
      vis[0] = tm.vis[0] >> (cb + 2 * tq);
      vis[1] = tm.vis[1] >> (cb + 2 * tq);
    }
#pragma unroll
    for (int i = 0; i < NT; ++i) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float x = sc[i][e];
        if constexpr (kMask) {
          x = (vis[e >> 1] >> (i * 8 + (e & 1))) & 1ull ? x : neg_inf();
          sc[i][e] = x;
        }
        mx[e >> 1] = fmaxf(mx[e >> 1], x);
      }
    }
    float mu[2], alpha[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      mx[r] = fmaxf(mx[r], __shfl_xor_sync(kFullMask, mx[r], 1));
      mx[r] = fmaxf(mx[r], __shfl_xor_sync(kFullMask, mx[r], 2));
      // Lazy rescaling: the running max moves only when the tile's max exceeds it by more than
      // kRescaleSlack (then P <= 2^kRescaleSlack, exact in fp16 / bf16 and far from overflow in
      // the fp32 O and l); m = -inf (nothing seen yet) always takes the tile's max.
      const float m_tile = mx[r] * scale;
      const float m_new = m_tile > m[r] + kRescaleSlack ? m_tile : m[r];
      mu[r] = m_new == neg_inf() ? 0.0f : m_new;  // all masked so far: exponents stay -inf -> 0
      alpha[r] = fast_exp2(m[r] - mu[r]);         // m = -inf -> 0
      m[r] = m_new;
    }
    // P, then its row sums as a tree (a serial chain of 2 NT dependent adds per row sat between
    // the P V wgmmas).
    float rs[2][NT];
#pragma unroll
    for (int i = 0; i < NT; ++i) {
#pragma unroll
      for (int e = 0; e < 4; ++e) sc[i][e] = fast_exp2(fmaf(sc[i][e], scale, -mu[e >> 1]));
      rs[0][i] = sc[i][0] + sc[i][1];
      rs[1][i] = sc[i][2] + sc[i][3];
    }
#pragma unroll
    for (int w = NT / 2; w >= 1; w /= 2) {
      if constexpr (NT <= 8) {
#pragma unroll
        for (int i = 0; i < w; ++i) {
          rs[0][i] += rs[0][i + w];
          rs[1][i] += rs[1][i + w];
        }
      } else {
#pragma unroll
        for (int i = 0; i < NT / 2; ++i)  // constant bounds: NT = 16 is not unrolled otherwise
          if (i < w) {
            rs[0][i] += rs[0][i + w];
            rs[1][i] += rs[1][i + w];
          }
      }
    }
    l[0] = fmaf(l[0], alpha[0], rs[0][0]);
    l[1] = fmaf(l[1], alpha[1], rs[1][0]);
    if (!first && __any_sync(kFullMask, alpha[0] != 1.0f || alpha[1] != 1.0f)) rescale_rows(o, alpha);
  }

  // One KV tile for the warp's 16 rows x NW columns starting at column cb.
  // first: the unit's first tile (o is still zero, so its rescale is skipped).
  // kFull: all NW columns hold tokens (cb + NW <= count): no column checks, no masking.
  // kQSmem: Q fragments from the Q slot (ldmatrix) instead of registers (d = 256).
  // tm: the mask of a partial tile (!kFull).
  template <int NW, bool kFull, bool kQSmem = !Cfg::kQInRegs>
  __device__ void compute(uint32_t q_base, uint32_t k_base, uint32_t v_base, int row_base, int cb, int count, bool first,
                          const TreeMask& tm) {
    constexpr int NT = NW / 8;
    const uint32_t kc = k_base + cb * 128;  // column group's first K / V row (128 bytes per swz64 row)
    const uint32_t vc = v_base + cb * 128;
    float sc[NT][4];
#pragma unroll
    for (int i = 0; i < NT; ++i) sc[i][0] = sc[i][1] = sc[i][2] = sc[i][3] = 0.0f;

    // S = Q K^T
#pragma unroll
    for (int kk = 0; kk < kKSteps; ++kk) {
      uint32_t a[4];
      if constexpr (!kQSmem) {
        a[0] = qf[kk][0];
        a[1] = qf[kk][1];
        a[2] = qf[kk][2];
        a[3] = qf[kk][3];
      } else {
        ldmatrix_x4(a, q_base + swz64<D>(row_base + (lane & 15), kk * 16 + (lane >> 4) * 8) * 2);
      }
#pragma unroll
      for (int j = 0; j < NT / 2; ++j) {
        if (kFull || cb + 16 * j < count) {
          uint32_t bk[4];
          ldmatrix_x4(bk, kc + (kk >> 2) * 8192 + j * 2048 + ko[kk & 3]);
          mma_16816<T>(sc[2 * j], a, bk[0], bk[1]);
          mma_16816<T>(sc[2 * j + 1], a, bk[2], bk[3]);
        }
      }
    }

    online_softmax<NT, !kFull>(sc, cb, first, tm);

    // O += P V, 16 tokens per k-step.
#pragma unroll
    for (int j = 0; j < NT / 2; ++j) {
      if (kFull || cb + 16 * j < count) {
        uint32_t a[4];
        a[0] = pack2<T>(sc[2 * j][0], sc[2 * j][1]);
        a[1] = pack2<T>(sc[2 * j][2], sc[2 * j][3]);
        a[2] = pack2<T>(sc[2 * j + 1][0], sc[2 * j + 1][1]);
        a[3] = pack2<T>(sc[2 * j + 1][2], sc[2 * j + 1][3]);
#pragma unroll
        for (int dn = 0; dn < D / 16; ++dn) {
          uint32_t bv[4];
          ldmatrix_x4_trans(bv, vc + j * 2048 + (dn >> 2) * 8192 + vo[dn & 3]);
          mma_16816<T>(o[2 * dn], a, bv[0], bv[1]);
          mma_16816<T>(o[2 * dn + 1], a, bv[2], bv[3]);
        }
      }
    }
  }

  // R = 4 and D <= 128: the 4 consumer warps are warpgroup 0 and run the whole 64 x 64 tile on wgmma
  // (wgmma.cuh): S = Q K^T with Q from registers (qf, the wgmma A layout per warp) and K from the
  // swizzled shared tile, the same per-warp online softmax, then O += P V with P from registers and
  // V from shared memory. Q from registers halves the shared-memory reads of S (an m64n64k16 with
  // both operands in shared memory reads 128 bytes per SM cycle at the tensor cores' peak, all the
  // bandwidth there is).
  static constexpr bool kWgmma = Cfg::kWgmma;

  // P as wgmma A fragments (the mma.sync m16n8k16 A layout per warp): k-step j of 16 tokens from
  // the S accumulator's n-tiles 2 j and 2 j + 1.
  template <int J>
  static __device__ __forceinline__ void pack_p(const float (&sc)[2 * J][4], uint32_t (&pa)[J][4]) {
#pragma unroll
    for (int j = 0; j < J; ++j) {
      pa[j][0] = pack2<T>(sc[2 * j][0], sc[2 * j][1]);
      pa[j][1] = pack2<T>(sc[2 * j][2], sc[2 * j][3]);
      pa[j][2] = pack2<T>(sc[2 * j + 1][0], sc[2 * j + 1][1]);
      pa[j][3] = pack2<T>(sc[2 * j + 1][2], sc[2 * j + 1][3]);
    }
  }

  // masked: a tile with fewer than 64 tokens or with private tokens; its columns outside tm's
  // visible set get -inf (the producer zero-fills K/V rows [count, 64) of wgmma units, so P = 0
  // there multiplies finite V).
  template <bool kMasked>
  __device__ void compute_wgmma(uint32_t k_base, uint32_t v_base, bool first, const TreeMask& tm) {
    constexpr uint32_t kBlk = 64 * 64 * 2;  // bytes of one [64][64] column block of a tile
    float sc[8][4];
#pragma unroll
    for (int i = 0; i < 8; ++i) sc[i][0] = sc[i][1] = sc[i][2] = sc[i][3] = 0.0f;
    fence_proxy_async();  // the producer's cp.async data, seen through the full barrier, before wgmma reads it
    fence_regs(sc);
    wgmma_fence();
    constexpr uint32_t kHi = gmma_desc_hi(1024);
    const uint32_t kd = gmma_desc_lo(k_base, 16);
#pragma unroll
    for (int kk = 0; kk < kKSteps; ++kk) {
      const uint32_t off = (kk / 4) * kBlk + (kk % 4) * 32;  // 16 columns = 32 bytes into the swizzled rows
      wgmma_rs<T, 64>(sc, qf[kk], gmma_desc_at(kd, kHi, off), kk > 0 ? 1 : 0);
    }
    wgmma_commit();
    wgmma_wait<0>();
    fence_regs(sc);
    online_softmax<8, kMasked>(sc, 0, first, tm);
    uint32_t pa[4][4];
    pack_p(sc, pa);
    const uint32_t vd = gmma_desc_lo(v_base, kBlk);
    fence_regs(o);
    wgmma_fence();
    // All 4 k-steps, also beyond count (P = 0 there; the producer zero-fills those V rows of wgmma
    // units): a conditional wgmma would make ptxas serialize the whole sequence.
#pragma unroll
    for (int j = 0; j < 4; ++j) wgmma_rs_tb<T, D>(o, pa[j], gmma_desc_at(vd, kHi, j * 16 * 128));
    wgmma_commit();
    wgmma_wait<0>();
    fence_regs(o);
  }

#if FT_TREE_PAIR
  // Two consecutive full middle tiles (stages k0 / v0 and k1 / v1) as one 64 x 128 step: S of both
  // into one accumulator, one online softmax over 128 columns, then the 8 P V k-steps. Halves the
  // per-tile fixed chain (waits, row reductions, rescale decision) of the compute-bound cells.
  __device__ void compute_wgmma_pair(uint32_t k0, uint32_t v0, uint32_t k1, uint32_t v1) {
    constexpr uint32_t kBlk = 64 * 64 * 2;
    float s0[8][4], s1[8][4];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      s0[i][0] = s0[i][1] = s0[i][2] = s0[i][3] = 0.0f;
      s1[i][0] = s1[i][1] = s1[i][2] = s1[i][3] = 0.0f;
    }
    fence_proxy_async();
    fence_regs(s0);
    fence_regs(s1);
    wgmma_fence();
    constexpr uint32_t kHi = gmma_desc_hi(1024);
    const uint32_t kd0 = gmma_desc_lo(k0, 16), kd1 = gmma_desc_lo(k1, 16);
#pragma unroll
    for (int kk = 0; kk < kKSteps; ++kk) {
      const uint32_t off = (kk / 4) * kBlk + (kk % 4) * 32;
      wgmma_rs<T, 64>(s0, qf[kk], gmma_desc_at(kd0, kHi, off), kk > 0 ? 1 : 0);
    }
#pragma unroll
    for (int kk = 0; kk < kKSteps; ++kk) {
      const uint32_t off = (kk / 4) * kBlk + (kk % 4) * 32;
      wgmma_rs<T, 64>(s1, qf[kk], gmma_desc_at(kd1, kHi, off), kk > 0 ? 1 : 0);
    }
    wgmma_commit();
    wgmma_wait<0>();
    fence_regs(s0);
    fence_regs(s1);
    float sc[16][4];
#pragma unroll
    for (int i = 0; i < 8; ++i)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        sc[i][e] = s0[i][e];
        sc[8 + i][e] = s1[i][e];
      }
    online_softmax<16, false>(sc, 0, false, TreeMask{});
    uint32_t pa[8][4];
    pack_p(sc, pa);
    const uint32_t vd0 = gmma_desc_lo(v0, kBlk), vd1 = gmma_desc_lo(v1, kBlk);
    fence_regs(o);
    wgmma_fence();
#pragma unroll
    for (int j = 0; j < 4; ++j) wgmma_rs_tb<T, D>(o, pa[j], gmma_desc_at(vd0, kHi, j * 16 * 128));
#pragma unroll
    for (int j = 0; j < 4; ++j) wgmma_rs_tb<T, D>(o, pa[4 + j], gmma_desc_at(vd1, kHi, j * 16 * 128));
    wgmma_commit();
    wgmma_wait<0>();
    fence_regs(o);
  }
#endif

  // Destination of block row r of Q slot qslot.
  __device__ int row_tab(int table, int qslot, int r) const {
    return s.row_tab[(table * Cfg::kStages + qslot) * Cfg::kM + r];
  }

  __device__ void row_dest(int qslot, int r, float*& orow, float*& lrow) const {
    const int dst = row_tab(kRowDst, qslot, r);
    const int h = Cfg::kHeadTable ? row_tab(kRowHead, qslot, r) : head0 + (r0g + r) % p.gqa;
    row_pointers<D>(p, dst, h, orow, lrow);
  }

  static __device__ float lse_of(float m2, float l2) {
    return l2 > 0.0f ? (m2 + fast_log2(l2)) * 0.69314718055994531f : neg_inf();
  }

  // R = 4: each warp owns whole rows; write them from registers.
  __device__ void epilogue_direct(int qslot, int row_base, int rows) {
    const int g = lane >> 2, tq = lane & 3;
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      float lt = l[hr];
      lt += __shfl_xor_sync(kFullMask, lt, 1);
      lt += __shfl_xor_sync(kFullMask, lt, 2);
      const int r = row_base + g + 8 * hr;
      if (r < rows) {
        float *orow, *lrow;
        row_dest(qslot, r, orow, lrow);
        const float inv = lt > 0.0f ? 1.0f / lt : 0.0f;
#pragma unroll
        for (int i = 0; i < kDT; ++i)
          *reinterpret_cast<float2*>(orow + i * 8 + 2 * tq) = make_float2(o[i][2 * hr] * inv, o[i][2 * hr + 1] * inv);
        if (tq == 0 && lrow != nullptr) *lrow = lse_of(m[hr], lt);
      }
    }
  }

  // R < 4: combine the C = 4 / R column groups of every row through shared memory, then write
  // float4 rows with all 128 consumer threads. scratch = [4 warps][16 rows][D] fp32 in the consumed
  // stage's K/V space, 8-float groups of row r XOR-swizzled by r % 8.
  template <int R>
  __device__ void epilogue_combine(int qslot, int rows, float* scratch) {
    constexpr int C = 4 / R;
    const int g = lane >> 2, tq = lane & 3;
    const int rg = warp / C;
    float lt[2];
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      lt[hr] = l[hr];
      lt[hr] += __shfl_xor_sync(kFullMask, lt[hr], 1);
      lt[hr] += __shfl_xor_sync(kFullMask, lt[hr], 2);
      if (tq == 0) s.ml[warp * 16 + g + 8 * hr] = make_float2(m[hr], lt[hr]);
    }
    named_barrier(1, Cfg::kConsumerThreads);  // ml complete; every warp done reading this stage
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const int r16 = g + 8 * hr;
      float mstar = neg_inf();
#pragma unroll
      for (int cg = 0; cg < C; ++cg) mstar = fmaxf(mstar, s.ml[(rg * C + cg) * 16 + r16].x);
      const float mu = mstar == neg_inf() ? 0.0f : mstar;
      float total = 0.0f;
#pragma unroll
      for (int cg = 0; cg < C; ++cg) {
        const float2 e = s.ml[(rg * C + cg) * 16 + r16];
        total += e.y * fast_exp2(e.x - mu);
      }
      const float w = total > 0.0f ? fast_exp2(m[hr] - mu) / total : 0.0f;
      // LSE now, so that no warp reads ml after the second barrier (the next unit rewrites it).
      if (warp % C == 0 && tq == 0 && rg * 16 + r16 < rows) {
        float *orow, *lrow;
        row_dest(qslot, rg * 16 + r16, orow, lrow);
        if (lrow != nullptr) *lrow = lse_of(mstar, total);
      }
      if (rg * 16 + r16 < rows) {  // rows beyond are never read back
        float* srow = scratch + (warp * 16 + r16) * D;
#pragma unroll
        for (int i = 0; i < kDT; ++i) {
          const int col = (i * 8 + 2 * tq) ^ (g << 3);  // r16 % 8 == g
          *reinterpret_cast<float2*>(srow + col) = make_float2(o[i][2 * hr] * w, o[i][2 * hr + 1] * w);
        }
      }
    }
    named_barrier(1, Cfg::kConsumerThreads);
    const int tid = warp * 32 + lane;
    constexpr int kV4 = D / 4;
    for (int idx = tid; idx < R * 16 * kV4; idx += Cfg::kConsumerThreads) {
      const int row = idx / kV4;
      if (row >= rows) break;  // idx increases: every later row is beyond too
      const int c4 = idx - row * kV4;
      const int grp = row >> 4, r16 = row & 15;
      const int col = (c4 * 4) ^ ((r16 & 7) << 3);
      float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
      for (int cg = 0; cg < C; ++cg) {
        const float4 x = *reinterpret_cast<const float4*>(scratch + ((grp * C + cg) * 16 + r16) * D + col);
        acc.x += x.x;
        acc.y += x.y;
        acc.z += x.z;
        acc.w += x.w;
      }
      float *orow, *lrow;
      row_dest(qslot, row, orow, lrow);
      *reinterpret_cast<float4*>(orow + c4 * 4) = acc;
    }
  }

  // The mask of a partial tile; with private tokens (priv), column c is private token c + pt.
  __device__ TreeMask tree_mask(int qslot, int row_base, int count, bool priv, int pt) const {
    const uint64_t all = low_bits(count);
    TreeMask tm{{all, all}};
    if (!priv) return tm;
    const uint64_t shared = low_bits(min(-pt, count));
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const int pv = row_tab(kRowPriv, qslot, row_base + (lane >> 2) + 8 * hr);
      tm.vis[hr] = (shared | (low_bits((pv >> 16) - pt) & ~low_bits((pv & 0xffff) - pt))) & all;
    }
    return tm;
  }

  template <int R>
  __device__ void tile(int stage, int qslot, int count, int rows, bool first, bool last, bool priv, int pt) {
    constexpr int C = 4 / R;
    constexpr int NW = kN / C;
    const int row_base = (warp / C) * 16;
    const int cb = (warp % C) * NW;
    const bool active = row_base < rows;
    unsigned char* kv = s.kv + static_cast<size_t>(stage) * Cfg::kKvStageBytes;
    const uint32_t q_base = smem_addr(s.q + static_cast<size_t>(qslot) * Cfg::kQSlotBytes);
    const uint32_t k_base = smem_addr(kv);
    const uint32_t v_base = k_base + kN * D * 2;
    constexpr bool kWg = R == 4 && kWgmma;
    if (first) {
      reset();
      if (active || kWg) load_q_regs(q_base, qslot, row_base, rows);  // wgmma: every warp (its rows of the 64)
    }
    if constexpr (kWg) {
      // Every tile on wgmma (every warp of the group, active or not); partial tiles and tiles with
      // private tokens (folded leaves) with the column mask.
      if (count == kN && !priv) {
        compute_wgmma<false>(k_base, v_base, first, TreeMask{});
      } else {
        compute_wgmma<true>(k_base, v_base, first, tree_mask(qslot, row_base, count, priv, pt));
      }
    } else {
      if (active && cb < count) {
        if (cb + NW <= count && !priv) {
          compute<NW, true>(q_base, k_base, v_base, row_base, cb, count, first, TreeMask{});
        } else {
          compute<NW, false>(q_base, k_base, v_base, row_base, cb, count, first, tree_mask(qslot, row_base, count, priv, pt));
        }
      }
    }
    if (last) {
      if constexpr (R == 4) {
        if (active) epilogue_direct(qslot, row_base, rows);
      } else {
        // A one-tile unit whose tokens all fall in column group 0 (e.g. a 16-token leaf): the other
        // groups saw nothing, so group 0's warps hold the final rows; no combine, no barriers
        // (the condition is uniform over the 4 warps).
        if (first && count <= NW) {
          if (active && warp % C == 0) epilogue_direct(qslot, row_base, rows);
        } else {
          epilogue_combine<R>(qslot, rows, reinterpret_cast<float*>(kv));
        }
      }
    }
  }

  __device__ void run() {
    int stage = 0;
    uint32_t parity = 0;
    // Every thread, after its last read of the stage: hand it back to the producer, move to the next.
    [[maybe_unused]] uint64_t sum_tile_cy = 0, tc = 0;  // FT_TRACE: full barrier -> release (cycles)
    auto release_stage = [&] {
      if constexpr (FT_TRACE) sum_tile_cy += clock64() - tc;
      mbar_arrive(&s.empty[stage]);
      if (++stage == Cfg::kStages) {
        stage = 0;
        parity ^= 1;
      }
    };
    [[maybe_unused]] int tiles_seen = 0, units_done = 0;  // FT_TRACE marks only
    [[maybe_unused]] uint64_t sum_wait = 0;                // FT_TRACE: full-barrier wait (ns)
    for (;;) {
      [[maybe_unused]] uint64_t tw = 0;
      if constexpr (FT_TRACE) tw = globaltimer_ns();
      mbar_wait(&s.full[stage], parity);
      if constexpr (FT_TRACE) {
        sum_wait += globaltimer_ns() - tw;
        tc = clock64();
      }
      if (FT_TRACE && warp == 0 && lane == 0 && tiles_seen == 0) trace_mark(p.trace, kTraceTree, kTrFirstFull);
      // Broadcast from lane 0: the compiler then knows every field is warp-uniform, so the wgmma
      // path is not treated as divergent (which would serialize its wgmmas).
      const int4 sm = s.meta[stage];
      const int4 meta = make_int4(__shfl_sync(kFullMask, sm.x, 0), __shfl_sync(kFullMask, sm.y, 0),
                                  __shfl_sync(kFullMask, sm.z, 0), __shfl_sync(kFullMask, sm.w, 0));
      if (meta.x < 0) break;
      if constexpr (FT_TRACE) ++tiles_seen;
      const int count = meta.y, rows = meta.z & 0xff, flags = meta.w;
      if constexpr (kWgmma) {
        // The common tile of a long 64-row unit (full, neither first nor last, no private tokens):
        // straight to the wgmma path, without tile()'s unit bookkeeping. The general path cost
        // 5-12 % on the compute-bound cells; the same shortcut for 32-row units (mma.sync) lost
        // more than it gained (PERF_NOTES.md, session 10).
        constexpr int kPlainMask = TileMetaBits::kFirst | TileMetaBits::kLast | TileMetaBits::kPriv | (7 << 4);
        if ((flags & kPlainMask) == (4 << 4) && count == kN) {
          const uint32_t kb = smem_addr(s.kv + static_cast<size_t>(stage) * Cfg::kKvStageBytes);
#if FT_TREE_PAIR
          if constexpr (Cfg::kStages >= 3) {
            // A plain middle tile is never a unit's last, so a next tile of the same unit comes:
            // wait for it here (its phase stays complete until this thread releases the stage).
            const int ns = stage + 1 == Cfg::kStages ? 0 : stage + 1;
            mbar_wait(&s.full[ns], ns == 0 ? parity ^ 1u : parity);
            const int4 nm0 = s.meta[ns];
            const int nflags = __shfl_sync(kFullMask, nm0.w, 0), ncount = __shfl_sync(kFullMask, nm0.y, 0);
            if ((nflags & kPlainMask) == (4 << 4) && ncount == kN) {
              const uint32_t kb1 = smem_addr(s.kv + static_cast<size_t>(ns) * Cfg::kKvStageBytes);
              compute_wgmma_pair(kb, kb + kN * D * 2, kb1, kb1 + kN * D * 2);
              release_stage();
              release_stage();
              continue;
            }
          }
#endif
          compute_wgmma<false>(kb, kb + kN * D * 2, false, TreeMask{});
          release_stage();
          continue;
        }
      }
      const bool first = (flags & TileMetaBits::kFirst) != 0;
      const bool last = (flags & TileMetaBits::kLast) != 0;
      const bool priv = (flags & TileMetaBits::kPriv) != 0;
      const int pt = static_cast<int>(static_cast<unsigned>(flags) >> 16) - 64;
      const int groups = (flags >> 4) & 7;
      const int qslot = (flags >> 8) & 0xff;
      // The kv head comes with the meta: a per-tile integer modulo (unit % Hkv) sat between the
      // full-barrier wait and the first wgmma, ~6 % of the consumer's stall samples (PERF_NOTES.md).
      const int kvh = static_cast<int>(static_cast<unsigned>(meta.z) >> 16);
      head0 = kvh * p.gqa;
      r0g = (meta.z >> 8) & 0xff;
      // In the 3-stage kernel a block of more than 16 rows runs as a 64-row wgmma tile whatever its
      // rows (upload() sets row_groups 4, row_groups_of; the producer zero-fills V rows to 64 for
      // either), so its 2-group mma.sync path is not compiled (PERF_NOTES.md, session 16).
      if (groups == 4 || (Cfg::kQGlobal && groups == 2)) {
        tile<4>(stage, qslot, count, rows, first, last, priv, pt);
      } else if (!Cfg::kQGlobal && groups == 2) {
        tile<2>(stage, qslot, count, rows, first, last, priv, pt);
      } else {
        tile<1>(stage, qslot, count, rows, first, last, priv, pt);
      }
      if (FT_TRACE && last && warp == 0 && lane == 0 && units_done++ == 0) trace_mark(p.trace, kTraceTree, kTrFirstUnit);
      // A unit's last tile may have used the stage as combine scratch (generic stores): ordered
      // before the producer's next TMA (async-proxy) writes into it.
      if (last && p.use_tma) fence_proxy_async_shared();
      release_stage();
    }
    if (warp == 0 && lane == 0) {
      trace_put(p.trace, kTraceTree, kTrConsWaitNs, sum_wait);
      trace_put(p.trace, kTraceTree, kTrConsTiles, static_cast<uint64_t>(tiles_seen));
      trace_put(p.trace, kTraceTree, kTrConsTileCy, sum_tile_cy);
      trace_mark(p.trace, kTraceTree, kTrConsumerEnd);
    }
  }
};

}  // namespace fasttree::cuda_detail
