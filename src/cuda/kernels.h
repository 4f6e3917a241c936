// Host-side declarations of the kernel launchers (defined in the .cu files). No CUDA header: error
// codes are cudaError_t values returned as int (0 = success), streams are CUstream_st*
// (= cudaStream_t).
#pragma once
#include "cuda/device_plan.h"

struct CUstream_st;

namespace fasttree::cuda_detail {

inline constexpr int kDTypeF16 = 0;
inline constexpr int kDTypeBF16 = 1;

struct TreeKernelInfo {
  int smem_bytes = 0;   // dynamic shared memory per CTA
  int threads = 0;      // threads per CTA
  int ctas_per_sm = 0;  // resident CTAs per SM (occupancy)
};

// Raises the kernel's dynamic shared-memory limit and reports its occupancy. Call once per process
// and kernel before launching it (not during stream capture).
// deep (head_dim 128 only, ignored otherwise): the variant with a 3-stage K/V ring whose consumers
// read Q from global memory instead of a shared-memory Q slot (TreeKernelConfig::kQGlobal).
template <int DType, int D>
int tree_kernel_prepare(TreeKernelInfo& info, bool deep);

// Launches the tree-attention kernel (the variant `deep` selects) on `grid` persistent CTAs.
template <int DType, int D>
int tree_kernel_launch(const TreeAttnParams& params, int grid, CUstream_st* stream, bool deep);

// Warp-per-unit kernel for short units (head_dim 64 and 128 only, else cudaErrorInvalidValue):
// stages 2 or 3 = the cp.async-staged kernel (tree_attention_warp_staged.cuh) with that ring depth
// and `warps` warps (1 .. 4) per CTA; stages 0 = the register kernel (tree_attention_warp.cuh,
// kWarpUnitThreads threads). prepare sets the kernel's attributes and reports its resident CTAs per
// SM; launch runs `grid` persistent CTAs over units [counts->num_units, counts->num_all_units).
struct WarpKernelShape {
  int stages = 2;
  int warps = 2;
};
template <int DType, int D>
int warp_kernel_prepare(int& ctas_per_sm, const WarpKernelShape& shape);
template <int DType, int D>
int warp_kernel_launch(const TreeAttnParams& params, int grid, CUstream_st* stream, const WarpKernelShape& shape);

// Both separate merge kernels (merge_kernel.cuh) run CTAs of kMergeThreads threads and at most 64
// registers (kMergeBlocksPerSm fit on an SM; one fits beside the tree kernel's two CTAs, so a
// programmatic dependent is placed and runs its prologue while the tree kernel still runs), each
// lane group keeping kMergeStep partial rows in flight. The 256-thread, 8-row versions took 110
// registers: 2 CTAs per SM, DRAM at 49 % on a merge of 4 rows per job (PERF_NOTES.md).
inline constexpr int kMergeThreads = 128;
inline constexpr int kMergeBlocksPerSm = 8;
inline constexpr int kMergeStep = 4;

// Launches the merge kernel (grid-stride over non-direct queries x heads). pdl: as a programmatic
// dependent of the kernel enqueued just before it on `stream` (that kernel must be the one writing
// the partials, and nothing else may come between them).
// wide: merge_kernel_wide (one CTA per job, its rows split over the CTA's lane groups).
int merge_kernel_launch(int head_dim, const MergeParams& params, int grid, CUstream_st* stream, bool pdl, bool wide);

// An empty kernel of `grid` CTAs x 32 threads (benchmarks: the cost of one launch in the timing
// harness itself).
int empty_kernel_launch(int grid, CUstream_st* stream);

// One thread that sleeps for `ns` nanoseconds (0 .. 10 s) of the GPU's global timer: keeps the
// stream busy while the host enqueues the timed runs behind it.
int delay_kernel_launch(int64_t ns, CUstream_st* stream);

// Reads `bytes` (a positive multiple of 16) of `data` once with `grid` CTAs: an L2 flush that leaves
// only clean lines behind. sink: 16 writable bytes, stored to only when the XOR of all the data
// equals a fixed 128-bit constant (it keeps the loads from being optimized away).
int read_flush_launch(const void* data, int64_t bytes, void* sink, int grid, CUstream_st* stream);

// Fills n 16-bit values (dtype) with a deterministic pseudo-random uniform [-1, 1) sequence.
int fill_uniform_launch(int dtype, void* data, int64_t n, uint64_t seed, CUstream_st* stream);

}  // namespace fasttree::cuda_detail
