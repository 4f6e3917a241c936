// Producer warp of the tree-attention kernel (tree_attention_kernel.cuh).
//
// Gathers each unit's 64-token K/V tiles (and, on its first tile, the unit's Q rows; with
// Cfg::kQGlobal only an L2 prefetch of them, the consumers load Q themselves) into the
// kStages-deep shared-memory ring with 16-byte cp.async, 32 lanes x (D / 8) chunks per row.
//
// Unit sequence: the CTA's units seq = 0, 1, ... are blockIdx.x + seq * grid for seq < kLook (and
// always with the static scheduler); later ones come from the atomic counter (offset by
// kLook * grid), each claim issued one unit before its result is needed. Plans of at most
// kLook * grid units never touch the counter (uses_counter).
//
// Per-unit data: a BlockRecord (device_plan.h: descriptor, first 32 slot runs, per-row query
// info) is gathered with cp.async into record slot seq % kRecSlots, kLook = kStages + 1 units
// ahead, right after the first tile of unit seq - kLook is published. So no register ever waits
// on a global load between tiles, and no explicit wait is needed: that record's copies precede
// the producer's arrival on the next tile's full barrier, and the producer reads the record only
// after its empty-barrier wait for that tile or a later one (>= kStages + 1 tiles later), which
// the consumers release only after the full barrier completed. The first kLook records (issued
// before the CTA barrier) are awaited with cp.async.wait_all.
//
// KV slots: among a unit's first kRecordTiles tiles, a full tile inside one run has its first slot
// in the record (BlockRecord::tile_slot, from upload) and goes straight to TMA, and a tile whose
// 8-row units each lie in one run has each unit's first slot there (BlockRecord::tile_box; 16- and
// 8-row TMA boxes, issue_boxes): no run search, the shortest per-tile paths (the producer's time
// is instruction issue and fetch; a searched tile cost 2.3-5.7 kcycles against 0.3 for a table
// tile, PERF_NOTES.md sessions 13-14). Other tiles resolve their slots from the vnode's runs of
// consecutive slots (device_plan.h), held lane-distributed as a window of up to 32 runs:
//   fast path  the tile lies inside one run (the usual case): row r's address is
//              base + r * row_stride, no per-row lookup at all;
//   slow path  the tile crosses runs: each lane resolves rows lane and lane + 32 by a binary search
//              in the window (shuffles), then each copy pass shuffles its row's slot.
// TMA (p.use_tma): a full tile inside one run is 2 x D / 64 tensor copies of 64-slot boxes; other
// tiles copy each 16-row chunk whose rows are all valid and on consecutive slots (one run, or
// runs that continue each other) as 16-slot boxes, the remaining rows by cp.async. Lane 0 raises
// the full barrier's expected bytes before its copies; the tensor maps' 128-byte swizzle is swz64.
// Stage handover: full[s] gets 64 arrivals per tile (each lane once when its cp.asyncs land, once
// after its plain shared stores), empty[s] 128 (every consumer thread).
#pragma once
#include "cuda/tree_attention_common.cuh"

namespace fasttree::cuda_detail {

// Everything the producer knows about one unit. Lane-distributed fields: the run window (run
// s0 + lane) and the query info of rows lane and lane + 32.
struct UnitCtx {
  int unit;  // >= num_units: none
  int kvh;
  BlockDesc d;
  int s0, nwin;  // window = runs [s0, s0 + nwin), nwin <= 32
  int64_t win_slot;
  int win_tb, win_end;
  int q[2], dst[2], pv[2];
  int rows_meta;  // TileMeta's rows field: rows | (row0 % g) << 8 | kv head << 16
};

template <class T, int D, bool kDeep>
struct Producer {
  using Cfg = TreeKernelConfig<D, kDeep>;
  static constexpr int kN = Cfg::kN;
  static constexpr int kCpr = D / 8;         // 16-byte chunks per row: 8, 16, 32
  static constexpr int kRpp = 32 / kCpr;     // rows per warp-wide pass: 4, 2, 1
  static constexpr int kPasses = kN / kRpp;  // passes per 64-row tile
  static constexpr int kPer = 8 / kRpp;      // passes per period of the row % 8 swizzle

  const TreeAttnParams& p;
  const SmemLayout& s;
  int lane;
  int sub, chunk;       // this lane's row within a pass and 16-byte chunk within the row
  int num_units;
  int pending = 0;      // lane 0: result of the claim issued one take() earlier
  // Byte offset in a [kN][D] tile (swz64) of this lane's chunk in pass j < kPer; pass p0 + j
  // (p0 a multiple of kPer) adds (p0 / kPer) x 1 KB (8 rows of a 64-column block). The copy loops
  // run over p0 rolled and over j unrolled: the producer's code is fetched on the critical path of
  // every small plan (PERF_NOTES.md, session 9), fully unrolled pass loops tripled its size.
  uint32_t so[kPer];
#if FT_TRACE
  // clock64 when issue_kv's slot search ended (its split into search and copies); trace builds only,
  // so that the production kernel's code does not change.
  mutable uint64_t tr_search_end = 0;
  mutable int tr_path = 0;  // issue_kv's path: 0 table tile, 1 full one-run past the table, 2 partial one-run, 3 across runs, 4 boxes
  mutable uint64_t tr_q_rows = 0;  // issue_q's row-table part, summed (cycles)
#endif

  __device__ Producer(const TreeAttnParams& params, const SmemLayout& smem, int lane_id)
      : p(params), s(smem), lane(lane_id) {
    sub = lane / kCpr;
    chunk = lane % kCpr;
#pragma unroll
    for (int j = 0; j < kPer; ++j) {
      const int row = j * kRpp + sub;  // < 8
      so[j] = static_cast<uint32_t>(swz64<D>(row, chunk * 8) * 2);  // row < 8
    }
    num_units = p.counts->num_units;
  }

  // Whether any unit comes from the atomic counter (the same answer in every CTA): with at most
  // kLook units per CTA, none is claimed and the counter is never touched, so small plans pay
  // neither the claims nor the done count at the end.
  __device__ bool uses_counter() const {
    return p.work_counter != nullptr && num_units > Cfg::kLook * static_cast<int>(gridDim.x);
  }


  // Unit of sequence index seq (>= num_units: none). Static for seq < kLook or without the atomic
  // counter; otherwise the claim issued by the previous call (so the atomic's latency overlaps a
  // unit), and a new claim is issued. Called with seq = kLook, kLook + 1, ... in order.
  __device__ int take(int seq) {
    if (seq < Cfg::kLook || p.work_counter == nullptr) return static_cast<int>(blockIdx.x) + seq * static_cast<int>(gridDim.x);
    const int u = __shfl_sync(kFullMask, pending, 0);
    if (lane == 0 && u < num_units) pending = claim();
    return u;
  }

  // The first claim (lane 0), after the prologue's records are on their way; without claims,
  // pending = kLook * grid >= num_units ends the unit sequence after the static units.
  __device__ void first_claim() {
    pending = Cfg::kLook * static_cast<int>(gridDim.x);
    if (lane == 0 && uses_counter()) pending = claim();
  }

  __device__ int claim() const { return Cfg::kLook * static_cast<int>(gridDim.x) + atomicAdd(p.work_counter, 1); }

  __device__ uint32_t rec_addr(int seq) const {
    return smem_addr(s.rec + static_cast<size_t>(seq % Cfg::kRecSlots) * Cfg::kRecSlotBytes);
  }

  // Gathers unit `unit`'s block record into record slot seq % kRecSlots (nothing for no unit).
  // blind: skip the unit < num_units check (the prologue: the record array has >= kMaxRecordLook x
  // grid entries), so the copy does not wait for the counts.
  __device__ void issue_record(int seq, int unit, bool blind = false) const {
    if (lane == 0) s.rec_unit[seq % Cfg::kRecSlots] = unit;
    __syncwarp();
    if (!blind && unit >= num_units) return;
    const char* src = reinterpret_cast<const char*>(p.records + unit / p.num_kv_heads);
    const uint32_t dst = rec_addr(seq);
#pragma unroll
    for (int c = lane; c < Cfg::kRecSlotBytes / 16; c += 32) cp_async_16(dst + c * 16, src + c * 16, 16);
  }

  // The current unit's state from its record (slot of seq, landed).
  __device__ void read_record(UnitCtx& c, int seq, int unit) const {
    const unsigned char* rec = s.rec + static_cast<size_t>(seq % Cfg::kRecSlots) * Cfg::kRecSlotBytes;
    c.unit = unit;
    c.kvh = unit % p.num_kv_heads;
    const int4 a = *reinterpret_cast<const int4*>(rec), b = *reinterpret_cast<const int4*>(rec + 16);
    c.d = BlockDesc{a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
    c.rows_meta = c.d.rows | (c.d.row0 % p.gqa) << 8 | c.kvh << 16;
    const BlockRecord* r = reinterpret_cast<const BlockRecord*>(rec);
    c.s0 = c.d.seg_first;
    c.nwin = min(kRecordRuns, c.d.seg_end - c.s0);
    c.win_tb = 0x7fffffff;
    c.win_end = 0x7fffffff;
    c.win_slot = 0;
    if (lane < c.nwin) {
      const int4 run = *reinterpret_cast<const int4*>(&r->runs[lane]);
      c.win_slot = (static_cast<int64_t>(run.y) << 32) | static_cast<uint32_t>(run.x);
      c.win_tb = run.z;
      c.win_end = run.z + run.w;
    }
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int row = lane + 32 * j;
      const int2 qi = row < c.d.rows ? *reinterpret_cast<const int2*>(&r->rows[row]) : make_int2(0, 0);
      c.q[j] = qi.x;
      c.dst[j] = qi.y;
      c.pv[j] = 0;
      if (c.d.shared_len < c.d.kv_len && row < c.d.rows) {  // query qj of the block: [priv_end[qj - 1], priv_end[qj])
        const int qj = (c.d.row0 + row) / p.gqa - c.d.row0 / p.gqa;
        const int lo = qj > 0 ? r->priv_end[qj - 1] : 0;
        c.pv[j] = lo | static_cast<int>(r->priv_end[qj]) << 16;
      }
    }
  }

  __device__ void load_window(UnitCtx& c, int s0) const {
    c.s0 = s0;
    c.nwin = min(32, c.d.seg_end - s0);
    c.win_tb = 0x7fffffff;
    c.win_end = 0x7fffffff;
    c.win_slot = 0;
    if (lane < c.nwin) {
      const int4 run = __ldg(reinterpret_cast<const int4*>(p.runs + s0 + lane));
      c.win_slot = (static_cast<int64_t>(run.y) << 32) | static_cast<uint32_t>(run.x);
      c.win_tb = run.z;
      c.win_end = run.z + run.w;
    }
  }

  // Index in the window of the last run starting at or before tok (tok >= window start).
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
  // only vnodes with more than 32 runs need it.
  __device__ void ensure_window(UnitCtx& c, int first) const {
    while (c.nwin == 32) {
      const int last_end = __shfl_sync(kFullMask, c.win_end, 31);
      if (first + 31 < last_end) break;
      const int k = first >= last_end ? 32 : window_search(c, first);
      if (k == 0) break;  // the window starts at first's run: 32 runs cover 32 tokens
      load_window(c, c.s0 + k);
    }
  }

  // Q rows of unit c into Q slot `qslot`, plus the slot's row tables. The copies complete on
  // stage `stage`'s full barrier (the unit's first tile): cp.async, or for a block of whole
  // consecutive queries (kQRunBit) one TMA box per 64 columns raised on it by lane 0.
  __device__ void issue_q(const UnitCtx& c, int qslot, int stage) const {
    const T* qg = static_cast<const T*>(p.q);
    const uint32_t sq = smem_addr(s.q + static_cast<size_t>(qslot) * Cfg::kQSlotBytes);
    int* tab = s.row_tab + qslot * Cfg::kM;
    constexpr int kTab = Cfg::kStages * Cfg::kM;  // distance between two tables
    int64_t qoff[2];
#if FT_TRACE
    const uint64_t tr_q0 = clock64();
#endif
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int r = lane + 32 * j;
      qoff[j] = -1;
      if (r < c.d.rows) {
        const int h = c.kvh * p.gqa + (c.d.row0 + r) % p.gqa;
        qoff[j] = (static_cast<int64_t>(c.q[j]) * p.num_qo_heads + h) * D;
        tab[kRowDst * kTab + r] = c.dst[j];

        tab[kRowQuery * kTab + r] = c.q[j];
        tab[kRowPriv * kTab + r] = c.pv[j];
        if constexpr (Cfg::kHeadTable) tab[kRowHead * kTab + r] = h;
      }
    }
#if FT_TRACE
    tr_q_rows += clock64() - tr_q0;
#endif
    if constexpr (Cfg::kQGlobal) {
      // The consumers read Q from global memory: pull the rows into L2 now (2 lines of 128 bytes
      // per row at d = 128).
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        if (qoff[j] >= 0) {
#pragma unroll
          for (int b = 0; b < D * 2; b += 128) prefetch_l2(reinterpret_cast<const char*>(qg + qoff[j]) + b);
        }
      }
      return;
    }
    if ((c.d.row_groups & kQRunBit) != 0 && p.use_tma_q != 0) {
      const bool small = c.d.rows <= 16 && (p.use_tma_q & 2) != 0;
      if (small || (p.use_tma_q & 1) != 0) {
        if (lane == 0) {
          const void* map = small ? &p.tma_q16 : &p.tma_q64;
          mbar_expect_tx(&s.full[stage], (small ? 16u : 64u) * D * sizeof(T));
#pragma unroll
          for (int cb = 0; cb < D / 64; ++cb) tma_load_3d(sq + cb * (64 * 64 * 2), map, cb * 64, c.kvh * p.gqa, c.q[0], &s.full[stage]);
        }
        return;
      }
    }
    const int fill = (c.d.rows + 15) & ~15;
#pragma unroll 2
    for (int r0 = 0; r0 < fill; r0 += kRpp) {
      const int row = r0 + sub;
      const int64_t off = shfl_i64(r0 < 32 ? qoff[0] : qoff[1], row & 31);
      const bool valid = off >= 0;
      cp_async_16(sq + swz64<D>(row, chunk * 8) * 2, qg + (valid ? off + chunk * 8 : 0), valid ? 16 : 0);
    }
  }

  // Lane 0: the full tile of kN slots from `slot` (one run) into stage `stage` by TMA: raises the
  // stage's expected bytes, then copies each 64-column block of K and V as one box (the tensor
  // maps' 128-byte swizzle is swz64's).
  __device__ void tma_full_tile(int stage, int slot, int kvh) const {
    const uint32_t sk = smem_addr(s.kv + static_cast<size_t>(stage) * Cfg::kKvStageBytes);
    const uint32_t sv = sk + kN * D * 2;
    mbar_expect_tx(&s.full[stage], 2u * kN * D * sizeof(T));
#pragma unroll
    for (int cb = 0; cb < D / 64; ++cb) {
      tma_load_3d(sk + cb * (64 * 64 * 2), &p.tma_k, cb * 64, slot, kvh, &s.full[stage]);
      tma_load_3d(sv + cb * (64 * 64 * 2), &p.tma_v, cb * 64, slot, kvh, &s.full[stage]);
    }
  }

  // Lane 0: the 16-row chunks i of `mask` (chunk i = tile rows [16 i, 16 i + 16), first slot si)
  // of stage `stage` by TMA, 16-slot boxes per 64-column block of K and V, after raising the full
  // barrier's expected bytes by all of them.
  __device__ void tma_chunks(int mask, int stage, int kvh, int s0, int s1, int s2, int s3) const {
    const uint32_t sk = smem_addr(s.kv + static_cast<size_t>(stage) * Cfg::kKvStageBytes);
    const uint32_t sv = sk + kN * D * 2;
    mbar_expect_tx(&s.full[stage], static_cast<uint32_t>(__popc(mask)) * 2u * 16u * D * sizeof(T));
    const int first[4] = {s0, s1, s2, s3};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      if ((mask >> i) & 1) {
#pragma unroll
        for (int cb = 0; cb < D / 64; ++cb) {
          const uint32_t off = cb * (64 * 64 * 2) + i * 16 * 128;  // 16 rows of 128 bytes into the block
          tma_load_3d(sk + off, &p.tma_k16, cb * 64, first[i], kvh, &s.full[stage]);
          tma_load_3d(sv + off, &p.tma_v16, cb * 64, first[i], kvh, &s.full[stage]);
        }
      }
    }
  }

  // A tile of the record's tile table described by 8-row units (BlockRecord::tile_box row `us`):
  // lane 0 raises the full barrier's expected bytes and loads the full units by TMA, two
  // consecutive units on consecutive slots as one 16-row box; all lanes copy a last unit of fewer
  // than 8 rows by cp.async and zero the V rows [count, fill) (issue_kv's comment).
  __device__ void issue_boxes(int count, int fill, int stage, int kvh, const int* us) const {
    const uint32_t sk = smem_addr(s.kv + static_cast<size_t>(stage) * Cfg::kKvStageBytes);
    const uint32_t sv = sk + kN * D * 2;
    const int full8 = count >> 3;  // full 8-row units
    if (lane == 0 && full8 > 0) {
      mbar_expect_tx(&s.full[stage], static_cast<uint32_t>(full8) * 2u * 8u * D * sizeof(T));
      for (int u = 0; u < full8;) {
        const int slot = us[u];
        const bool pair = u + 1 < full8 && us[u + 1] == slot + 8;
        const void* mk = pair ? &p.tma_k16 : &p.tma_k8;
        const void* mv = pair ? &p.tma_v16 : &p.tma_v8;
#pragma unroll
        for (int cb = 0; cb < D / 64; ++cb) {
          const uint32_t off = cb * (64 * 64 * 2) + u * 8 * 128;  // rows 8 u.. of the 64-column block
          tma_load_3d(sk + off, mk, cb * 64, slot, kvh, &s.full[stage]);
          tma_load_3d(sv + off, mv, cb * 64, slot, kvh, &s.full[stage]);
        }
        u += pair ? 2 : 1;
      }
    }
    if (count == fill) return;  // neither a short last unit nor rows to zero
    const T* kg = static_cast<const T*>(p.k);
    const T* vg = static_cast<const T*>(p.v);
    const int r8 = full8 * 8;  // rows [r8, count) by cp.async from slot us[full8]
    const int64_t tail_off = r8 < count ? static_cast<int64_t>(us[full8]) * p.kv_row_stride +
                                              static_cast<int64_t>(kvh) * p.kv_head_stride + chunk * 8
                                        : 0;
#pragma unroll 1
    for (int p0 = (r8 / kRpp) & ~(kPer - 1); p0 < kPasses; p0 += kPer) {
#pragma unroll
      for (int j = 0; j < kPer; ++j) {
        const int row = (p0 + j) * kRpp + sub;
        const uint32_t so_ps = (p0 / kPer) * 8 * 64 * 2 + so[j];
        if (row >= r8 && row < count) {
          const int64_t o = tail_off + (row - r8) * p.kv_row_stride;
          cp_async_16_full(sk + so_ps, kg + o);
          cp_async_16_full(sv + so_ps, vg + o);
        } else if (row >= count && row < fill) {
          st_shared_zero16(sv + so_ps);
        }
      }
    }
  }

  // K and V rows of tile t (count tokens) of unit c into stage `stage`. V rows in
  // [count, round_up(count, 16)) (all of [count, 64) for wgmma units, whose P V runs every k-step)
  // are zeroed by plain shared stores, since P = 0 there must multiply finite values; K rows there
  // keep whatever the stage held, as their scores are replaced by -inf with a select (a NaN
  // included). Rows beyond are never read. (Zero-filling both by cp.async instead: suite 2.88 vs
  // 2.86, PERF_NOTES session 14.)
  // mark: FT_TRACE builds stamp kTrFirstKvBegin / kTrFirstKvEnd around the copies.
  // tma_slot (BlockRecord::tile_slot[t], p.use_tma; else -1) >= 0: the tile is kN tokens in one run
  // starting at that slot: lane 0 loads it by TMA with no run search; <= -2: its 8-row units are in
  // row -2 - tma_slot of tile_box (issue_boxes).
  __device__ void issue_kv(UnitCtx& c, int t, int count, int stage, int tma_slot, const int* tile_box,
                           bool mark = false) const {
    const T* kg = static_cast<const T*>(p.k);
    const T* vg = static_cast<const T*>(p.v);
    const uint32_t sk = smem_addr(s.kv + static_cast<size_t>(stage) * Cfg::kKvStageBytes);
    const uint32_t sv = sk + kN * D * 2;
    const int rg = c.d.row_groups & 0xff;
    const int fill = Cfg::kWgmma && (rg == 4 || (Cfg::kQGlobal && rg == 2)) ? kN : (count + 15) & ~15;
    if (tma_slot <= -2) {
#if FT_TRACE
      tr_search_end = clock64();
      tr_path = 4;
#endif
      if (mark && lane == 0) trace_mark(p.trace, kTraceTree, kTrFirstKvBegin);
      issue_boxes(count, fill, stage, c.kvh, tile_box + (-2 - tma_slot) * (kN / 8));
      if (mark && lane == 0) trace_mark(p.trace, kTraceTree, kTrFirstKvEnd);
      return;
    }
    if (tma_slot >= 0) {
#if FT_TRACE
      tr_search_end = clock64();
      tr_path = 0;
#endif
      if (lane == 0) {
        if (mark) trace_mark(p.trace, kTraceTree, kTrFirstKvBegin);
        tma_full_tile(stage, tma_slot, c.kvh);
        if (mark) trace_mark(p.trace, kTraceTree, kTrFirstKvEnd);
      }
      return;
    }
    const int64_t row_stride = p.kv_row_stride;  // elements between slots
    const int64_t col_off = static_cast<int64_t>(c.kvh) * p.kv_head_stride + chunk * 8;
    const int base = c.d.kv_begin + t * kN;
    ensure_window(c, base);
    const int k0 = window_search(c, base);  // same for every lane
#if FT_TRACE
    tr_search_end = clock64();
    tr_path = count == kN ? 1 : 2;
#endif
    if (base + count <= __shfl_sync(kFullMask, c.win_end, k0)) {
      // Fast path: one run; row r is slot slot0 + r.
      const int64_t slot0 = shfl_i64(c.win_slot, k0) + (base - __shfl_sync(kFullMask, c.win_tb, k0));
      const int64_t off0 = (slot0 + sub) * row_stride + col_off;
      const T* kp = kg + off0;
      const T* vp = vg + off0;
      if (mark && lane == 0) trace_mark(p.trace, kTraceTree, kTrFirstKvBegin);
      if (count == kN && p.use_tma) {
        // Full tile in one run (past the record's tile table): by TMA, as above.
        if (lane == 0) tma_full_tile(stage, static_cast<int>(slot0), c.kvh);
        if (mark && lane == 0) trace_mark(p.trace, kTraceTree, kTrFirstKvEnd);
        return;
      }
      if (count == kN) {
        // Full tile (the common case of long contexts): no row checks; each address is one
        // 32-bit multiply-add onto the lane's K or V base (the pass's row offset in bytes is
        // < 2^31: kPasses x kRpp rows x row_stride x 2 bytes).
        const char* kb = reinterpret_cast<const char*>(kp);
        const char* vb = reinterpret_cast<const char*>(vp);
        const uint32_t step = static_cast<uint32_t>(kRpp * row_stride * static_cast<int64_t>(sizeof(T)));
#pragma unroll 1
        for (int p0 = 0; p0 < kPasses; p0 += kPer) {
#pragma unroll
          for (int j = 0; j < kPer; ++j) {
            const uint32_t o = (p0 / kPer) * 8 * 64 * 2 + so[j];
            cp_async_16_full(sk + o, kb + (p0 + j) * step);
            cp_async_16_full(sv + o, vb + (p0 + j) * step);
          }
        }
        if (mark && lane == 0) trace_mark(p.trace, kTraceTree, kTrFirstKvEnd);
        return;
      }
      // Partial tile in one run: its full 16-row chunks by TMA, the rest by cp.async.
      const int tmask = p.use_tma ? (1 << (count >> 4)) - 1 : 0;
      if (tmask != 0 && lane == 0) {
        const int slot = static_cast<int>(slot0);
        tma_chunks(tmask, stage, c.kvh, slot, slot + 16, slot + 32, slot + 48);
      }
#pragma unroll 1
      for (int p0 = 0; p0 < kPasses; p0 += kPer) {
#pragma unroll
        for (int j = 0; j < kPer; ++j) {
          const int ps = p0 + j;
          if (ps * kRpp < fill && !((tmask >> ((ps * kRpp) >> 4)) & 1)) {
            const uint32_t so_ps = (p0 / kPer) * 8 * 64 * 2 + so[j];
            if (ps * kRpp + sub < count) {
              const int64_t o = ps * kRpp * row_stride;
              cp_async_16_full(sk + so_ps, kp + o);
              cp_async_16_full(sv + so_ps, vp + o);
            } else {
              st_shared_zero16(sv + so_ps);  // V only (issue_kv comment)
            }
          }
        }
      }
      if (mark && lane == 0) trace_mark(p.trace, kTraceTree, kTrFirstKvEnd);
      return;
    }
    // Slow path: slots of rows lane (slot[0]) and lane + 32 (slot[1]).
#if FT_TRACE
    tr_path = 3;
#endif
    int slot[2] = {0, 0};
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      if (32 * h < count) {
        const int first = base + 32 * h;
        ensure_window(c, first);
        const int tok = first + lane;
        const int k = window_search(c, tok);
        const int64_t sl = shfl_i64(c.win_slot, k) + (tok - __shfl_sync(kFullMask, c.win_tb, k));
        slot[h] = 32 * h + lane < count ? static_cast<int>(sl) : 0;
      }
    }
    // 16-row chunks whose rows are all valid and on consecutive slots: by TMA (the ballot marks
    // rows that continue the previous row's slot; a chunk's first row starts it).
    int tmask = 0;
    int cs[4] = {0, 0, 0, 0};  // slot of each chunk's first row
    if (p.use_tma) {
      unsigned run[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int prev = __shfl_up_sync(kFullMask, slot[h], 1);
        run[h] = __ballot_sync(kFullMask, (lane & 15) == 0 || slot[h] == prev + 1);
      }
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        cs[i] = __shfl_sync(kFullMask, slot[i >> 1], (i & 1) * 16);
        const unsigned half = (run[i >> 1] >> ((i & 1) * 16)) & 0xffffu;
        if (16 * i + 16 <= count && half == 0xffffu) tmask |= 1 << i;
      }
      if (tmask != 0 && lane == 0) tma_chunks(tmask, stage, c.kvh, cs[0], cs[1], cs[2], cs[3]);
    }
#pragma unroll 1
    for (int p0 = 0; p0 < kPasses; p0 += kPer) {
#pragma unroll
      for (int j = 0; j < kPer; ++j) {
        const int ps = p0 + j;
        if (ps * kRpp < fill && !((tmask >> ((ps * kRpp) >> 4)) & 1)) {
          const int row = ps * kRpp + sub;
          const int sl = __shfl_sync(kFullMask, ps * kRpp < 32 ? slot[0] : slot[1], row & 31);
          const uint32_t so_ps = (p0 / kPer) * 8 * 64 * 2 + so[j];
          if (row < count) {
            const int64_t off = static_cast<int64_t>(sl) * row_stride + col_off;
            cp_async_16_full(sk + so_ps, kg + off);
            cp_async_16_full(sv + so_ps, vg + off);
          } else {
            st_shared_zero16(sv + so_ps);  // V only (issue_kv comment)
          }
        }
      }
    }
  }

  // Publishes stage `stage`: meta by lane 0; every lane arrives once for its cp.asyncs (when they
  // land) and once for its plain shared stores (meta, row tables).
  __device__ void publish(int stage, int4 meta) const {
    if (lane == 0) s.meta[stage] = meta;
    mbar_arrive_cp_async(&s.full[stage]);
    mbar_arrive(&s.full[stage]);
  }

  // Before the CTA barrier: the records of units 0 .. kLook - 1 (static ids), all blind (the
  // record array has >= kLook * grid entries), so that no copy waits for the counts: the first
  // tile's loads are one global round trip after the launch, not two. Writes only the record
  // ring (and its unit ids), which nothing else touches before the barrier.
  __device__ void prologue() {
#pragma unroll
    for (int seq = 0; seq < Cfg::kLook; ++seq) issue_record(seq, take(seq), true);
    first_claim();
  }

  __device__ void run() {
    cp_async_wait_all();  // the prologue's records
    __syncwarp();
    if (lane == 0) trace_mark(p.trace, kTraceTree, kTrRecords);
    UnitCtx a;
    int stage = 0;
    uint32_t parity = 1;  // empty barriers: the first round passes at once
    int seq = 0, t = 0, ntiles = 0, rot = 0;
    const int* tile_slots = nullptr;  // the current unit's BlockRecord::tile_slot (its record slot stays until the unit is issued)
    [[maybe_unused]] uint64_t sum_wait = 0, sum_issue = 0;  // FT_TRACE sums
#if FT_TRACE
    uint64_t cy[5] = {0, 0, 0, 0, 0};  // record, Q, search, copies, publish (cycles)
    uint64_t c0 = 0, c1 = 0;
    // The copy step by issue_kv path (tr_path): summed, counted, fastest; table tiles also slowest and first.
    uint64_t path_cy[5] = {0, 0, 0, 0, 0}, path_n[5] = {0, 0, 0, 0, 0};
    uint64_t path_min[5] = {~0ull, ~0ull, ~0ull, ~0ull, ~0ull};
    uint64_t tab_max = 0, tab_first = 0;
#endif
    for (;;) {
      [[maybe_unused]] uint64_t tw = 0;
      if constexpr (FT_TRACE) tw = globaltimer_ns();
      mbar_wait(&s.empty[stage], parity);
      if constexpr (FT_TRACE) {
        const uint64_t now = globaltimer_ns();
        sum_wait += now - tw;
        tw = now;
      }
#if FT_TRACE
      c0 = clock64();
#endif
      if (t == 0) {  // a new unit: its record has landed (see the header comment)
        const int unit = s.rec_unit[seq % Cfg::kRecSlots];
        if (unit >= num_units) break;
        read_record(a, seq, unit);
        tile_slots = reinterpret_cast<const BlockRecord*>(s.rec + static_cast<size_t>(seq % Cfg::kRecSlots) * Cfg::kRecSlotBytes)->tile_slot;
        if (FT_TRACE && seq == 0 && lane == 0) trace_mark(p.trace, kTraceTree, kTrFirstRecord);
        ntiles = (a.d.kv_len + kN - 1) / kN;
        // BlockDesc::row_groups bits 8-15: the unit's first tile. Without the tile table (d = 64)
        // or TMA (descriptors that did not encode at run time) every tile takes the forward-only
        // run search: in order, then.
        rot = Cfg::kRecTiles > 0 && p.use_tma ? (a.d.row_groups >> 8) & 0xff : 0;
      }
#if FT_TRACE
      c1 = clock64();
      cy[0] += c1 - c0;
      c0 = c1;
#endif
      const bool last = t == ntiles - 1;
      // Physical tile of sequence index t: the tiles run from tile rot to the end, then from tile 0
      // (upload() sets rot > 0 only where every tile is in the tile table: no run search).
      const int pt_idx = t + rot < ntiles ? t + rot : t + rot - ntiles;
      const int count = min(kN, a.d.kv_len - pt_idx * kN);
      const int tma_slot = p.use_tma && pt_idx < Cfg::kRecTiles ? tile_slots[pt_idx] : -1;
      const int qslot = seq % Cfg::kStages;
      if (t == 0) issue_q(a, qslot, stage);
      if (FT_TRACE && seq == 0 && t == 0 && lane == 0) trace_mark(p.trace, kTraceTree, kTrFirstQ);
#if FT_TRACE
      c1 = clock64();
      cy[1] += c1 - c0;
      c0 = c1;
#endif
      issue_kv(a, pt_idx, count, stage, tma_slot, tile_slots + kRecordTiles, FT_TRACE && seq == 0 && t == 0);
#if FT_TRACE
      c1 = clock64();
      cy[2] += tr_search_end - c0;
      cy[3] += c1 - tr_search_end;
      {
        const uint64_t d = c1 - tr_search_end;
        if (tr_path == 0 && path_n[0] == 0) tab_first = d;
        if (tr_path == 0) tab_max = max(tab_max, d);
        path_cy[tr_path] += d;
        ++path_n[tr_path];
        path_min[tr_path] = min(path_min[tr_path], d);
      }
      c0 = c1;
#endif
      const int pt = pt_idx * kN - a.d.shared_len;  // tile start in the private region (< 0: shared columns first)
      const int flags = (t == 0 ? TileMetaBits::kFirst : 0) | (last ? TileMetaBits::kLast : 0) |
                        ((a.d.row_groups & 0xff) << 4) | (qslot << 8) |
                        (pt + count > 0 ? TileMetaBits::kPriv | ((pt + 64) << 16) : 0);
      publish(stage, make_int4(a.unit, count, a.rows_meta, flags));
      if (FT_TRACE && seq == 0 && t == 0 && lane == 0) trace_mark(p.trace, kTraceTree, kTrFirstIssue);
      if (t == 0) issue_record(seq + Cfg::kLook, take(seq + Cfg::kLook));  // into unit seq - 1's slot
#if FT_TRACE
      cy[4] += clock64() - c0;
#endif
      if constexpr (FT_TRACE) sum_issue += globaltimer_ns() - tw;
      if (++stage == Cfg::kStages) {
        stage = 0;
        parity ^= 1;
      }
      if (last) {
        ++seq;
        t = 0;
      } else {
        ++t;
      }
    }
    // Here the empty wait of `stage` has passed: publish the end of work on it.
    publish(stage, make_int4(-1, 0, 0, 0));
    cp_async_wait_all();
    // The last CTA to get here resets the work counter for the next launch: every claim of every
    // CTA precedes its own increment of the done count.
    if (uses_counter() && lane == 0) {
      __threadfence();
      if (atomicAdd(p.work_counter + 1, 1) == static_cast<int>(gridDim.x) - 1) {
        __threadfence();
        atomicExch(p.work_counter, 0);
        atomicExch(p.work_counter + 1, 0);
      }
    }
    if (lane == 0) {
      trace_put(p.trace, kTraceTree, kTrProdWaitNs, sum_wait);
      trace_put(p.trace, kTraceTree, kTrProdIssueNs, sum_issue);
#if FT_TRACE
#pragma unroll
      for (int i = 0; i < 5; ++i) trace_put(p.trace, kTraceTree, kTrProdRecordCy + i, cy[i]);
      trace_put(p.trace, kTraceTree, kTrProdQRowsCy, tr_q_rows);
      // (sum, count, min) events of each path; the past-table path has no min event.
      constexpr int kPathEv[5][3] = {{kTrProdTableCy, kTrProdTableTiles, kTrProdTableMinCy},
                                     {kTrProdPastCy, kTrProdPastN, -1},
                                     {kTrProdPartialCy, kTrProdPartialN, kTrProdPartialMinCy},
                                     {kTrProdSlowCy, kTrProdSlowN, kTrProdSlowMinCy},
                                     {kTrProdBoxCy, kTrProdBoxN, kTrProdBoxMinCy}};
#pragma unroll
      for (int i = 0; i < 5; ++i) {
        if (path_n[i] == 0) continue;
        trace_put(p.trace, kTraceTree, kPathEv[i][0], path_cy[i]);
        trace_put(p.trace, kTraceTree, kPathEv[i][1], path_n[i]);
        if (kPathEv[i][2] >= 0) trace_put(p.trace, kTraceTree, kPathEv[i][2], path_min[i]);
      }
      if (path_n[0] > 0) {
        trace_put(p.trace, kTraceTree, kTrProdTableMaxCy, tab_max);
        trace_put(p.trace, kTraceTree, kTrProdTableFirstCy, tab_first);
      }
#endif
      trace_mark(p.trace, kTraceTree, kTrProducerEnd);
    }
  }
};

}  // namespace fasttree::cuda_detail
