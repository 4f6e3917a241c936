#include "cuda/tree_attention.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "core/error.h"
#include "cuda/cuda_check.h"
#include "cuda/device_plan.h"
#include "cuda/kernels.h"
#include "cuda/merge_choice.h"
#include "cuda/rotation_rule.h"
#include "cuda/tile_slots.h"
#include "cuda/tma_desc.h"

namespace fasttree {

using namespace cuda_detail;

namespace {

std::string str(int64_t x) { return std::to_string(x); }
size_t align_up(size_t x, size_t a) { return (x + a - 1) / a * a; }

// Sections of the device plan arena, in arena order.
// Records last: upload() copies the arena up to the records in use, and the kernel may read (and
// discard) records past them, up to kMaxRecordLook x grid, without waiting for the counts.
enum Section { kCounts, kRuns, kMergeQueries, kMergeBegin, kMergeRows, kRecords, kNumSections };
constexpr size_t kSectionAlign = 256;

int kernel_dtype(KvDType t) { return t == KvDType::kF16 ? kDTypeF16 : kDTypeBF16; }

int prepare_kernel(int dtype, int d, TreeKernelInfo& info, bool deep) {
  const bool f16 = dtype == kDTypeF16;
  switch (d) {
    case 64: return f16 ? tree_kernel_prepare<kDTypeF16, 64>(info, deep) : tree_kernel_prepare<kDTypeBF16, 64>(info, deep);
    case 128: return f16 ? tree_kernel_prepare<kDTypeF16, 128>(info, deep) : tree_kernel_prepare<kDTypeBF16, 128>(info, deep);
    case 256: return f16 ? tree_kernel_prepare<kDTypeF16, 256>(info, deep) : tree_kernel_prepare<kDTypeBF16, 256>(info, deep);
    default: return cudaErrorInvalidValue;
  }
}

int launch_kernel(int dtype, int d, const TreeAttnParams& p, int grid, CUstream_st* stream, bool deep) {
  const bool f16 = dtype == kDTypeF16;
  switch (d) {
    case 64: return f16 ? tree_kernel_launch<kDTypeF16, 64>(p, grid, stream, deep) : tree_kernel_launch<kDTypeBF16, 64>(p, grid, stream, deep);
    case 128: return f16 ? tree_kernel_launch<kDTypeF16, 128>(p, grid, stream, deep) : tree_kernel_launch<kDTypeBF16, 128>(p, grid, stream, deep);
    case 256: return f16 ? tree_kernel_launch<kDTypeF16, 256>(p, grid, stream, deep) : tree_kernel_launch<kDTypeBF16, 256>(p, grid, stream, deep);
    default: return cudaErrorInvalidValue;
  }
}

int prepare_warp_kernel(int dtype, int d, int& ctas_per_sm, const WarpKernelShape& staged) {
  const bool f16 = dtype == kDTypeF16;
  switch (d) {
    case 64: return f16 ? warp_kernel_prepare<kDTypeF16, 64>(ctas_per_sm, staged) : warp_kernel_prepare<kDTypeBF16, 64>(ctas_per_sm, staged);
    case 128: return f16 ? warp_kernel_prepare<kDTypeF16, 128>(ctas_per_sm, staged) : warp_kernel_prepare<kDTypeBF16, 128>(ctas_per_sm, staged);
    default: return cudaErrorInvalidValue;
  }
}

int launch_warp_kernel(int dtype, int d, const TreeAttnParams& p, int grid, CUstream_st* stream, const WarpKernelShape& staged) {
  const bool f16 = dtype == kDTypeF16;
  switch (d) {
    case 64: return f16 ? warp_kernel_launch<kDTypeF16, 64>(p, grid, stream, staged) : warp_kernel_launch<kDTypeBF16, 64>(p, grid, stream, staged);
    case 128: return f16 ? warp_kernel_launch<kDTypeF16, 128>(p, grid, stream, staged) : warp_kernel_launch<kDTypeBF16, 128>(p, grid, stream, staged);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace

struct CudaTreeAttention::Impl {
  AttnShape shape;
  KvDType dtype = KvDType::kBF16;
  float scale = 0;
  CudaTreeAttentionOptions options;
  TreeKernelInfo kinfo;
  bool deep_ring = false;  // the 3-stage tree kernel (CudaTreeAttentionOptions::deep_ring)
  // Smallest row-group class of a main-kernel block (A/B knob FT_MIN_ROW_GROUPS, d <= 128): 4 runs
  // every block of <= 32 rows as a 64-row wgmma tile (its missing rows computed and not stored), 2
  // blocks of <= 16 rows as 2 x 2 warps (row_groups_of). 1 (the default) measured best over the
  // suite; per cell each of the three wins somewhere (PERF_NOTES.md, session 18).
  int min_row_groups = 1;
  // Start each unit with private pieces at a different tile (BlockDesc::row_groups bits 8-15), so
  // that the units' cold private tiles (their folded leaves, read from DRAM) do not all fall in the
  // same phase of the launch (FT_ROTATE_TILES; PERF_NOTES.md, session 19).
  // FT_ROTATE_TILES: RotateMode (rotation_rule.h); FT_ROTATE_MAX_MB: its L2 budget for shared chunks.
  int rotate_mode = kRotatePhysical;
  int64_t rotate_budget = int64_t{16} << 20;
  RotateScratch rotate_scratch;  // upload()'s, reused
  int num_sms = 0;
  int grid = 0;         // persistent CTAs (SMs x CTAs per SM): the largest launch
  bool fit_grid = true;  // CudaTreeAttentionOptions::fit_grid, resolved (false when ctas_per_sm is set)
  int launch_grid = 0;   // the uploaded plan's launch: its main units clamped to [num_sms, grid], or grid
  int merge_grid = 0;
  int warp_max_kv = 0;  // resolved warp_unit_max_kv (0: warp-per-unit path off)
  int warp_min_units = 0;
  int warp_grid = 0;
  WarpKernelShape warp_shape;  // warp kernel variant (resolved options; stages 0 = register kernel)
  bool warp_overlap = false;  // warp kernel on side_stream beside the main kernel
  bool merge_pdl = true;      // merge launched as a programmatic dependent of the kernel before it
  int merge_wide_opt = -1;    // resolved merge_wide option (-1: by the plan)
  bool merge_wide = false;    // the uploaded plan merges with merge_kernel_wide
  bool use_tma = true;        // K/V tiles and consecutive-slot 16-row chunks by TMA (resolved FT_TMA; descriptors permitting)
  // TMA descriptors of the last K/V pools run() saw (re-encoded only when a pointer changes).
  mutable const void* tma_k_base = nullptr;
  mutable const void* tma_v_base = nullptr;
  mutable bool tma_ok = false;
  // Q by TMA (blocks of whole consecutive queries, kernels with Q slots; resolved FT_TMA_Q, default
  // on): the maps for the last q / query count run() saw, and which of them encoded (bits as
  // TreeAttnParams::use_tma_q).
  bool use_tma_q = true;
  mutable TmaDesc tma_q64{}, tma_q16{};
  mutable const void* tma_q_base = nullptr;
  mutable int tma_q_queries = -1;
  mutable int tma_q_ok = 0;
  mutable TmaDesc tma_k{}, tma_v{}, tma_k16{}, tma_v16{}, tma_k8{}, tma_v8{};
  cudaStream_t side_stream = nullptr;
  cudaEvent_t fork_event = nullptr, join_event = nullptr;

  // Device arena holding the plan, and its pinned host mirror (same layout).
  void* arena = nullptr;
  void* staging = nullptr;
  size_t arena_bytes = 0;
  size_t plan_bytes_used = 0;  // of the last upload
  std::array<size_t, kNumSections> cap{}, off{}, used{};
  cudaEvent_t upload_done = nullptr;
  bool upload_pending = false;

  // Partial-result workspace [rows, Hq, d] + [rows, Hq] and the work counter [2] (zero between
  // launches).
  float* partial = nullptr;
  float* partial_lse = nullptr;
  int64_t partial_cap_rows = 0;
  int* counter = nullptr;

  // Host scratch of upload(), reused: run length at each tree.slots index, runs per vnode (CSR),
  // partial pieces per query (upload's consistency check).
  std::vector<int32_t> run_len, vnode_run_begin, pieces;

  // Uploaded plan.
  int num_queries = 0;
  int num_units = 0;
  int num_main_units = 0;  // [0, num_main_units) on the main kernel, the rest on the warp kernel
  int num_merge = 0;
  int64_t num_partial_rows = 0;
  bool uploaded = false;
  uint64_t epoch = 1;
  bool last_has_units = false, last_has_merge = false, last_has_warp = false, last_merge_wide = false;
  int last_launch_grid = 0;
  int64_t last_num_queries = -1;

  void free_all() {
    if (upload_pending && upload_done != nullptr) (void)cudaEventSynchronize(upload_done);
    if (arena != nullptr) (void)cudaFree(arena);
    if (staging != nullptr) (void)cudaFreeHost(staging);
    if (partial != nullptr) (void)cudaFree(partial);
    if (partial_lse != nullptr) (void)cudaFree(partial_lse);
    if (counter != nullptr) (void)cudaFree(counter);
    if (upload_done != nullptr) (void)cudaEventDestroy(upload_done);
    if (fork_event != nullptr) (void)cudaEventDestroy(fork_event);
    if (join_event != nullptr) (void)cudaEventDestroy(join_event);
    if (side_stream != nullptr) (void)cudaStreamDestroy(side_stream);
  }

  template <class X>
  X* host_section(Section s) const {
    return reinterpret_cast<X*>(static_cast<char*>(staging) + off[s]);
  }
  template <class X>
  X* device_section(Section s) const {
    return reinterpret_cast<X*>(static_cast<char*>(arena) + off[s]);
  }

  // Grows the arena (and its mirror) when a section does not fit; capacities get 25% headroom.
  void reserve_sections() {
    bool fits = arena != nullptr;
    for (int s = 0; s < kNumSections; ++s) fits = fits && used[s] <= cap[s];
    if (fits) return;
    for (int s = 0; s < kNumSections; ++s)
      cap[s] = std::max(cap[s], align_up(used[s] + used[s] / 4 + 64, kSectionAlign));
    size_t total = 0;
    for (int s = 0; s < kNumSections; ++s) {
      off[s] = total;
      total += cap[s];
    }
    if (arena != nullptr) FT_CUDA_CHECK(cudaFree(arena));
    if (staging != nullptr) FT_CUDA_CHECK(cudaFreeHost(staging));
    arena = nullptr;
    staging = nullptr;
    FT_CUDA_CHECK(cudaMalloc(&arena, total));
    FT_CUDA_CHECK(cudaMallocHost(&staging, total));
    arena_bytes = total;
    ++epoch;
  }

  void reserve_partials(int64_t rows) {
    if (rows <= partial_cap_rows && partial != nullptr) return;
    const int64_t cap_rows = std::max<int64_t>(rows + rows / 4 + 16, partial_cap_rows);
    if (partial != nullptr) FT_CUDA_CHECK(cudaFree(partial));
    if (partial_lse != nullptr) FT_CUDA_CHECK(cudaFree(partial_lse));
    partial = nullptr;
    partial_lse = nullptr;
    const int64_t hq = shape.num_qo_heads;
    FT_CUDA_CHECK(cudaMalloc(&partial, static_cast<size_t>(cap_rows * hq * shape.head_dim) * sizeof(float)));
    FT_CUDA_CHECK(cudaMalloc(&partial_lse, static_cast<size_t>(cap_rows * hq) * sizeof(float)));
    partial_cap_rows = cap_rows;
    ++epoch;
  }
};

CudaTreeAttention::CudaTreeAttention(const AttnShape& shape, KvDType dtype, float sm_scale,
                                     CudaTreeAttentionOptions options)
    : impl_(std::make_unique<Impl>()) {
  shape.validate();
  FT_CHECK(shape.head_dim == 64 || shape.head_dim == 128 || shape.head_dim == 256,
           "CUDA tree attention: head_dim " + str(shape.head_dim) + " has no kernel (64, 128 or 256)");
  FT_CHECK(shape.gqa() <= kMaxBlockRows, "CUDA tree attention: GQA ratio " + str(shape.gqa()) + " above 64");
  Impl& m = *impl_;
  m.shape = shape;
  m.dtype = dtype;
  m.scale = sm_scale > 0 ? sm_scale : shape.default_sm_scale();
  m.options = options;
  int dev = 0;
  FT_CUDA_CHECK(cudaGetDevice(&dev));
  FT_CUDA_CHECK(cudaDeviceGetAttribute(&m.num_sms, cudaDevAttrMultiProcessorCount, dev));
  // An option < 0 takes its environment variable if set (A/B runs), else the default.
  auto env_or = [](int v, const char* name, int dflt) {
    if (v >= 0) return v;
    const char* env = std::getenv(name);
    return env != nullptr ? std::atoi(env) : dflt;
  };
  m.deep_ring = shape.head_dim == 128 &&
                env_or(options.deep_ring, "FT_DEEP_RING", shape.gqa() < kDeepRingMaxGqa ? 1 : 0) != 0;
  FT_CUDA_CHECK(prepare_kernel(kernel_dtype(dtype), shape.head_dim, m.kinfo, m.deep_ring));
  FT_CHECK(m.kinfo.ctas_per_sm >= 1, "CUDA tree attention: the kernel does not fit on an SM (" +
                                         str(m.kinfo.smem_bytes) + " bytes of shared memory)");
  const int want_main = env_or(options.ctas_per_sm > 0 ? options.ctas_per_sm : -1, "FT_MAIN_CTAS", 0);
  const int per_sm = want_main > 0 ? std::min(want_main, m.kinfo.ctas_per_sm) : m.kinfo.ctas_per_sm;
  m.grid = m.num_sms * per_sm;
  m.launch_grid = m.grid;
  m.fit_grid = want_main <= 0 && env_or(options.fit_grid, "FT_FIT_GRID", 1) != 0;
  m.merge_grid = m.num_sms * std::max(1, env_or(-1, "FT_MERGE_CTAS", 8));
  m.warp_max_kv = env_or(options.warp_unit_max_kv, "FT_WARP_UNITS", kDefaultWarpUnitMaxKv);
  if (shape.head_dim > 128) m.warp_max_kv = 0;
  m.warp_overlap = m.warp_max_kv > 0 && env_or(options.warp_overlap, "FT_WARP_OVERLAP", 0) != 0;
  m.merge_pdl = env_or(options.merge_pdl, "FT_MERGE_PDL", 1) != 0;
  m.merge_wide_opt = env_or(options.merge_wide, "FT_MERGE_WIDE", -1);
  m.use_tma = env_or(options.use_tma, "FT_TMA", 1) != 0;
  m.use_tma_q = m.use_tma && env_or(options.use_tma_q, "FT_TMA_Q", 1) != 0;
  m.min_row_groups = shape.head_dim <= 128 ? env_or(-1, "FT_MIN_ROW_GROUPS", 1) : 1;
  m.rotate_mode = env_or(-1, "FT_ROTATE_TILES", kRotatePhysical);
  FT_CHECK(m.rotate_mode >= kRotateOff && m.rotate_mode <= kRotatePhysical,
           "CUDA tree attention: FT_ROTATE_TILES must be 0, 1 or 2, got " + str(m.rotate_mode));
  m.rotate_budget = int64_t{std::max(0, env_or(-1, "FT_ROTATE_MAX_MB", 16))} << 20;
  FT_CHECK(valid_min_row_groups(m.min_row_groups),
           "CUDA tree attention: FT_MIN_ROW_GROUPS must be 1, 2 or 4, got " + str(m.min_row_groups));
  FT_CHECK(options.kv_layout != KvLayout::kHeadMajor || options.kv_slots > 0,
           "CUDA tree attention: the head-major KV layout needs kv_slots > 0, got " + str(options.kv_slots));
  m.warp_min_units = std::max(0, env_or(options.warp_unit_min_units, "FT_WARP_MIN_UNITS", kDefaultWarpUnitMinUnits));
  const int staged = env_or(options.warp_staged, "FT_WARP_STAGED", kDefaultWarpStaged);
  m.warp_shape.stages = staged != 0 ? env_or(options.warp_stages, "FT_WARP_STAGES", kDefaultWarpStages) : 0;
  m.warp_shape.warps = env_or(options.warp_cta_warps, "FT_WARP_CTA_WARPS", kDefaultWarpCtaWarps);
  FT_CHECK(m.warp_shape.stages == 0 || m.warp_shape.stages == 2 || m.warp_shape.stages == 3,
           "CUDA tree attention: warp_stages must be 2 or 3, got " + str(m.warp_shape.stages));
  FT_CHECK(m.warp_shape.warps >= 1 && m.warp_shape.warps <= 4,
           "CUDA tree attention: warp_cta_warps must be in [1, 4], got " + str(m.warp_shape.warps));
  if (m.warp_max_kv > 0) {
    int per = 0;
    FT_CUDA_CHECK(prepare_warp_kernel(kernel_dtype(dtype), shape.head_dim, per, m.warp_shape));
    per = std::max(per, 1);
    int want = options.warp_ctas_per_sm;
    if (want <= 0) {
      const char* env = std::getenv("FT_WARP_CTAS");
      want = env != nullptr ? std::atoi(env) : 0;
    }
    m.warp_grid = m.num_sms * (want > 0 ? std::min(want, per) : per);
  }
  try {
    FT_CUDA_CHECK(cudaEventCreateWithFlags(&m.upload_done, cudaEventDisableTiming));
    if (m.warp_overlap) {
      FT_CUDA_CHECK(cudaStreamCreateWithFlags(&m.side_stream, cudaStreamNonBlocking));
      FT_CUDA_CHECK(cudaEventCreateWithFlags(&m.fork_event, cudaEventDisableTiming));
      FT_CUDA_CHECK(cudaEventCreateWithFlags(&m.join_event, cudaEventDisableTiming));
    }
    FT_CUDA_CHECK(cudaMalloc(&m.counter, 2 * sizeof(int)));
    // Zero once; the kernel leaves it zero after every launch. Synchronized, because run() may use a
    // stream that does not wait for the legacy default stream.
    FT_CUDA_CHECK(cudaMemset(m.counter, 0, 2 * sizeof(int)));
    FT_CUDA_CHECK(cudaDeviceSynchronize());
  } catch (...) {
    m.free_all();
    throw;
  }
}

CudaTreeAttention::~CudaTreeAttention() { impl_->free_all(); }

void CudaTreeAttention::upload(const Plan& plan, const KvTree& tree, CUstream_st* stream, int64_t num_slots) {
  Impl& m = *impl_;
  const AttnShape& sh = m.shape;
  const int g = sh.gqa();
  FT_CHECK(plan.num_qo_heads == sh.num_qo_heads && plan.num_kv_heads == sh.num_kv_heads,
           "CUDA upload: plan built for " + str(plan.num_qo_heads) + "/" + str(plan.num_kv_heads) +
               " qo/kv heads, kernel has " + str(sh.num_qo_heads) + "/" + str(sh.num_kv_heads));
  const int nq = plan.num_queries;
  FT_CHECK(nq == tree.num_queries(), "CUDA upload: plan has " + str(nq) + " queries, tree has " + str(tree.num_queries()));
  const int nv = plan.num_vnodes();
  FT_CHECK(plan.vnode_len.size() == static_cast<size_t>(nv) && plan.vnode_seg_begin.size() == static_cast<size_t>(nv) + 1 &&
               plan.vnode_q_begin.size() == static_cast<size_t>(nv) + 1,
           "CUDA upload: vnode arrays have inconsistent sizes");
  FT_CHECK(plan.query_direct.size() == static_cast<size_t>(nq) && plan.merge_begin.size() == static_cast<size_t>(nq) + 1,
           "CUDA upload: query_direct / merge_begin sizes do not match " + str(nq) + " queries");
  FT_CHECK(plan.vnode_seg_begin[0] == 0 && plan.vnode_seg_begin[nv] == static_cast<int32_t>(plan.segments.size()),
           "CUDA upload: vnode_seg_begin does not span the segments");
  FT_CHECK(plan.vnode_q_begin[0] == 0 && plan.vnode_q_begin[nv] == static_cast<int32_t>(plan.vnode_queries.size()),
           "CUDA upload: vnode_q_begin does not span vnode_queries");
  FT_CHECK(plan.merge_begin[0] == 0 && plan.merge_begin[nq] == static_cast<int32_t>(plan.merge_rows.size()),
           "CUDA upload: merge_begin does not span merge_rows");
  const int64_t rows_cap = plan.num_partial_rows;
  FT_CHECK(rows_cap >= 0, "CUDA upload: negative num_partial_rows");

  // Segments must tile each vnode's context (the kernel's segment search relies on it).
  const int64_t ntok = tree.num_tokens();
  for (int vn = 0; vn < nv; ++vn) {
    FT_CHECK(plan.vnode_seg_begin[vn] <= plan.vnode_seg_begin[vn + 1] && plan.vnode_q_begin[vn] <= plan.vnode_q_begin[vn + 1],
             "CUDA upload: vnode " + str(vn) + ": decreasing CSR offsets");
    int64_t t = 0;
    for (int32_t s = plan.vnode_seg_begin[vn]; s < plan.vnode_seg_begin[vn + 1]; ++s) {
      const PlanSegment& seg = plan.segments[s];
      FT_CHECK(seg.len > 0 && seg.token_begin == t && seg.slot_offset >= 0 && seg.slot_offset + seg.len <= ntok,
               "CUDA upload: vnode " + str(vn) + " segment " + str(s) + " is empty, out of order or outside tree.slots");
      t += seg.len;
    }
    FT_CHECK(t == plan.vnode_len[vn], "CUDA upload: vnode " + str(vn) + " segments cover " + str(t) + " tokens, vnode_len " +
                                          str(plan.vnode_len[vn]));
  }
  // Head-major pools hold kv_slots slots per head: a slot beyond would read another head's rows.
  if (m.options.kv_layout == KvLayout::kHeadMajor) {
    FT_CHECK(num_slots < 0 || num_slots <= m.options.kv_slots,
             "CUDA upload: KV pool of " + str(num_slots) + " slots, but the head-major layout has kv_slots " +
                 str(m.options.kv_slots));
    if (num_slots < 0) num_slots = m.options.kv_slots;
  }
  if (num_slots >= 0) {
    for (int64_t i = 0; i < ntok; ++i)
      FT_CHECK(tree.slots[i] >= 0 && tree.slots[i] < num_slots,
               "CUDA upload: tree slot " + str(tree.slots[i]) + " outside the KV pool [0, " + str(num_slots) + ")");
  }
  for (int32_t q : plan.vnode_queries) FT_CHECK(q >= 0 && q < nq, "CUDA upload: vnode query " + str(q) + " out of range");
  for (int32_t r : plan.merge_rows)
    FT_CHECK(r >= 0 && r < rows_cap, "CUDA upload: merge row " + str(r) + " out of range [0, " + str(rows_cap) + ")");

  // Sizes; pieces[q] = (block) pieces that write partial rows of non-direct query q per kv head.
  m.pieces.assign(static_cast<size_t>(nq), 0);
  int64_t num_blocks = 0, num_qinfo = 0;
  for (size_t i = 0; i < plan.items.size(); ++i) {
    const PlanItem& it = plan.items[i];
    FT_CHECK(it.vnode >= 0 && it.vnode < nv && it.kv_len > 0 && it.kv_begin >= 0 &&
                 static_cast<int64_t>(it.kv_begin) + it.kv_len <= plan.vnode_len[it.vnode] && it.q_count > 0 &&
                 it.q_begin >= plan.vnode_q_begin[it.vnode] && it.q_begin + it.q_count <= plan.vnode_q_begin[it.vnode + 1],
             "CUDA upload: item " + str(static_cast<int64_t>(i)) + " has an out-of-range chunk or query tile");
    FT_CHECK(it.priv_count >= 0 && it.priv_begin >= 0 && static_cast<size_t>(it.priv_begin) + it.priv_count <= plan.privates.size() &&
                 it.priv_len >= 0 && it.priv_len <= kMaxPrivateTokens,
             "CUDA upload: item " + str(static_cast<int64_t>(i)) + " has out-of-range private pieces or more than " +
                 str(kMaxPrivateTokens) + " private tokens");
    int64_t priv_tok = 0;
    for (int32_t k = it.priv_begin; k < it.priv_begin + it.priv_count; ++k) {
      const PlanPrivate& piece = plan.privates[k];
      FT_CHECK(piece.vnode >= 0 && piece.vnode < nv && piece.len == plan.vnode_len[piece.vnode] && piece.q_index >= 0 &&
                   piece.q_index < it.q_count && piece.token_begin == priv_tok &&
                   (k == it.priv_begin || plan.privates[k - 1].q_index < piece.q_index),
               "CUDA upload: item " + str(static_cast<int64_t>(i)) + " private piece " + str(k) +
                   " has a bad vnode, length, offset or query index");
      priv_tok += piece.len;
    }
    FT_CHECK(priv_tok == it.priv_len, "CUDA upload: item " + str(static_cast<int64_t>(i)) + " private pieces hold " +
                                          str(priv_tok) + " tokens, priv_len " + str(it.priv_len));
    const int64_t rows = static_cast<int64_t>(it.q_count) * g;
    num_blocks += (rows + kMaxBlockRows - 1) / kMaxBlockRows;
    num_qinfo += it.q_count;
    for (int64_t row0 = 0; row0 < rows; row0 += kMaxBlockRows) {
      const int64_t last_row = std::min<int64_t>(rows, row0 + kMaxBlockRows) - 1;
      for (int64_t j = row0 / g; j <= last_row / g; ++j) {
        const int32_t q = plan.vnode_queries[it.q_begin + j];
        if (!plan.query_direct[q]) ++m.pieces[q];
      }
    }
  }
  FT_CHECK(num_blocks * sh.num_kv_heads < (int64_t{1} << 31) && num_qinfo < (int64_t{1} << 31),
           "CUDA upload: the plan has more than 2^31 units");
  int64_t num_merge = 0;
  for (int q = 0; q < nq; ++q) {
    if (plan.query_direct[q]) continue;
    ++num_merge;
    const int32_t n = plan.merge_begin[q + 1] - plan.merge_begin[q];
    FT_CHECK((n == 0) == (m.pieces[q] == 0),
             "CUDA upload: query " + str(q) + " has " + str(n) + " merge rows but " + str(m.pieces[q]) +
                 " partial pieces (both must be zero or both positive)");
  }

  // Runs of consecutive slots: run_len[i] = length of the consecutive run of tree.slots from i;
  // vnode_runs(vn, emit) emits the maximal runs of vnode vn's context (across segment boundaries
  // too) as emit(first slot, first context token, length).
  m.run_len.resize(static_cast<size_t>(ntok));
  for (int64_t i = ntok - 1; i >= 0; --i) {
    const bool next = i + 1 < ntok && tree.slots[i + 1] == static_cast<int64_t>(tree.slots[i]) + 1;
    m.run_len[i] = next && m.run_len[i + 1] < (1 << 30) ? m.run_len[i + 1] + 1 : 1;
  }
  auto vnode_runs = [&](int vn, auto&& emit) {
    int64_t slot = 0, tb = 0, len = 0;  // the run being extended
    for (int32_t si = plan.vnode_seg_begin[vn]; si < plan.vnode_seg_begin[vn + 1]; ++si) {
      const PlanSegment& seg = plan.segments[si];
      for (int64_t j = 0; j < seg.len;) {
        const int64_t n = std::min<int64_t>(m.run_len[seg.slot_offset + j], seg.len - j);
        const int64_t first = tree.slots[seg.slot_offset + j];
        if (len > 0 && first == slot + len && len + n < (int64_t{1} << 30)) {
          len += n;
        } else {
          if (len > 0) emit(slot, tb, len);
          slot = first;
          tb = seg.token_begin + j;
          len = n;
        }
        j += n;
      }
    }
    if (len > 0) emit(slot, tb, len);
  };
  m.vnode_run_begin.assign(static_cast<size_t>(nv) + 1, 0);
  for (int vn = 0; vn < nv; ++vn) {
    int64_t runs = 0;
    vnode_runs(vn, [&](int64_t, int64_t, int64_t) { ++runs; });
    FT_CHECK(m.vnode_run_begin[vn] + runs < (int64_t{1} << 31), "CUDA upload: more than 2^31 slot runs");
    m.vnode_run_begin[vn + 1] = static_cast<int32_t>(m.vnode_run_begin[vn] + runs);
  }
  // Blocks with private pieces get their own run list after the vnodes' runs (device_plan.h):
  // block_runs(it, row0, nr, emit) emits it, merging runs that continue each other.
  auto block_runs = [&](const PlanItem& it, int32_t row0, int32_t nr, auto&& emit) {
    int64_t slot = 0, tb = 0, len = 0;
    auto add = [&](int64_t s_, int64_t t_, int64_t n_) {
      if (len > 0 && s_ == slot + len && t_ == tb + len && len + n_ < (int64_t{1} << 30)) {
        len += n_;
        return;
      }
      if (len > 0) emit(slot, tb, len);
      slot = s_, tb = t_, len = n_;
    };
    const int64_t kv_end = int64_t{it.kv_begin} + it.kv_len;
    vnode_runs(it.vnode, [&](int64_t s_, int64_t t_, int64_t n_) {
      const int64_t a = std::max<int64_t>(t_, it.kv_begin), e = std::min<int64_t>(t_ + n_, kv_end);
      if (a < e) add(s_ + (a - t_), a, e - a);
    });
    int64_t off = kv_end;
    for (int32_t k = it.priv_begin; k < it.priv_begin + it.priv_count; ++k) {
      const PlanPrivate& piece = plan.privates[k];
      if (piece.q_index < row0 / g || piece.q_index > (row0 + nr - 1) / g) continue;  // another block's query
      vnode_runs(piece.vnode, [&](int64_t s_, int64_t t_, int64_t n_) { add(s_, off + t_, n_); });
      off += piece.len;
    }
    if (len > 0) emit(slot, tb, len);
  };
  int64_t num_runs = m.vnode_run_begin[nv];
  for (const PlanItem& it : plan.items) {
    if (it.priv_count == 0) continue;
    for (int32_t row0 = 0; row0 < it.q_count * g; row0 += kMaxBlockRows)
      block_runs(it, row0, std::min(kMaxBlockRows, it.q_count * g - row0), [&](int64_t, int64_t, int64_t) { ++num_runs; });
  }
  FT_CHECK(num_runs < (int64_t{1} << 31), "CUDA upload: more than 2^31 slot runs");

  // Wait for the previous upload's copy before touching the pinned mirror.
  if (m.upload_pending) {
    FT_CUDA_CHECK(cudaEventSynchronize(m.upload_done));
    m.upload_pending = false;
  }
  m.used[kCounts] = sizeof(DeviceCounts);
  // Capacity >= kMaxRecordLook x grid records: each CTA gathers its first units' records before it
  // knows num_units (only the num_blocks in use are copied; the rest is read and discarded).
  const int64_t num_records = std::max<int64_t>(num_blocks, int64_t{kMaxRecordLook} * m.grid);
  m.used[kRecords] = static_cast<size_t>(num_records) * sizeof(BlockRecord);
  m.used[kRuns] = static_cast<size_t>(num_runs) * sizeof(DeviceRun);
  m.used[kMergeQueries] = static_cast<size_t>(num_merge) * sizeof(int32_t);
  m.used[kMergeBegin] = plan.merge_begin.size() * sizeof(int32_t);
  m.used[kMergeRows] = plan.merge_rows.size() * sizeof(int32_t);
  m.reserve_sections();
  m.reserve_partials(rows_cap);

  // Pack.
  DeviceRun* runs = m.host_section<DeviceRun>(kRuns);
  int64_t run_fill = 0;
  auto put_run = [&](int64_t slot, int64_t tb, int64_t len) {
    runs[run_fill++] = DeviceRun{slot, static_cast<int32_t>(tb), static_cast<int32_t>(len)};
  };
  for (int vn = 0; vn < nv; ++vn) vnode_runs(vn, put_run);
  // Records: the kernel reads a record's runs below min(32, seg_end - seg_first) and rows below
  // desc.rows only; the padding records (first units of idle CTAs) are never read.
  // Items whose single block has <= 16 rows and whose chunk has <= warp_max_kv tokens go last (the
  // warp-per-unit kernel's units), the others keep the plan's order.
  BlockRecord* records = m.host_section<BlockRecord>(kRecords);
  auto short_item = [&](const PlanItem& it) {  // items with private pieces run on the main kernel only
    return m.warp_max_kv > 0 && static_cast<int64_t>(it.q_count) * g <= 16 && it.kv_len <= m.warp_max_kv && it.priv_count == 0;
  };
  int64_t num_short_units = 0;
  for (const PlanItem& it : plan.items) num_short_units += short_item(it) ? sh.num_kv_heads : 0;
  const bool use_warp = num_short_units > 0 && num_short_units >= m.warp_min_units;
  auto warp_item = [&](const PlanItem& it) { return use_warp && short_item(it); };
  // Whether the items with private pieces rotate their tiles (rotation_rule.h; measured: `1 1024`
  // 32/8, 8 MB of shared K/V, 4 % faster; 32/32, 34 MB, 24 % slower).
  const bool rotate = choose_rotation(
      plan, m.rotate_mode, int64_t{4} * sh.num_kv_heads * sh.head_dim, m.rotate_budget, m.rotate_scratch,
      [&](int vn, int64_t begin, int64_t len, auto&& emit) {
        const DeviceRun* r_first = runs + m.vnode_run_begin[vn];
        const DeviceRun* r_end = runs + m.vnode_run_begin[vn + 1];
        const DeviceRun* r = std::upper_bound(r_first, r_end, begin, [](int64_t t, const DeviceRun& x) { return t < x.token_begin; });
        if (r != r_first) --r;
        for (; r < r_end && r->token_begin < begin + len; ++r) {
          const int64_t lo = std::max<int64_t>(begin, r->token_begin);
          const int64_t hi = std::min<int64_t>(begin + len, int64_t{r->token_begin} + r->len);
          emit(r->slot + (lo - r->token_begin), hi - lo);
        }
      });
  int64_t b = 0, num_main_blocks = 0;
  for (int pass = 0; pass < 2; ++pass)
  for (size_t i = 0; i < plan.items.size(); ++i) {
    const PlanItem& it = plan.items[i];
    if (warp_item(it) != (pass == 1)) continue;
    const DeviceRun* r_first = runs + m.vnode_run_begin[it.vnode];
    const DeviceRun* r_last = runs + m.vnode_run_begin[it.vnode + 1];
    const DeviceRun* run = std::upper_bound(r_first, r_last, it.kv_begin,
                                            [](int32_t t, const DeviceRun& x) { return t < x.token_begin; }) - 1;
    const int32_t rows = it.q_count * g;
    for (int32_t row0 = 0; row0 < rows; row0 += kMaxBlockRows) {
      const int32_t nr = std::min(kMaxBlockRows, rows - row0);
      BlockRecord& rec = records[b++];
      rec.desc = BlockDesc{static_cast<int32_t>(run - runs), m.vnode_run_begin[it.vnode + 1], it.kv_begin, it.kv_len,
                           it.kv_len, row0, nr, row_groups_of(nr, m.deep_ring, m.min_row_groups)};
      std::fill(rec.priv_end, rec.priv_end + kMaxBlockRows, uint16_t{0});
      const DeviceRun* rb = run;
      if (it.priv_count > 0) {  // own run list; the private region holds this block's queries' pieces
        rec.desc.seg_first = static_cast<int32_t>(run_fill);
        block_runs(it, row0, nr, put_run);
        rec.desc.seg_end = static_cast<int32_t>(run_fill);
        rb = runs + rec.desc.seg_first;
        const int32_t j0 = row0 / g, j1 = (row0 + nr - 1) / g;  // the block's queries of the tile
        int32_t off = 0;
        int32_t k = it.priv_begin;
        for (int32_t j = j0; j <= j1; ++j) {
          for (; k < it.priv_begin + it.priv_count && plan.privates[k].q_index <= j; ++k)
            if (plan.privates[k].q_index == j) off += plan.privates[k].len;
          rec.priv_end[j - j0] = static_cast<uint16_t>(off);
        }
        rec.desc.kv_len = it.kv_len + off;
      }
      const int64_t nruns = std::min<int64_t>(kRecordRuns, runs + rec.desc.seg_end - rb);
      std::copy(rb, rb + nruns, rec.runs);
      fill_tile_slots(rec, rb, runs + rec.desc.seg_end);
      if (it.priv_count > 0 && rotate)  // the producer ignores it without the tile table or TMA
        rec.desc.row_groups |= tile_rotation(rec, b - 1) << 8;
      if (64 % g == 0 && row0 % g == 0) {  // whole consecutive queries: Q by TMA where the kernel can
        const int32_t j0 = row0 / g, j1 = (row0 + nr - 1) / g, q0 = plan.vnode_queries[it.q_begin + j0];
        bool consecutive = true;
        for (int32_t j = j0 + 1; j <= j1 && consecutive; ++j) consecutive = plan.vnode_queries[it.q_begin + j] == q0 + (j - j0);
        if (consecutive) rec.desc.row_groups |= kQRunBit;
      }
      for (int32_t r = 0; r < nr; ++r) {
        const int32_t j = (row0 + r) / g;  // query of the item's tile
        const int32_t q = plan.vnode_queries[it.q_begin + j];
        QueryInfo info{q, q};
        if (!plan.query_direct[q]) {
          const int64_t row = static_cast<int64_t>(it.out_row) + j;
          FT_CHECK(it.out_row >= 0 && row < rows_cap, "CUDA upload: item " + str(static_cast<int64_t>(i)) +
                                                          " writes partial row " + str(row) + " out of range");
          info.dst = ~static_cast<int32_t>(row);
        }
        rec.rows[r] = info;
      }
    }
    if (pass == 0) num_main_blocks = b;
  }
  DeviceCounts* counts = m.host_section<DeviceCounts>(kCounts);
  *counts = DeviceCounts{static_cast<int32_t>(num_main_blocks * sh.num_kv_heads), static_cast<int32_t>(num_merge),
                         static_cast<int32_t>(num_blocks * sh.num_kv_heads)};
  int32_t* mq = m.host_section<int32_t>(kMergeQueries);
  for (int q = 0, k = 0; q < nq; ++q)
    if (!plan.query_direct[q]) mq[k++] = q;
  std::memcpy(m.host_section<void>(kMergeBegin), plan.merge_begin.data(), m.used[kMergeBegin]);
  if (!plan.merge_rows.empty()) std::memcpy(m.host_section<void>(kMergeRows), plan.merge_rows.data(), m.used[kMergeRows]);

  const size_t bytes = m.off[kRecords] + static_cast<size_t>(num_blocks) * sizeof(BlockRecord);
  FT_CUDA_CHECK(cudaMemcpyAsync(m.arena, m.staging, bytes, cudaMemcpyHostToDevice, stream));
  m.plan_bytes_used = bytes;
  FT_CUDA_CHECK(cudaEventRecord(m.upload_done, stream));
  m.upload_pending = true;

  m.num_queries = nq;
  m.num_units = static_cast<int>(num_blocks * sh.num_kv_heads);
  m.num_main_units = static_cast<int>(num_main_blocks * sh.num_kv_heads);
  m.num_merge = static_cast<int>(num_merge);
  m.merge_wide = m.merge_wide_opt >= 0 ? m.merge_wide_opt != 0
                                       : prefer_wide_merge(num_merge * sh.num_qo_heads, static_cast<int64_t>(plan.merge_rows.size()),
                                                           num_merge, m.merge_grid, sh.head_dim);
  m.num_partial_rows = rows_cap;
  m.launch_grid = m.fit_grid ? std::min(m.grid, std::max(m.num_sms, m.num_main_units)) : m.grid;
  m.uploaded = true;
  const bool has_units = m.num_main_units > 0, has_merge = m.num_merge > 0,
             has_warp = m.num_units > m.num_main_units;
  if (has_units != m.last_has_units || has_merge != m.last_has_merge || has_warp != m.last_has_warp ||
      m.merge_wide != m.last_merge_wide || m.launch_grid != m.last_launch_grid ||
      (m.use_tma_q && !m.deep_ring && nq != m.last_num_queries))  // the Q maps span the queries
    ++m.epoch;
  m.last_num_queries = nq;
  m.last_launch_grid = m.launch_grid;
  m.last_merge_wide = m.merge_wide;
  m.last_has_units = has_units;
  m.last_has_merge = has_merge;
  m.last_has_warp = has_warp;
}

void CudaTreeAttention::run(const void* q, const void* k, const void* v, float* out, float* lse,
                            CUstream_st* stream) const {
  const Impl& m = *impl_;
  FT_CHECK(m.uploaded, "CudaTreeAttention::run before upload");
  bool merge_follows_kernel = false;  // the merge is enqueued right after a kernel on `stream`
  if (m.num_units > 0) {
    TreeAttnParams p{};
    p.q = q;
    p.k = k;
    p.v = v;
    p.out = out;
    p.lse = lse;
    p.partial = m.partial;
    p.partial_lse = m.partial_lse;
    p.counts = m.device_section<DeviceCounts>(kCounts);
    p.records = m.device_section<BlockRecord>(kRecords);
    p.runs = m.device_section<DeviceRun>(kRuns);
    p.work_counter = m.options.atomic_scheduler ? m.counter : nullptr;
    p.trace = m.options.trace;
    p.num_qo_heads = m.shape.num_qo_heads;
    p.num_kv_heads = m.shape.num_kv_heads;
    p.gqa = m.shape.gqa();
    p.scale_log2 = m.scale * 1.4426950408889634f;
    const int64_t d = m.shape.head_dim;
    if (m.options.kv_layout == KvLayout::kHeadMajor) {
      p.kv_row_stride = d;
      p.kv_head_stride = m.options.kv_slots * d;
    } else {
      p.kv_row_stride = m.shape.num_kv_heads * d;
      p.kv_head_stride = d;
    }
    if (m.use_tma) {
      if (k != m.tma_k_base || v != m.tma_v_base) {
        const bool bf16 = m.dtype == KvDType::kBF16;
        const int64_t slots = m.options.kv_slots;
        const int64_t hkv = m.shape.num_kv_heads, rs = p.kv_row_stride, hs = p.kv_head_stride;
        m.tma_ok = encode_kv_tma(m.tma_k, k, bf16, d, hkv, slots, rs, hs, 64) &&
                   encode_kv_tma(m.tma_v, v, bf16, d, hkv, slots, rs, hs, 64) &&
                   encode_kv_tma(m.tma_k16, k, bf16, d, hkv, slots, rs, hs, 16) &&
                   encode_kv_tma(m.tma_v16, v, bf16, d, hkv, slots, rs, hs, 16) &&
                   encode_kv_tma(m.tma_k8, k, bf16, d, hkv, slots, rs, hs, 8) &&
                   encode_kv_tma(m.tma_v8, v, bf16, d, hkv, slots, rs, hs, 8);
        m.tma_k_base = k;
        m.tma_v_base = v;
      }
      if (m.tma_ok) {
        p.tma_k = m.tma_k;
        p.tma_v = m.tma_v;
        p.tma_k16 = m.tma_k16;
        p.tma_v16 = m.tma_v16;
        p.tma_k8 = m.tma_k8;
        p.tma_v8 = m.tma_v8;
        p.use_tma = 1;
      }
      if (m.use_tma_q && !m.deep_ring) {
        if (q != m.tma_q_base || m.num_queries != m.tma_q_queries) {
          const bool bf16 = m.dtype == KvDType::kBF16;
          const int g = m.shape.gqa();
          m.tma_q_ok = 0;
          if (64 % g == 0 && encode_q_tma(m.tma_q64, q, bf16, d, m.shape.num_qo_heads, m.num_queries, g, 64 / g))
            m.tma_q_ok |= 1;
          if (16 % g == 0 && encode_q_tma(m.tma_q16, q, bf16, d, m.shape.num_qo_heads, m.num_queries, g, 16 / g))
            m.tma_q_ok |= 2;
          m.tma_q_base = q;
          m.tma_q_queries = m.num_queries;
        }
        p.tma_q64 = m.tma_q64;
        p.tma_q16 = m.tma_q16;
        p.use_tma_q = m.tma_q_ok;
      }
    }
    const bool has_warp = m.num_units > m.num_main_units, has_main = m.num_main_units > 0;
    if (has_warp && has_main && m.warp_overlap) {
      // Fork: the side stream waits for everything enqueued on `stream` so far (uploads, poison),
      // runs the warp kernel beside the main kernel, and `stream` waits for it before the merge.
      // The main kernel is enqueued first so that its (large) CTAs are placed first.
      FT_CUDA_CHECK(cudaEventRecord(m.fork_event, stream));
      FT_CUDA_CHECK(cudaStreamWaitEvent(m.side_stream, m.fork_event, 0));
      FT_CUDA_CHECK(launch_kernel(kernel_dtype(m.dtype), m.shape.head_dim, p, m.launch_grid, stream, m.deep_ring));
      FT_CUDA_CHECK(launch_warp_kernel(kernel_dtype(m.dtype), m.shape.head_dim, p, m.warp_grid, m.side_stream, m.warp_shape));
      FT_CUDA_CHECK(cudaEventRecord(m.join_event, m.side_stream));
      FT_CUDA_CHECK(cudaStreamWaitEvent(stream, m.join_event, 0));
    } else {
      if (has_warp) FT_CUDA_CHECK(launch_warp_kernel(kernel_dtype(m.dtype), m.shape.head_dim, p, m.warp_grid, stream, m.warp_shape));
      if (has_main) FT_CUDA_CHECK(launch_kernel(kernel_dtype(m.dtype), m.shape.head_dim, p, m.launch_grid, stream, m.deep_ring));
      merge_follows_kernel = true;
    }
  }
  if (m.num_merge > 0 && m.options.run_merge) {
    MergeParams mp{};
    mp.counts = m.device_section<DeviceCounts>(kCounts);
    mp.merge_queries = m.device_section<int32_t>(kMergeQueries);
    mp.merge_begin = m.device_section<int32_t>(kMergeBegin);
    mp.merge_rows = m.device_section<int32_t>(kMergeRows);
    mp.partial = m.partial;
    mp.partial_lse = m.partial_lse;
    mp.out = out;
    mp.lse = lse;
    mp.num_qo_heads = m.shape.num_qo_heads;
    mp.trace = m.options.trace;
    // Both kernels grid-stride over their jobs (merge_grid: 8 CTAs per SM by default).
    FT_CUDA_CHECK(merge_kernel_launch(m.shape.head_dim, mp, m.merge_grid, stream,
                                      m.merge_pdl && merge_follows_kernel, m.merge_wide));
  }
}

void CudaTreeAttention::poison_workspace(CUstream_st* stream) const {
  const Impl& m = *impl_;
  if (m.partial == nullptr) return;
  const int64_t hq = m.shape.num_qo_heads;
  FT_CUDA_CHECK(cudaMemsetAsync(m.partial, 0xff, static_cast<size_t>(m.partial_cap_rows * hq * m.shape.head_dim) * sizeof(float), stream));
  FT_CUDA_CHECK(cudaMemsetAsync(m.partial_lse, 0xff, static_cast<size_t>(m.partial_cap_rows * hq) * sizeof(float), stream));
}

uint64_t CudaTreeAttention::graph_epoch() const { return impl_->epoch; }
const AttnShape& CudaTreeAttention::shape() const { return impl_->shape; }
KvDType CudaTreeAttention::dtype() const { return impl_->dtype; }
float CudaTreeAttention::sm_scale() const { return impl_->scale; }
int CudaTreeAttention::num_queries() const { return impl_->num_queries; }
int CudaTreeAttention::num_units() const { return impl_->num_units; }
int CudaTreeAttention::grid_size() const { return impl_->launch_grid; }
std::pair<const void*, size_t> CudaTreeAttention::plan_bytes() const {
  return {impl_->arena, impl_->uploaded ? impl_->plan_bytes_used : 0};
}
bool CudaTreeAttention::warp_overlap() const { return impl_->warp_overlap; }
bool CudaTreeAttention::tma_active() const { return impl_->use_tma && impl_->tma_ok; }
bool CudaTreeAttention::tma_q_active() const {
  return impl_->use_tma_q && !impl_->deep_ring && impl_->tma_q_ok != 0;
}

}  // namespace fasttree
