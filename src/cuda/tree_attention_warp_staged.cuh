// Staged warp-per-unit tree-attention kernel for short units (CudaTreeAttentionOptions::warp_staged).
//
// Same units and results as warp_unit_kernel (tree_attention_warp.cuh: units [counts->num_units,
// counts->num_all_units), blocks of <= 16 rows, one unit per warp at a time), but the warp streams
// its units through a private kStages-deep shared-memory ring with cp.async instead of loading K/V
// into registers: a *job* is 16 tokens of one unit (K [16][D], V [16][D], plus the unit's Q rows on
// its first job), and while the warp computes job j the copies of jobs j + 1 .. j + kStages - 1 are
// in flight, across unit boundaries. So every warp keeps (kStages - 1) x 16 x D x 4 bytes of K/V in
// flight without holding them in registers (the register kernel had at most one unit's K or V in
// flight per warp, and its record -> K -> V chain per unit).
//
// Per warp and job:   issue job j + kStages - 1 into the slot job j - 1 used,
//                     wait for job j (cp.async.wait_group kStages - 1, __syncwarp)
//                     S = Q K^T (16 x 16, ldmatrix + mma.sync m16n8k16), online softmax (fp32,
//                     log2 domain), O += P V (ldmatrix.trans); on the unit's last job the rows go
//                     to O (+ LSE) or to partial rows (merged by the merge kernel)
//                     __syncwarp.
// Issue side: the unit's record (descriptor, first 32 slot runs, per-row query info) is read from
// global memory with __ldg one unit ahead (prefetched into registers when the previous unit
// starts); token t of a job is found in the lane-distributed window of 32 runs, as in the register
// kernel. Rows beyond the chunk or the block are zero-filled (cp.async src-size 0), so masked
// columns never multiply garbage.
// Shared memory per warp: kStages x (K [16][D] + V [16][D] + Q [16][D], 16-byte chunks XOR-swizzled
// by row % 8, + a 256-byte job header). d = 128, kStages = 2: 24.5 KB per warp.
#pragma once
#include <cuda_runtime.h>

#include "cuda/tree_attention_common.cuh"
#include "cuda/tree_attention_warp.cuh"

namespace fasttree::cuda_detail {

// Ring depth S (jobs per warp: S - 1 in flight while one is computed) is a template parameter
// (2 or 3, chosen at run time); warps per CTA are blockDim.x / 32, each with its own ring.
template <int D, int S>
struct WarpStagedCfg {
  static constexpr int kStages = S;
  static constexpr int kJob = 16;                  // tokens per job
  static constexpr int kTileBytes = kJob * D * 2;  // K, V or Q tile of one job
  // Job header {count, flags, rows, -}, dst[16], head[16]: 144 bytes, padded so stages stay 128-byte aligned.
  static constexpr int kHeaderBytes = 256;
  static constexpr int kStageBytes = 3 * kTileBytes + kHeaderBytes;
  static constexpr int kWarpBytes = kStages * kStageBytes;
  static_assert(kStageBytes % 128 == 0);
};
inline constexpr int kWarpStagedMaxWarps = 4;  // warps per CTA: 1 .. 4

template <class T, int D, int S>
struct WarpStaged {
  using Cfg = WarpStagedCfg<D, S>;
  static constexpr int kKSteps = D / 16;
  static constexpr int kDT = D / 8;
  static constexpr int kCpr = D / 8;       // 16-byte chunks per row
  static constexpr int kRpp = 32 / kCpr;   // rows per warp-wide copy pass: 4 (d 64), 2 (d 128)
  static constexpr int kPasses = 16 / kRpp;

  const TreeAttnParams& p;
  unsigned char* ring;  // this warp's kStages stages
  int lane, end, stride;

  // ---- issue side: the unit being issued -------------------------------------------------------
  int iu;          // unit (>= end: none left)
  int ibase;       // next token to issue
  int kv_begin, kv_end, rows, kvh, seg_end;
  int s0, nwin;    // run window [s0, s0 + nwin), lane-distributed
  int64_t win_slot;
  int win_tb, win_end;
  int64_t q_off;   // lane r (mod 16): element offset of row r's Q (-1: beyond the block)
  int row_dst, row_head;
  // The next unit's record, loaded one unit ahead.
  int4 na, nb, nrun;
  int2 nqi;

  // ---- compute side ----------------------------------------------------------------------------
  float o[kDT][4];
  float m[2], l[2];
  uint32_t qf[kKSteps][4];

  __device__ WarpStaged(const TreeAttnParams& params, unsigned char* warp_ring, int ln, int first_unit, int e, int s)
      : p(params), ring(warp_ring), lane(ln), end(e), stride(s) {
    iu = first_unit;
    if (iu < end) load_record(iu, na, nb, nrun, nqi);
    start_unit();
  }

  __device__ void load_record(int unit, int4& a, int4& b, int4& run, int2& qi) const {
    const BlockRecord* rec = p.records + unit / p.num_kv_heads;
    a = __ldg(reinterpret_cast<const int4*>(&rec->desc));
    b = __ldg(reinterpret_cast<const int4*>(&rec->desc) + 1);
    run = __ldg(reinterpret_cast<const int4*>(&rec->runs[lane]));
    qi = __ldg(reinterpret_cast<const int2*>(&rec->rows[lane & 15]));
  }

  // Unit iu from the prefetched record; prefetches the record of the warp's next unit.
  __device__ void start_unit() {
    if (iu >= end) return;
    const int4 a = na, b = nb, run = nrun;
    const int2 qi = nqi;
    if (iu + stride < end) load_record(iu + stride, na, nb, nrun, nqi);
    kvh = iu % p.num_kv_heads;
    kv_begin = a.z;
    kv_end = a.z + a.w;
    ibase = kv_begin;
    seg_end = a.y;
    s0 = a.x;
    nwin = min(kRecordRuns, seg_end - s0);
    win_slot = 0;
    win_tb = 0x7fffffff;
    win_end = 0x7fffffff;
    if (lane < nwin) {
      win_slot = (static_cast<int64_t>(run.y) << 32) | static_cast<uint32_t>(run.x);
      win_tb = run.z;
      win_end = run.z + run.w;
    }
    const int row0 = b.y;
    rows = b.z;
    const int r = lane & 15;
    row_head = kvh * p.gqa + (row0 + r) % p.gqa;
    row_dst = qi.y;
    q_off = r < rows ? (static_cast<int64_t>(qi.x) * p.num_qo_heads + row_head) * D : -1;
  }

  __device__ unsigned char* stage(int slot) const { return ring + static_cast<size_t>(slot) * Cfg::kStageBytes; }

  // Issues the next job into `slot` (an empty job, count 0, when the warp has no units left) and
  // commits it as one cp.async group.
  __device__ void issue(int slot) {
    unsigned char* st = stage(slot);
    int* hdr = reinterpret_cast<int*>(st + 3 * Cfg::kTileBytes);
    if (iu >= end) {
      if (lane == 0) hdr[0] = 0;
      cp_async_commit();
      return;
    }
    const int count = min(Cfg::kJob, kv_end - ibase);
    const bool first = ibase == kv_begin, last = ibase + Cfg::kJob >= kv_end;
    // Element offset of token ibase + (lane % 16)'s K/V row (-1: beyond the chunk).
    int64_t off = -1;
    {
      const int tok = ibase + (lane & 15);
      const int k = warp_run_search(win_tb, nwin, tok);
      const int64_t sl = shfl_i64(win_slot, k);
      const int tb = __shfl_sync(kFullMask, win_tb, k);
      if ((lane & 15) < count) off = (sl + (tok - tb)) * p.kv_row_stride + static_cast<int64_t>(kvh) * p.kv_head_stride;
    }
    const T* kg = static_cast<const T*>(p.k);
    const T* vg = static_cast<const T*>(p.v);
    const uint32_t kb = smem_addr(st), vb = kb + Cfg::kTileBytes, qb = vb + Cfg::kTileBytes;
    const int sub = lane / kCpr, chunk = lane % kCpr;
#pragma unroll
    for (int ps = 0; ps < kPasses; ++ps) {
      const int row = ps * kRpp + sub;
      const int64_t ro = shfl_i64(off, row);
      const uint32_t so = static_cast<uint32_t>(swz<D>(row, chunk * 8) * 2);
      const bool ok = ro >= 0;
      cp_async_16(kb + so, ok ? kg + ro + chunk * 8 : kg, ok ? 16u : 0u);
      cp_async_16(vb + so, ok ? vg + ro + chunk * 8 : vg, ok ? 16u : 0u);
    }
    if (first) {
      const T* qg = static_cast<const T*>(p.q);
#pragma unroll
      for (int ps = 0; ps < kPasses; ++ps) {
        const int row = ps * kRpp + sub;
        const int64_t qo = shfl_i64(q_off, row);
        const uint32_t so = static_cast<uint32_t>(swz<D>(row, chunk * 8) * 2);
        cp_async_16(qb + so, qo >= 0 ? qg + qo + chunk * 8 : qg, qo >= 0 ? 16u : 0u);
      }
    }
    if (lane == 0) {
      hdr[0] = count;
      hdr[1] = (first ? 1 : 0) | (last ? 2 : 0);
      hdr[2] = rows;
    }
    if (lane < 16) {
      hdr[4 + lane] = row_dst;
      hdr[20 + lane] = row_head;
    }
    cp_async_commit();
    // Advance: the next job of this unit (moving the run window to the run holding its first
    // token: the window starts at the run holding ibase and covers >= 32 tokens, so the next
    // job's first token is inside it), or the warp's next unit.
    ibase += Cfg::kJob;
    if (ibase < kv_end) {
      const int adv = warp_run_search(win_tb, nwin, ibase);
      if (adv > 0) {
        s0 += adv;
        nwin = min(kRecordRuns, seg_end - s0);
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
    } else {
      iu += stride;
      start_unit();
    }
  }

  // Computes the job in `slot`; false when it is the empty job (no more work).
  __device__ bool compute(int slot) {
    const unsigned char* st = stage(slot);
    const int* hdr = reinterpret_cast<const int*>(st + 3 * Cfg::kTileBytes);
    const int count = hdr[0];
    if (count == 0) return false;
    const int flags = hdr[1];
    const bool first = (flags & 1) != 0, last = (flags & 2) != 0;
    const uint32_t kb = smem_addr(st), vb = kb + Cfg::kTileBytes, qb = vb + Cfg::kTileBytes;
    if (first) {
#pragma unroll
      for (int i = 0; i < kDT; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;
      m[0] = m[1] = neg_inf();
      l[0] = l[1] = 0.0f;
#pragma unroll
      for (int kk = 0; kk < kKSteps; ++kk) ldmatrix_x4(qf[kk], qb + swz<D>(lane & 15, kk * 16 + (lane >> 4) * 8) * 2);
    }
    // S = Q K^T: 16 rows x 16 tokens (two n-tiles of 8).
    float sc[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
    {
      const int row = ((lane >> 4) << 3) + (lane & 7);
      const int colb = ((lane >> 3) & 1) << 3;
#pragma unroll
      for (int kk = 0; kk < kKSteps; ++kk) {
        uint32_t bk[4];
        ldmatrix_x4(bk, kb + swz<D>(row, kk * 16 + colb) * 2);
        mma_16816<T>(sc[0], qf[kk], bk[0], bk[1]);
        mma_16816<T>(sc[1], qf[kk], bk[2], bk[3]);
      }
    }
    // Online softmax (log2 domain); columns >= count are masked.
    float mx[2];
    scale_mask_max(sc, count, lane & 3, p.scale_log2, mx);
    float alpha[2];
    softmax_step(sc, mx, m, l, alpha);
    if (!first) rescale_rows(o, alpha);
    // O += P V (one k-step of 16 tokens).
    {
      uint32_t a[4];
      a[0] = pack2<T>(sc[0][0], sc[0][1]);
      a[1] = pack2<T>(sc[0][2], sc[0][3]);
      a[2] = pack2<T>(sc[1][0], sc[1][1]);
      a[3] = pack2<T>(sc[1][2], sc[1][3]);
      const int row = (((lane >> 3) & 1) << 3) + (lane & 7);
#pragma unroll
      for (int dn = 0; dn < D / 16; ++dn) {
        uint32_t bv[4];
        ldmatrix_x4_trans(bv, vb + swz<D>(row, (2 * dn + (lane >> 4)) * 8) * 2);
        mma_16816<T>(o[2 * dn], a, bv[0], bv[1]);
        mma_16816<T>(o[2 * dn + 1], a, bv[2], bv[3]);
      }
    }
    if (last) epilogue(hdr);
    return true;
  }

  // The unit's rows g and g + 8 (normalized) to O (+ LSE) or to partial rows.
  __device__ void epilogue(const int* hdr) const {
    const int g = lane >> 2, tq = lane & 3;
    const int rws = hdr[2];
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      float lt = l[hr];
      lt += __shfl_xor_sync(kFullMask, lt, 1);
      lt += __shfl_xor_sync(kFullMask, lt, 2);
      const int r = g + 8 * hr;
      if (r < rws) {
        const int dst = hdr[4 + r], h = hdr[20 + r];
        float *orow, *lrow;
        row_pointers<D>(p, dst, h, orow, lrow);
        const float inv = lt > 0.0f ? 1.0f / lt : 0.0f;
#pragma unroll
        for (int i = 0; i < kDT; ++i)
          *reinterpret_cast<float2*>(orow + i * 8 + 2 * tq) = make_float2(o[i][2 * hr] * inv, o[i][2 * hr + 1] * inv);
        if (tq == 0 && lrow != nullptr)
          *lrow = lt > 0.0f ? (m[hr] + fast_log2(lt)) * 0.69314718055994531f : neg_inf();
      }
    }
  }
};

template <class T, int D, int S>
__global__ void __launch_bounds__(32 * kWarpStagedMaxWarps) warp_staged_kernel(const TreeAttnParams p) {
  static_assert(D == 64 || D == 128, "staged warp-per-unit path: head_dim 64 or 128");
  using Cfg = WarpStagedCfg<D, S>;
  extern __shared__ __align__(128) unsigned char smem[];
  const int lane = threadIdx.x & 31, w = threadIdx.x / 32, wpb = blockDim.x / 32;
  const int begin = p.counts->num_units, end = p.counts->num_all_units;
  const int nwarps = gridDim.x * wpb;
  WarpStaged<T, D, S> ws(p, smem + static_cast<size_t>(w) * Cfg::kWarpBytes, lane,
                         begin + static_cast<int>(blockIdx.x) * wpb + w, end, nwarps);
#pragma unroll
  for (int s = 0; s < S - 1; ++s) ws.issue(s);
  for (int j = 0;; ++j) {
    // Job j + S - 1 goes into the slot of job j - 1 (every lane finished reading it before the
    // last __syncwarp), before job j is computed: S - 1 jobs stay in flight during the compute.
    ws.issue((j + S - 1) % S);
    cp_async_wait_group<S - 1>();
    __syncwarp();
    if (!ws.compute(j % S)) break;
    __syncwarp();
  }
  cp_async_wait_group<0>();
}

}  // namespace fasttree::cuda_detail
