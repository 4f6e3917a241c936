// Shared definitions of the tree-attention kernel (tree_attention_kernel.cuh): tile configuration,
// shared-memory layout, the XOR swizzle and the TileMeta handed from producer to consumers.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/device_plan.h"
#include "cuda/ptx.cuh"
#include "cuda/trace.cuh"

namespace fasttree::cuda_detail {

#ifndef FT_TREE_PAIR  // A/B builds: -DFT_TREE_PAIR=1 runs pairs of full middle tiles as 64 x 128 steps
#define FT_TREE_PAIR 0
#endif
#ifndef FT_TREE_MIN_BLOCKS  // A/B builds: -DFT_TREE_MIN_BLOCKS=1 gives the d <= 128 kernels 1 CTA's registers
#define FT_TREE_MIN_BLOCKS 2
#endif

#ifndef FT_TREE_DEEP_MIN_BLOCKS  // A/B builds: CTAs per SM the 3-stage (kQGlobal) kernel's registers target
#define FT_TREE_DEEP_MIN_BLOCKS FT_TREE_MIN_BLOCKS
#endif
#ifndef FT_TREE_LOOK_CAP  // A/B builds: at most this many block records gathered ahead (<= kMaxRecordLook)
#define FT_TREE_LOOK_CAP kMaxRecordLook
#endif
#ifndef FT_TREE_DEEP_STAGES  // A/B builds: K/V ring depth of the 3-stage (kQGlobal) kernel
#define FT_TREE_DEEP_STAGES 3
#endif

#ifndef FT_TREE_WGMMA  // A/B builds: -DFT_TREE_WGMMA=0 runs every tile on mma.sync (PERF_NOTES.md)
#define FT_TREE_WGMMA 1
#endif

// kDeep (d = 128 only; TreeKernelConfig<D, true> is the plain config at other head dims): the
// 3-stage variant (kQGlobal below), chosen per backend by GQA ratio (tree_attention.cpp).
template <int D, bool kDeep = false>
struct TreeKernelConfig {
  static_assert(D == 64 || D == 128 || D == 256, "head_dim must be 64, 128 or 256");
  static constexpr int kN = kKvTile;
  static constexpr int kM = kMaxBlockRows;
  // kQGlobal: the consumers load their Q fragments straight from global memory at a unit's first
  // tile (the producer only prefetches the rows into L2), so no Q slots take shared memory and the
  // ring gets a third stage at two CTAs per SM (two stages and two 16 KB Q slots otherwise).
  static constexpr bool kQGlobal = kDeep && D == 128;
  static constexpr int kStages = kQGlobal ? FT_TREE_DEEP_STAGES : D <= 64 ? 4 : 2;
  static constexpr int kQSlots = kQGlobal ? 0 : kStages;
  // Block records are gathered kLook units ahead into a ring of kRecSlots (tree_attention_producer.cuh).
  static constexpr int kLook = kStages + 1 <= FT_TREE_LOOK_CAP ? kStages + 1 : FT_TREE_LOOK_CAP;
  static constexpr int kRecSlots = kLook + 1;
  static_assert(kLook <= kMaxRecordLook);
  // A record slot holds the whole BlockRecord, or at d = 64 the record without its tile table (the
  // record's last fields: its 4-stage ring leaves no room at 2 CTAs per SM).
  static constexpr int kRecTiles = D >= 128 ? kRecordTiles : 0;
  static constexpr int kRecSlotBytes = kRecTiles > 0 ? kRecordBytes : kRecordBytes - kRecordTableBytes;
  static_assert(kRecSlotBytes % 16 == 0);
  static constexpr int kConsumerThreads = 128;
  static constexpr int kThreads = kConsumerThreads + 32;
  static constexpr int kMinBlocks = D <= 128 ? (kQGlobal ? FT_TREE_DEEP_MIN_BLOCKS : FT_TREE_MIN_BLOCKS) : 1;  // CTAs per SM the register budget targets
  static constexpr bool kQInRegs = D <= 128;           // d = 256 re-reads Q fragments from shared
  static constexpr bool kWgmma = FT_TREE_WGMMA && D <= 128;  // 64-row blocks on wgmma (consumer)
  // Shared memory (bytes): K/V ring [kStages][2][kN][D] T, Q slots [kQSlots][kM][D] T, block
  // records [kRecSlots] BlockRecord, their unit ids [kRecSlots] int32 (padded to 16 bytes), row
  // tables [kRowTables][kStages][kM] int32 (RowTable), TileMeta [kStages], combine (m, l)
  // [4 warps][16 rows] float2, mbarriers full/empty [kStages].
  // d = 64 has no head table (two CTAs per SM would not fit): heads are computed from row0 % g.
  static constexpr bool kHeadTable = D >= 128;
  static constexpr int kRowTables = kHeadTable ? 4 : 3;
  static constexpr int kKvStageBytes = 2 * kN * D * 2;
  static constexpr int kQSlotBytes = kM * D * 2;
  static constexpr int kQOff = kStages * kKvStageBytes;
  static constexpr int kRecOff = kQOff + kQSlots * kQSlotBytes;
  static constexpr int kRecUnitOff = kRecOff + kRecSlots * kRecSlotBytes;
  static constexpr int kRowOff = kRecUnitOff + (kRecSlots * 4 + 15) / 16 * 16;
  static constexpr int kMetaOff = kRowOff + kRowTables * kStages * kM * 4;
  static constexpr int kMlOff = kMetaOff + kStages * 16;
  static constexpr int kBarOff = kMlOff + 4 * 16 * 8;
  // + 1 KB: the kernel aligns its shared-memory base to 1024 bytes (swizzled wgmma tiles).
  static constexpr int kSmemBytes = kBarOff + 2 * kStages * 8 + 1024;
  static_assert(kKvStageBytes % 1024 == 0 && kQOff % 1024 == 0 && kQSlotBytes % 1024 == 0);
  // The R < 4 combine writes [4 warps][16 rows][D] fp32 into one stage's K/V space.
  static_assert(4 * 16 * D * 4 <= kKvStageBytes);
  // Two CTAs per SM (D <= 128) must fit in 228 KB with 1 KB reserved per CTA.
  static_assert(kMinBlocks * (kSmemBytes + 1024) <= 228 * 1024);
};

// Row tables of a Q slot, written by the producer from QueryInfo, read by the consumers (Q rows,
// masks, epilogue): table t of Q slot qs is row_tab + (t * kStages + qs) * kM.
// kRowPriv: the row's private interval [lo, hi) packed lo | hi << 16 (tree_attention_consumer.cuh).
// kRowHead (the row's query head) exists when TreeKernelConfig::kHeadTable.
enum RowTable { kRowDst = 0, kRowPriv = 1, kRowQuery = 2, kRowHead = 3 };

// Element offset of (row, col) in a shared [rows][D] tile of 16-bit elements whose 16-byte chunks
// are XOR-swizzled by row % 8, so every ldmatrix phase reads 8 distinct bank groups (row pitch D;
// the prefill kernel and the staged warp kernel).
template <int D>
__device__ __forceinline__ int swz(int row, int col) {
  return row * D + ((((col >> 3) ^ (row & 7))) << 3) + (col & 7);
}

// The tree kernel's [64][D] tiles (K, V, Q slots): D / 64 column blocks of [64 rows][64 elements]
// (128-byte rows, 8 KB per block), 16-byte chunks XOR-swizzled by row % 8: the canonical
// 128-byte-swizzle layout of wgmma operands (K-major for Q and K, N-major for V; tiles 1024-byte
// aligned), which ldmatrix reads without bank conflicts as well.
template <int D>
__device__ __forceinline__ int swz64(int row, int col) {
  return (col >> 6) * (64 * 64) + row * 64 + ((((col >> 3) & 7) ^ (row & 7)) << 3) + (col & 7);
}

// TileMeta as stored in shared memory (one int4): unit (-1 = no more work), valid tokens, block
// rows | (row0 % g) << 8 | kv head << 16 (row r's query head is kvh * g + (row0 % g + r) % g), flags = first | last << 1 | priv << 3 | row_groups << 4 | q_slot << 8 |
// (pt + 64) << 16 (priv: the tile holds private tokens, and pt = the tile's first token minus the
// block's shared_len, >= -63, so that tile column c is private token c + pt and the first
// max(0, -pt) columns are shared).
struct TileMetaBits {
  static constexpr int kFirst = 1, kLast = 2, kPriv = 8;
};

constexpr unsigned kFullMask = 0xffffffffu;

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

__device__ __forceinline__ int64_t shfl_i64(int64_t x, int src) {
  const int lo = __shfl_sync(kFullMask, static_cast<int>(x & 0xffffffff), src);
  const int hi = __shfl_sync(kFullMask, static_cast<int>(x >> 32), src);
  return (static_cast<int64_t>(hi) << 32) | static_cast<uint32_t>(lo);
}

// Where a block row's result goes: dst >= 0 is a direct query (row of out, LSE in lse when given),
// dst < 0 the partial row ~dst (partial, partial_lse); h is the row's query head.
template <int D>
__device__ __forceinline__ void row_pointers(const TreeAttnParams& p, int dst, int h, float*& orow, float*& lrow) {
  if (dst >= 0) {
    orow = p.out + (static_cast<int64_t>(dst) * p.num_qo_heads + h) * D;
    lrow = p.lse != nullptr ? p.lse + static_cast<int64_t>(dst) * p.num_qo_heads + h : nullptr;
  } else {
    const int64_t pr = ~dst;
    orow = p.partial + (pr * p.num_qo_heads + h) * D;
    lrow = p.partial_lse + pr * p.num_qo_heads + h;
  }
}

// Scores of NT n-tiles (columns i * 8 + 2 tq + {0, 1} of rows g, g + 8) to the log2 domain, columns
// >= count masked to -inf; mx gets this thread's maxima of rows g and g + 8 (the warp-per-unit
// kernels' softmax front end, before softmax_step).
template <int NT>
__device__ __forceinline__ void scale_mask_max(float (&sc)[NT][4], int count, int tq, float scale, float (&mx)[2]) {
  mx[0] = mx[1] = neg_inf();
#pragma unroll
  for (int i = 0; i < NT; ++i) {
    const int col = i * 8 + 2 * tq;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float x = col + (e & 1) < count ? sc[i][e] * scale : neg_inf();
      sc[i][e] = x;
      mx[e >> 1] = fmaxf(mx[e >> 1], x);
    }
  }
}

// Online-softmax step of one mma.sync accumulator fragment (rows g and g + 8 of a 16-row group,
// the quad layout), shared by the warp-per-unit kernels and prefill. sc: NT n-tiles of scores
// already in the log2 domain and masked (-inf); mx: this thread's maxima of rows g and g + 8 of
// them. The maxima are reduced over the quad, m (running max) and l (running sum, per thread) are
// updated, sc becomes P = 2^(s - m), and alpha is the factor by which O must be rescaled (0 while
// m was -inf: nothing seen yet, exponents stay -inf -> 0).
template <int NT>
__device__ __forceinline__ void softmax_step(float (&sc)[NT][4], float (&mx)[2], float (&m)[2], float (&l)[2],
                                             float (&alpha)[2]) {
  float mu[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    mx[r] = fmaxf(mx[r], __shfl_xor_sync(kFullMask, mx[r], 1));
    mx[r] = fmaxf(mx[r], __shfl_xor_sync(kFullMask, mx[r], 2));
    const float m_new = fmaxf(m[r], mx[r]);
    mu[r] = m_new == neg_inf() ? 0.0f : m_new;
    alpha[r] = fast_exp2(m[r] - mu[r]);
    m[r] = m_new;
    l[r] *= alpha[r];
  }
#pragma unroll
  for (int i = 0; i < NT; ++i) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float pe = fast_exp2(sc[i][e] - mu[e >> 1]);
      sc[i][e] = pe;
      l[e >> 1] += pe;
    }
  }
}

// O *= alpha per row of a fragment's N n-tiles (elements 0, 1: row g; 2, 3: row g + 8).
template <int N>
__device__ __forceinline__ void rescale_rows(float (&o)[N][4], const float (&alpha)[2]) {
#pragma unroll
  for (int i = 0; i < N; ++i) {
    o[i][0] *= alpha[0];
    o[i][1] *= alpha[0];
    o[i][2] *= alpha[1];
    o[i][3] *= alpha[1];
  }
}

struct SmemLayout {
  unsigned char* kv;  // [kStages][2][kN][D]
  unsigned char* q;   // [kQSlots][kM][D]
  unsigned char* rec; // [kRecSlots] BlockRecord
  int* rec_unit;      // [kRecSlots]
  int* row_tab;       // [kRowTables][kStages][kM]
  int4* meta;         // [kStages]
  float2* ml;         // [4][16]
  uint64_t* full;     // [kStages]
  uint64_t* empty;    // [kStages]
};

}  // namespace fasttree::cuda_detail
