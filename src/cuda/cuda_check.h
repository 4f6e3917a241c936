// FT_CUDA_CHECK(expr): throws fasttree::Error naming the call and the CUDA error when a runtime call
// (or a launcher returning a cudaError_t as int) fails. For .cpp files of the CUDA layer only.
#pragma once
#include <cuda_runtime.h>

#include <string>

#include "core/error.h"

#define FT_CUDA_CHECK(expr)                                                                          \
  do {                                                                                               \
    const cudaError_t ft_cuda_err_ = static_cast<cudaError_t>(expr);                                 \
    FT_CHECK(ft_cuda_err_ == cudaSuccess,                                                            \
             std::string("CUDA error in ") + #expr + ": " + cudaGetErrorName(ft_cuda_err_) + " (" + \
                 cudaGetErrorString(ft_cuda_err_) + ")");                                            \
  } while (0)
