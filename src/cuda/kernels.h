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
template <int DType, int D>
int tree_kernel_prepare(TreeKernelInfo& info);

// Launches the tree-attention kernel on `grid` persistent CTAs.
template <int DType, int D>
int tree_kernel_launch(const TreeAttnParams& params, int grid, CUstream_st* stream);

// Warp-per-unit kernel for short units (tree_attention_warp.cuh; head_dim 64 and 128 only, else
// cudaErrorInvalidValue): prepare reports its resident CTAs per SM, launch runs `grid` persistent
// CTAs of kWarpUnitThreads threads over units [counts->num_units, counts->num_all_units).
template <int DType, int D>
int warp_kernel_prepare(int& ctas_per_sm);
template <int DType, int D>
int warp_kernel_launch(const TreeAttnParams& params, int grid, CUstream_st* stream);

// Launches the merge kernel (grid-stride over non-direct queries x heads). pdl: as a programmatic
// dependent of the kernel enqueued just before it on `stream` (that kernel must be the one writing
// the partials, and nothing else may come between them).
int merge_kernel_launch(int head_dim, const MergeParams& params, int grid, CUstream_st* stream, bool pdl);

// Fills n 16-bit values (dtype) with a deterministic pseudo-random uniform [-1, 1) sequence.
int fill_uniform_launch(int dtype, void* data, int64_t n, uint64_t seed, CUstream_st* stream);

}  // namespace fasttree::cuda_detail
