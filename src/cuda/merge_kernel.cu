// Launcher of the merge kernel (merge_kernel.cuh).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "cuda/kernels.h"
#include "cuda/merge_kernel.cuh"

namespace fasttree::cuda_detail {

namespace {

template <int D>
int launch_merge(const MergeParams& params, int grid, CUstream_st* stream, bool pdl, bool wide) {
  const auto kernel = wide ? merge_kernel_wide<D> : merge_kernel<D>;
  if (!pdl) {
    kernel<<<grid, kMergeThreads, 0, stream>>>(params);
    return cudaGetLastError();
  }
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(static_cast<unsigned>(grid));
  cfg.blockDim = dim3(kMergeThreads);
  cfg.dynamicSmemBytes = 0;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  return cudaLaunchKernelEx(&cfg, kernel, params);
}

}  // namespace

int merge_kernel_launch(int head_dim, const MergeParams& params, int grid, CUstream_st* stream, bool pdl, bool wide) {
  switch (head_dim) {
    case 64: return launch_merge<64>(params, grid, stream, pdl, wide);
    case 128: return launch_merge<128>(params, grid, stream, pdl, wide);
    case 256: return launch_merge<256>(params, grid, stream, pdl, wide);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace fasttree::cuda_detail
