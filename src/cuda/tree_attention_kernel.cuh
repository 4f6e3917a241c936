// FastTree tree-attention kernel (DESIGN.md §4): one persistent launch over all (block, kv head)
// units of a plan (device_plan.h).
//
// CTA = 5 warps. Warp 4 is the producer: it claims units (atomic counter, or static round-robin),
// walks each unit's context chunk in tiles of kN = 64 tokens, resolves every token to its KV slot
// through the vnode's segments and tree.slots, and gathers the token rows of K and V (and, on a unit's
// first tile, the unit's Q rows) into shared memory with 16-byte cp.async. Stage s of the kStages-deep
// ring is handed over with mbarriers: full[s] (each producer lane arrives once when its cp.asyncs
// land and once after its plain shared stores: TileMeta, row tables) and empty[s] (every consumer
// thread arrives after its last read of the stage). The producer runs up
// to kStages tiles ahead, across unit boundaries, so the next unit's loads are in flight while the
// consumers finish the current one; its own latency chain (claim -> block descriptor -> segment
// window and query ids -> slot ids -> cp.async) is software-pipelined three units / one tile deep.
//
// Warps 0-3 are consumers. A block of `rows` query rows (row = query_in_tile * g + head_in_group)
// is R = 1, 2 or 4 groups of 16 rows; the 4 warps are R row groups x C = 4/R column groups, so
// warp w owns rows [16 (w / C), +16) of the Q tile and columns [(w % C) * kN / C, +kN / C) of every
// KV tile. Per tile: S = Q K^T (mma.sync m16n8k16, fp32 accumulate; A = Q from registers or shared,
// B = K via ldmatrix), online softmax in fp32 (exp2 with sm_scale*log2(e) folded in, masked columns
// -inf, every -inf case guarded), O += P V (P re-packed from the S accumulators, V via
// ldmatrix.trans). Shared tiles are [rows][d] with the 16-byte chunks of row r XOR-swizzled by r % 8,
// so every ldmatrix phase reads 8 distinct bank groups. After a unit's last tile: R = 4 writes the
// normalized rows straight from registers; R < 4 first combines the C column groups of each row
// through shared memory (LSE-weighted, in the just-consumed stage's K/V space) and writes
// coalesced float4 rows. Rows go to O[query] (+ LSE) for direct queries, else to partial rows that
// the merge kernel (merge_kernel.cu) combines. TODO: fuse the merge (the last CTA to finish a query
// merges it) to save a launch.
//
// Two copy variants (template V, see TreeKernelConfig): 16-byte cp.async into XOR-swizzled rows
// (default), or copy-engine bulk copies of whole rows into padded rows. Measurements and the
// known bottleneck (a single producer warp keeps too few bytes in flight) are in PERF_NOTES.md.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/device_plan.h"
#include "cuda/ptx.cuh"

namespace fasttree::cuda_detail {

// Copy variant V (both keep every tile's invariant: rows up to round_up(count, 16) hold K/V or
// zeros, rows of Q up to round_up(rows, 16) hold Q or zeros):
//   V = 0  cp.async: 16-byte copies by the 32 producer lanes into rows whose 16-byte chunks are
//          XOR-swizzled by row % 8; zero rows by cp.async zero-fill.
//   V = 1  bulk copy (sm_90 copy engine, cp.async.bulk): one instruction per token row
//          (d * 2 bytes) completing as mbarrier transactions; rows padded by 16 bytes (conflict-free
//          ldmatrix without a swizzle); zero rows copied from a zero row in global memory. 16x fewer
//          producer instructions per tile.
template <int D, int V = 0>
struct TreeKernelConfig {
  static_assert(D == 64 || D == 128 || D == 256, "head_dim must be 64, 128 or 256");
  static_assert(V == 0 || V == 1, "copy variant 0 (cp.async) or 1 (bulk copy)");
  static constexpr bool kBulk = V == 1;
  static constexpr int kN = kKvTile;
  static constexpr int kM = kMaxBlockRows;
  static constexpr int kStages = D <= 64 ? (kBulk ? 3 : 4) : 2;
  static constexpr int kConsumerThreads = 128;
  static constexpr int kThreads = kConsumerThreads + 32;
  static constexpr int kMinBlocks = D <= 128 ? 2 : 1;  // CTAs per SM the register budget targets
  static constexpr bool kQInRegs = D <= 128;           // d = 256 re-reads Q fragments from shared
  static constexpr int kRowElems = kBulk ? D + 8 : D;   // shared row pitch in elements
  // Shared memory (bytes): K/V ring [kStages][2][kN][kRowElems] T, Q slots [kStages][kM][kRowElems] T,
  // row tables [kStages][kM] int32 (destination, qo head), TileMeta [kStages], combine
  // (m, l) [4 warps][16 rows] float2, mbarriers full/empty [kStages].
  static constexpr int kKvStageBytes = 2 * kN * kRowElems * 2;
  static constexpr int kQSlotBytes = kM * kRowElems * 2;
  static constexpr int kQOff = kStages * kKvStageBytes;
  static constexpr int kRowDstOff = kQOff + kStages * kQSlotBytes;
  static constexpr int kRowHeadOff = kRowDstOff + kStages * kM * 4;
  static constexpr int kMetaOff = kRowHeadOff + kStages * kM * 4;
  static constexpr int kMlOff = kMetaOff + kStages * 16;
  static constexpr int kBarOff = kMlOff + 4 * 16 * 8;
  static constexpr int kSmemBytes = kBarOff + 2 * kStages * 8;
  // The R < 4 combine writes [4 warps][16 rows][D] fp32 into one stage's K/V space.
  static_assert(4 * 16 * D * 4 <= kKvStageBytes);
};

// Element offset of (row, col) in a shared [rows][D] tile of 16-bit elements: 16-byte chunks
// XOR-swizzled by row % 8 (V = 0), or rows padded to D + 8 elements (V = 1).
template <int D, int V = 0>
__device__ __forceinline__ int swz(int row, int col) {
  if constexpr (V == 1) {
    return row * (D + 8) + col;
  } else {
    return row * D + ((((col >> 3) ^ (row & 7))) << 3) + (col & 7);
  }
}

// TileMeta as stored in shared memory (one int4): unit (-1 = no more work), valid tokens, block
// rows, flags = first | last << 1 | row_groups << 4 | q_slot << 8.
struct TileMetaBits {
  static constexpr int kFirst = 1, kLast = 2;
};

constexpr unsigned kFullMask = 0xffffffffu;

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

__device__ __forceinline__ int64_t shfl_i64(int64_t x, int src) {
  const int lo = __shfl_sync(kFullMask, static_cast<int>(x & 0xffffffff), src);
  const int hi = __shfl_sync(kFullMask, static_cast<int>(x >> 32), src);
  return (static_cast<int64_t>(hi) << 32) | static_cast<uint32_t>(lo);
}

struct SmemLayout {
  unsigned char* kv;  // [kStages][2][kN][D]
  unsigned char* q;   // [kStages][kM][D]
  int* row_dst;       // [kStages][kM]
  int* row_head;      // [kStages][kM]
  int4* meta;         // [kStages]
  float2* ml;         // [4][16]
  uint64_t* full;     // [kStages]
  uint64_t* empty;    // [kStages]
};

// ------------------------------------------------------------------------------------------------
// Producer (warp 4)

// Everything the producer knows about one unit. Lane-distributed fields: the segment window
// (segment s0 + lane) and the query info of rows lane and lane + 32.
struct UnitCtx {
  int unit;  // >= num_units: none
  int kvh;
  BlockDesc d;
  int s0, nwin;  // window = segments [s0, s0 + nwin), nwin <= 32
  int64_t win_off;
  int win_tb, win_end;
  int q[2], dst[2];
};

template <class T, int D, int V>
struct Producer {
  using Cfg = TreeKernelConfig<D, V>;
  static constexpr int kN = Cfg::kN;
  static constexpr int kCpr = D / 8;        // 16-byte chunks per row
  static constexpr int kRpp = 32 / kCpr;    // rows per warp-wide pass
  static constexpr int kPasses = kN / kRpp;

  const TreeAttnParams& p;
  const SmemLayout& s;
  int lane;
  int num_units;
  int pending = 0;      // lane 0: result of the claim issued one take() earlier
  int static_next = 0;  // static round-robin cursor

  __device__ Producer(const TreeAttnParams& params, const SmemLayout& smem, int lane_id)
      : p(params), s(smem), lane(lane_id) {
    num_units = p.counts->num_units;
    if (p.work_counter != nullptr && lane == 0) pending = static_cast<int>(gridDim.x) + atomicAdd(p.work_counter, 1);
  }

  // Next unit for this CTA (>= num_units once the work is exhausted). CTA b's first unit is b; the
  // later ones come from the counter (offset by the grid size), and the atomic result used now was
  // requested one call earlier, so its latency overlaps a unit's worth of work.
  __device__ int take() {
    if (static_next == 0 || p.work_counter == nullptr) {
      return static_cast<int>(blockIdx.x) + (static_next++) * static_cast<int>(gridDim.x);
    }
    const int u = __shfl_sync(kFullMask, pending, 0);
    if (lane == 0 && u < num_units) pending = static_cast<int>(gridDim.x) + atomicAdd(p.work_counter, 1);
    return u;
  }

  __device__ void set_unit(UnitCtx& c, int unit) const {
    c.unit = unit;
    if (unit >= num_units) return;
    const int block = unit / p.num_kv_heads;
    c.kvh = unit - block * p.num_kv_heads;
    const int4* src = reinterpret_cast<const int4*>(p.blocks + block);
    const int4 a = __ldg(src), b = __ldg(src + 1);
    c.d = BlockDesc{a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
  }

  __device__ void load_window(UnitCtx& c, int s0) const {
    c.s0 = s0;
    c.nwin = min(32, c.d.seg_end - s0);
    c.win_tb = 0x7fffffff;
    c.win_end = 0x7fffffff;
    c.win_off = 0;
    if (lane < c.nwin) {
      const int4 seg = __ldg(reinterpret_cast<const int4*>(p.segments + s0 + lane));
      c.win_off = (static_cast<int64_t>(seg.y) << 32) | static_cast<uint32_t>(seg.x);
      c.win_tb = seg.z;
      c.win_end = seg.z + seg.w;
    }
  }

  // Window and query ids of a unit whose descriptor is loaded.
  __device__ void load_unit_data(UnitCtx& c) const {
    if (c.unit >= num_units) return;
    load_window(c, c.d.seg_first);
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int r = lane + 32 * j;
      c.q[j] = 0;
      c.dst[j] = -1;
      if (r < c.d.rows) {
        const int i = (c.d.row0 + r) / p.gqa;
        const int2 qi = __ldg(reinterpret_cast<const int2*>(p.qinfo + c.d.qinfo_begin + i));
        c.q[j] = qi.x;
        c.dst[j] = qi.y;
      }
    }
  }

  // Index in the window of the last segment starting at or before tok (tok >= window start).
  __device__ int window_search(const UnitCtx& c, int tok) const {
    int k = 0;
#pragma unroll
    for (int step = 16; step >= 1; step >>= 1) {
      const int cand = k + step;
      const int tb = __shfl_sync(kFullMask, c.win_tb, cand & 31);
      if (cand < c.nwin && tb <= tok) k = cand;
    }
    return k;
  }

  // Makes the window cover tokens [first, first + 31] (or to the end of the vnode). Rarely reloads:
  // only vnodes with more than 32 segments need it.
  __device__ void ensure_window(UnitCtx& c, int first) const {
    while (c.nwin == 32) {
      const int last_end = __shfl_sync(kFullMask, c.win_end, 31);
      if (first + 31 < last_end) break;
      const int k = first >= last_end ? 32 : window_search(c, first);
      if (k == 0) break;  // the window starts at first's segment: 32 segments cover 32 tokens
      load_window(c, c.s0 + k);
    }
  }

  // KV slots of tile t of unit c for rows lane (out[0]) and lane + 32 (out[1]). The loads are only
  // issued here; their values are used one tile later.
  __device__ void tile_slots(UnitCtx& c, int t, int (&out)[2]) const {
    const int base = c.d.kv_begin + t * kN;
    const int count = min(kN, c.d.kv_len - t * kN);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      out[h] = 0;
      if (32 * h < count) {
        const int first = base + 32 * h;
        ensure_window(c, first);
        const int tok = first + lane;
        const int k = window_search(c, tok);
        const int64_t off = shfl_i64(c.win_off, k);
        const int tb = __shfl_sync(kFullMask, c.win_tb, k);
        const int64_t idx = 32 * h + lane < count ? off + (tok - tb) : 0;
        out[h] = __ldg(p.slots + idx);
      }
    }
  }

  // Q rows of unit c into Q slot `qslot`, plus the slot's row tables (destination, qo head).
  // Returns the bytes of asynchronous transactions it started on full[stage] (bulk variant).
  __device__ uint32_t issue_q(const UnitCtx& c, int qslot, int stage) const {
    const T* qg = static_cast<const T*>(p.q);
    const uint32_t sq = smem_addr(s.q + static_cast<size_t>(qslot) * Cfg::kQSlotBytes);
    int64_t qoff[2];
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int r = lane + 32 * j;
      qoff[j] = -1;
      if (r < c.d.rows) {
        const int h = c.kvh * p.gqa + (c.d.row0 + r) % p.gqa;
        qoff[j] = (static_cast<int64_t>(c.q[j]) * p.num_qo_heads + h) * D;
        s.row_dst[qslot * Cfg::kM + r] = c.dst[j];
        s.row_head[qslot * Cfg::kM + r] = h;
      }
    }
    const int fill = (c.d.rows + 15) & ~15;
    if constexpr (Cfg::kBulk) {
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int r = lane + 32 * j;
        if (r < fill)
          bulk_copy_g2s(sq + swz<D, V>(r, 0) * 2, qoff[j] >= 0 ? static_cast<const void*>(qg + qoff[j]) : p.zeros, D * 2,
                        &s.full[stage]);
      }
      return static_cast<uint32_t>(fill) * D * 2;
    } else {
      const int sub = lane / kCpr, chunk = lane % kCpr;
#pragma unroll 4
      for (int r0 = 0; r0 < fill; r0 += kRpp) {
        const int row = r0 + sub;
        const int64_t off = shfl_i64(r0 < 32 ? qoff[0] : qoff[1], row & 31);
        const bool valid = off >= 0;
        cp_async_16(sq + swz<D, V>(row, chunk * 8) * 2, qg + (valid ? off + chunk * 8 : 0), valid ? 16 : 0);
      }
      return 0;
    }
  }

  // K and V rows of one tile into stage `stage`; rows in [count, round_up(count, 16)) are zeroed,
  // rows beyond are never read.
  // Returns the bytes of asynchronous transactions it started on full[stage] (bulk variant).
  __device__ uint32_t issue_kv(const UnitCtx& c, int count, int stage, const int (&slot)[2]) const {
    const T* kg = static_cast<const T*>(p.k);
    const T* vg = static_cast<const T*>(p.v);
    const uint32_t sk = smem_addr(s.kv + static_cast<size_t>(stage) * Cfg::kKvStageBytes);
    const uint32_t sv = sk + kN * Cfg::kRowElems * 2;
    const int64_t row_stride = static_cast<int64_t>(p.num_kv_heads) * D;
    const int64_t head_off = static_cast<int64_t>(c.kvh) * D;
    const int fill = (count + 15) & ~15;
    if constexpr (Cfg::kBulk) {
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int r = lane + 32 * j;  // this lane holds row r's slot
        if (r < fill) {
          const bool valid = r < count;
          const int64_t off = static_cast<int64_t>(slot[j]) * row_stride + head_off;
          const uint32_t so = swz<D, V>(r, 0) * 2;
          bulk_copy_g2s(sk + so, valid ? static_cast<const void*>(kg + off) : p.zeros, D * 2, &s.full[stage]);
          bulk_copy_g2s(sv + so, valid ? static_cast<const void*>(vg + off) : p.zeros, D * 2, &s.full[stage]);
        }
      }
      return static_cast<uint32_t>(fill) * D * 2 * 2;
    }
    const int sub = lane / kCpr, chunk = lane % kCpr;
#pragma unroll 8
    for (int ps = 0; ps < kPasses; ++ps) {
      if (ps * kRpp < fill) {
        const int row = ps * kRpp + sub;
        const int sl = __shfl_sync(kFullMask, ps * kRpp < 32 ? slot[0] : slot[1], row & 31);
        const bool valid = row < count;
        const int64_t off = valid ? static_cast<int64_t>(sl) * row_stride + head_off + chunk * 8 : 0;
        const uint32_t so = swz<D, V>(row, chunk * 8) * 2;
        cp_async_16(sk + so, kg + off, valid ? 16 : 0);
        cp_async_16(sv + so, vg + off, valid ? 16 : 0);
      }
    }
    return 0;
  }

  // Publishes stage `stage`: meta by lane 0; every lane arrives once for its cp.async (when they
  // land) and once for its plain shared stores (meta, row tables), so no ordering relies on
  // __syncwarp.
  // Bulk variant: one arrival per lane, lane 0's also expecting the stage's `tx_bytes`.
  __device__ void publish(int stage, int4 meta, uint32_t tx_bytes) const {
    if (lane == 0) s.meta[stage] = meta;
    if constexpr (Cfg::kBulk) {
      if (lane == 0) {
        mbar_arrive_expect_tx(&s.full[stage], tx_bytes);
      } else {
        mbar_arrive(&s.full[stage]);
      }
    } else {
      mbar_arrive_cp_async(&s.full[stage]);
      mbar_arrive(&s.full[stage]);
    }
  }

  __device__ void run() {
    UnitCtx a, b, c;  // current unit, next (window + query ids loaded), next-next (descriptor loaded)
    set_unit(a, take());
    load_unit_data(a);
    set_unit(b, take());
    load_unit_data(b);
    set_unit(c, take());

    int stage = 0;
    uint32_t parity = 1;  // empty barriers: the first round passes at once
    int unit_seq = 0, t = 0;
    // Slot ids of the tile issued next. They are loaded at the end of the previous iteration, straight
    // into the registers that issue_kv reads, so their latency overlaps the empty-barrier wait and no
    // register copy has to wait for them.
    int slots[2] = {0, 0};
    if (a.unit < num_units) tile_slots(a, 0, slots);
    while (a.unit < num_units) {
      const int ntiles = (a.d.kv_len + kN - 1) / kN;
      const bool last = t == ntiles - 1;
      mbar_wait(&s.empty[stage], parity);
      const int count = min(kN, a.d.kv_len - t * kN);
      const int qslot = unit_seq % Cfg::kStages;
      uint32_t tx = 0;
      if (t == 0) tx += issue_q(a, qslot, stage);
      tx += issue_kv(a, count, stage, slots);
      const int flags = (t == 0 ? TileMetaBits::kFirst : 0) | (last ? TileMetaBits::kLast : 0) |
                        (a.d.row_groups << 4) | (qslot << 8);
      publish(stage, make_int4(a.unit, count, a.d.rows, flags), tx);
      if (++stage == Cfg::kStages) {
        stage = 0;
        parity ^= 1;
      }
      if (last) {
        a = b;
        b = c;
        load_unit_data(b);
        set_unit(c, take());
        ++unit_seq;
        t = 0;
      } else {
        ++t;
      }
      if (a.unit < num_units) tile_slots(a, t, slots);
    }
    mbar_wait(&s.empty[stage], parity);
    publish(stage, make_int4(-1, 0, 0, 0), 0);
    cp_async_wait_all();
  }
};

// ------------------------------------------------------------------------------------------------
// Consumers (warps 0-3)

template <class T, int D, int V>
struct Consumer {
  using Cfg = TreeKernelConfig<D, V>;
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

  __device__ Consumer(const TreeAttnParams& params, const SmemLayout& smem, int w, int ln)
      : p(params), s(smem), warp(w), lane(ln) {}

  __device__ void reset() {
#pragma unroll
    for (int i = 0; i < kDT; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;
    m[0] = m[1] = neg_inf();
    l[0] = l[1] = 0.0f;
  }

  __device__ void load_q_regs(uint32_t q_base, int row_base) {
    if constexpr (Cfg::kQInRegs) {
      const int row = row_base + (lane & 15);
#pragma unroll
      for (int kk = 0; kk < kKSteps; ++kk) ldmatrix_x4(qf[kk], q_base + swz<D, V>(row, kk * 16 + (lane >> 4) * 8) * 2);
    }
  }

  // One KV tile for the warp's 16 rows x NW columns starting at column cb.
  template <int NW>
  __device__ void compute(uint32_t q_base, uint32_t k_base, uint32_t v_base, int row_base, int cb, int count) {
    constexpr int NT = NW / 8;
    float sc[NT][4];
#pragma unroll
    for (int i = 0; i < NT; ++i) sc[i][0] = sc[i][1] = sc[i][2] = sc[i][3] = 0.0f;

    // S = Q K^T
#pragma unroll
    for (int kk = 0; kk < kKSteps; ++kk) {
      uint32_t a[4];
      if constexpr (Cfg::kQInRegs) {
        a[0] = qf[kk][0];
        a[1] = qf[kk][1];
        a[2] = qf[kk][2];
        a[3] = qf[kk][3];
      } else {
        ldmatrix_x4(a, q_base + swz<D, V>(row_base + (lane & 15), kk * 16 + (lane >> 4) * 8) * 2);
      }
#pragma unroll
      for (int j = 0; j < NT / 2; ++j) {
        if (cb + 16 * j < count) {
          const int row = cb + 16 * j + ((lane >> 4) << 3) + (lane & 7);
          const int col = kk * 16 + (((lane >> 3) & 1) << 3);
          uint32_t bk[4];
          ldmatrix_x4(bk, k_base + swz<D, V>(row, col) * 2);
          mma_16816<T>(sc[2 * j], a, bk[0], bk[1]);
          mma_16816<T>(sc[2 * j + 1], a, bk[2], bk[3]);
        }
      }
    }

    // Online softmax (log2 domain): mask, row max over the quad, rescale, exponentiate.
    const int tq = lane & 3;
    const float scale = p.scale_log2;
    float mx[2] = {neg_inf(), neg_inf()};
#pragma unroll
    for (int i = 0; i < NT; ++i) {
      const int col = cb + i * 8 + 2 * tq;
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float x = col + (e & 1) < count ? sc[i][e] * scale : neg_inf();
        sc[i][e] = x;
        mx[e >> 1] = fmaxf(mx[e >> 1], x);
      }
    }
    float mu[2], alpha[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      mx[r] = fmaxf(mx[r], __shfl_xor_sync(kFullMask, mx[r], 1));
      mx[r] = fmaxf(mx[r], __shfl_xor_sync(kFullMask, mx[r], 2));
      const float m_new = fmaxf(m[r], mx[r]);
      mu[r] = m_new == neg_inf() ? 0.0f : m_new;  // all masked so far: exponents stay -inf -> 0
      alpha[r] = fast_exp2(m[r] - mu[r]);         // m = -inf -> 0
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
#pragma unroll
    for (int i = 0; i < kDT; ++i) {
      o[i][0] *= alpha[0];
      o[i][1] *= alpha[0];
      o[i][2] *= alpha[1];
      o[i][3] *= alpha[1];
    }

    // O += P V, 16 tokens per k-step.
#pragma unroll
    for (int j = 0; j < NT / 2; ++j) {
      if (cb + 16 * j < count) {
        uint32_t a[4];
        a[0] = pack2<T>(sc[2 * j][0], sc[2 * j][1]);
        a[1] = pack2<T>(sc[2 * j][2], sc[2 * j][3]);
        a[2] = pack2<T>(sc[2 * j + 1][0], sc[2 * j + 1][1]);
        a[3] = pack2<T>(sc[2 * j + 1][2], sc[2 * j + 1][3]);
        const int row = cb + 16 * j + (((lane >> 3) & 1) << 3) + (lane & 7);
#pragma unroll
        for (int dn = 0; dn < D / 16; ++dn) {
          uint32_t bv[4];
          ldmatrix_x4_trans(bv, v_base + swz<D, V>(row, (2 * dn + (lane >> 4)) * 8) * 2);
          mma_16816<T>(o[2 * dn], a, bv[0], bv[1]);
          mma_16816<T>(o[2 * dn + 1], a, bv[2], bv[3]);
        }
      }
    }
  }

  // Destination of block row r of Q slot qslot.
  __device__ void row_dest(int qslot, int r, float*& orow, float*& lrow) const {
    const int dst = s.row_dst[qslot * Cfg::kM + r];
    const int h = s.row_head[qslot * Cfg::kM + r];
    if (dst >= 0) {
      orow = p.out + (static_cast<int64_t>(dst) * p.num_qo_heads + h) * D;
      lrow = p.lse != nullptr ? p.lse + static_cast<int64_t>(dst) * p.num_qo_heads + h : nullptr;
    } else {
      const int64_t pr = ~dst;
      orow = p.partial + (pr * p.num_qo_heads + h) * D;
      lrow = p.partial_lse + pr * p.num_qo_heads + h;
    }
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
      float* srow = scratch + (warp * 16 + r16) * D;
#pragma unroll
      for (int i = 0; i < kDT; ++i) {
        const int col = (i * 8 + 2 * tq) ^ (g << 3);  // r16 % 8 == g
        *reinterpret_cast<float2*>(srow + col) = make_float2(o[i][2 * hr] * w, o[i][2 * hr + 1] * w);
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
    // The scratch lives in the stage's K/V space, which the copy engine (async proxy) rewrites next.
    if constexpr (Cfg::kBulk) fence_proxy_async_shared();
  }

  template <int R>
  __device__ void tile(int stage, int qslot, int count, int rows, bool first, bool last) {
    constexpr int C = 4 / R;
    constexpr int NW = kN / C;
    const int row_base = (warp / C) * 16;
    const int cb = (warp % C) * NW;
    const bool active = row_base < rows;
    unsigned char* kv = s.kv + static_cast<size_t>(stage) * Cfg::kKvStageBytes;
    const uint32_t q_base = smem_addr(s.q + static_cast<size_t>(qslot) * Cfg::kQSlotBytes);
    const uint32_t k_base = smem_addr(kv);
    const uint32_t v_base = k_base + kN * Cfg::kRowElems * 2;
    if (first) {
      reset();
      if (active) load_q_regs(q_base, row_base);
    }
    if (active && cb < count) compute<NW>(q_base, k_base, v_base, row_base, cb, count);
    if (last) {
      if constexpr (R == 4) {
        if (active) epilogue_direct(qslot, row_base, rows);
      } else {
        epilogue_combine<R>(qslot, rows, reinterpret_cast<float*>(kv));
      }
    }
  }

  __device__ void run() {
    int stage = 0;
    uint32_t parity = 0;
    for (;;) {
      mbar_wait(&s.full[stage], parity);
      const int4 meta = s.meta[stage];
      if (meta.x < 0) break;
      const int count = meta.y, rows = meta.z, flags = meta.w;
      const bool first = (flags & TileMetaBits::kFirst) != 0;
      const bool last = (flags & TileMetaBits::kLast) != 0;
      const int groups = (flags >> 4) & 7;
      const int qslot = flags >> 8;
      if (groups == 4) {
        tile<4>(stage, qslot, count, rows, first, last);
      } else if (groups == 2) {
        tile<2>(stage, qslot, count, rows, first, last);
      } else {
        tile<1>(stage, qslot, count, rows, first, last);
      }
      mbar_arrive(&s.empty[stage]);  // every thread, after its last read of the stage
      if (++stage == Cfg::kStages) {
        stage = 0;
        parity ^= 1;
      }
    }
  }
};

template <class T, int D, int V>
__global__ void __launch_bounds__(TreeKernelConfig<D, V>::kThreads, TreeKernelConfig<D, V>::kMinBlocks)
    tree_attention_kernel(const TreeAttnParams p) {
  using Cfg = TreeKernelConfig<D, V>;
  extern __shared__ __align__(128) unsigned char smem[];
  SmemLayout s;
  s.kv = smem;
  s.q = smem + Cfg::kQOff;
  s.row_dst = reinterpret_cast<int*>(smem + Cfg::kRowDstOff);
  s.row_head = reinterpret_cast<int*>(smem + Cfg::kRowHeadOff);
  s.meta = reinterpret_cast<int4*>(smem + Cfg::kMetaOff);
  s.ml = reinterpret_cast<float2*>(smem + Cfg::kMlOff);
  s.full = reinterpret_cast<uint64_t*>(smem + Cfg::kBarOff);
  s.empty = s.full + Cfg::kStages;
  if (threadIdx.x == 0) {
    for (int i = 0; i < Cfg::kStages; ++i) {
      mbar_init(&s.full[i], Cfg::kBulk ? 32 : 64);   // producer lanes: (cp.async +) plain arrival each
      mbar_init(&s.empty[i], Cfg::kConsumerThreads);  // every consumer thread
    }
  }
  __syncthreads();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (warp == 4) {
    Producer<T, D, V> prod(p, s, lane);
    prod.run();
  } else {
    Consumer<T, D, V> cons(p, s, warp, lane);
    cons.run();
  }
}

}  // namespace fasttree::cuda_detail
