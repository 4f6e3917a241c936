// Launcher templates of the tree-attention kernel; each tree_attention_<dtype>_d<D>.cu instantiates
// one (dtype, head_dim) pair so that the kernels compile in parallel.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "cuda/kernels.h"
#include "cuda/tree_attention_kernel.cuh"
#include "cuda/tree_attention_warp.cuh"
#include "cuda/tree_attention_warp_staged.cuh"

namespace fasttree::cuda_detail {

template <int DType>
struct DTypeOf;
template <>
struct DTypeOf<kDTypeF16> {
  using T = __half;
};
template <>
struct DTypeOf<kDTypeBF16> {
  using T = __nv_bfloat16;
};

template <int DType, int D, bool kDeep>
int tree_kernel_prepare_variant(TreeKernelInfo& info) {
  using Cfg = TreeKernelConfig<D, kDeep>;
  const auto kernel = tree_attention_kernel<typename DTypeOf<DType>::T, D, kDeep>;
  cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg::kSmemBytes);
  if (e != cudaSuccess) return e;
  e = cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout, cudaSharedmemCarveoutMaxShared);
  if (e != cudaSuccess) return e;
  int n = 0;
  e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, Cfg::kThreads, Cfg::kSmemBytes);
  info = TreeKernelInfo{Cfg::kSmemBytes, Cfg::kThreads, n};
  return e;
}

// deep: the 3-stage variant (TreeKernelConfig::kQGlobal), d = 128 only (ignored at other head dims).
template <int DType, int D>
int tree_kernel_prepare(TreeKernelInfo& info, bool deep) {
  if constexpr (D == 128) {
    if (deep) return tree_kernel_prepare_variant<DType, D, true>(info);
  }
  return tree_kernel_prepare_variant<DType, D, false>(info);
}

template <int DType, int D, bool kDeep>
int tree_kernel_launch_variant(const TreeAttnParams& params, int grid, CUstream_st* stream) {
  using Cfg = TreeKernelConfig<D, kDeep>;
  tree_attention_kernel<typename DTypeOf<DType>::T, D, kDeep><<<grid, Cfg::kThreads, Cfg::kSmemBytes, stream>>>(params);
  return cudaGetLastError();
}

template <int DType, int D>
int tree_kernel_launch(const TreeAttnParams& params, int grid, CUstream_st* stream, bool deep) {
  if constexpr (D == 128) {
    if (deep) return tree_kernel_launch_variant<DType, D, true>(params, grid, stream);
  }
  return tree_kernel_launch_variant<DType, D, false>(params, grid, stream);
}

// Staged warp kernel of ring depth S with `warps` warps per CTA.
template <class T, int D, int S>
int warp_staged_prepare(int warps, int& ctas_per_sm) {
  const auto kernel = warp_staged_kernel<T, D, S>;
  const int smem = warps * WarpStagedCfg<D, S>::kWarpBytes;
  cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (e != cudaSuccess) return e;
  e = cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout, cudaSharedmemCarveoutMaxShared);
  if (e != cudaSuccess) return e;
  return cudaOccupancyMaxActiveBlocksPerMultiprocessor(&ctas_per_sm, kernel, 32 * warps, smem);
}

template <int DType, int D>
int warp_kernel_prepare(int& ctas_per_sm, const WarpKernelShape& shape) {
  ctas_per_sm = 0;
  if constexpr (D == 64 || D == 128) {
    using T = typename DTypeOf<DType>::T;
    if (shape.stages == 2) return warp_staged_prepare<T, D, 2>(shape.warps, ctas_per_sm);
    if (shape.stages == 3) return warp_staged_prepare<T, D, 3>(shape.warps, ctas_per_sm);
    return cudaOccupancyMaxActiveBlocksPerMultiprocessor(&ctas_per_sm, warp_unit_kernel<T, D>, kWarpUnitThreads, 0);
  } else {
    return cudaErrorInvalidValue;
  }
}

template <int DType, int D>
int warp_kernel_launch(const TreeAttnParams& params, int grid, CUstream_st* stream, const WarpKernelShape& shape) {
  if constexpr (D == 64 || D == 128) {
    using T = typename DTypeOf<DType>::T;
    const dim3 block(32 * shape.warps);
    if (shape.stages == 2) {
      warp_staged_kernel<T, D, 2><<<grid, block, shape.warps * WarpStagedCfg<D, 2>::kWarpBytes, stream>>>(params);
    } else if (shape.stages == 3) {
      warp_staged_kernel<T, D, 3><<<grid, block, shape.warps * WarpStagedCfg<D, 3>::kWarpBytes, stream>>>(params);
    } else {
      warp_unit_kernel<T, D><<<grid, kWarpUnitThreads, 0, stream>>>(params);
    }
    return cudaGetLastError();
  } else {
    return cudaErrorInvalidValue;
  }
}

}  // namespace fasttree::cuda_detail

#define FASTTREE_INSTANTIATE_TREE_KERNEL(DTYPE, D)                                                      \
  template int fasttree::cuda_detail::tree_kernel_prepare<DTYPE, D>(fasttree::cuda_detail::TreeKernelInfo&, bool); \
  template int fasttree::cuda_detail::tree_kernel_launch<DTYPE, D>(const fasttree::cuda_detail::TreeAttnParams&, int, \
                                                                   CUstream_st*, bool); \
  template int fasttree::cuda_detail::warp_kernel_prepare<DTYPE, D>(int&, const fasttree::cuda_detail::WarpKernelShape&);                              \
  template int fasttree::cuda_detail::warp_kernel_launch<DTYPE, D>(const fasttree::cuda_detail::TreeAttnParams&, int, \
                                                                   CUstream_st*, const fasttree::cuda_detail::WarpKernelShape&);
