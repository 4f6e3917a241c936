#include "cuda/gemm.h"

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <climits>
#include <string>

#include "core/error.h"
#include "cuda/cuda_check.h"
#include "cuda/device.h"

namespace fasttree {

namespace {

#define FT_CUBLAS_CHECK(expr)                                                                          \
  do {                                                                                                 \
    const cublasStatus_t ft_cublas_st_ = (expr);                                                       \
    FT_CHECK(ft_cublas_st_ == CUBLAS_STATUS_SUCCESS, std::string("cuBLAS error in ") + #expr + ": " + \
                                                         cublasGetStatusName(ft_cublas_st_) + " (" +   \
                                                         cublasGetStatusString(ft_cublas_st_) + ")");  \
  } while (0)

void check_dims(int64_t n, int64_t out, int64_t in) {
  FT_CHECK(n > 0 && out > 0 && in > 0 && n <= INT_MAX && out <= INT_MAX && in <= INT_MAX,
           "gemm: sizes n " + std::to_string(n) + ", out " + std::to_string(out) + ", in " + std::to_string(in) +
               " must be in [1, 2^31)");
}

}  // namespace

struct Gemm::Impl {
  cublasHandle_t handle = nullptr;
  DeviceBuffer workspace;

  ~Impl() {
    if (handle != nullptr) (void)cublasDestroy(handle);
  }
  void gemm(const uint16_t* x, const uint16_t* w, int64_t n, int64_t out, int64_t in, void* y, cudaDataType_t y_type,
            float beta) const {
    check_dims(n, out, in);
    const float alpha = 1.0f;
    // Column-major: C[out, n] = Wᵀ(op T of column-major [in, out]) · X (column-major [in, n]).
    FT_CUBLAS_CHECK(cublasGemmEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(out), static_cast<int>(n),
                                 static_cast<int>(in), &alpha, w, CUDA_R_16BF, static_cast<int>(in), x, CUDA_R_16BF,
                                 static_cast<int>(in), &beta, y, y_type, static_cast<int>(out), CUBLAS_COMPUTE_32F,
                                 CUBLAS_GEMM_DEFAULT));
  }
};

Gemm::Gemm(CUstream_st* stream) : stream_(stream), impl_(std::make_unique<Impl>()) {
  FT_CUBLAS_CHECK(cublasCreate(&impl_->handle));
  FT_CUBLAS_CHECK(cublasSetStream(impl_->handle, stream));
  impl_->workspace.reserve(kGemmWorkspaceBytes);
  FT_CUBLAS_CHECK(cublasSetWorkspace(impl_->handle, impl_->workspace.data(), impl_->workspace.bytes()));
  FT_CUBLAS_CHECK(cublasSetPointerMode(impl_->handle, CUBLAS_POINTER_MODE_HOST));
}

Gemm::~Gemm() = default;

void Gemm::linear(const uint16_t* x, const uint16_t* w, int64_t n, int64_t out, int64_t in, float* y,
                  float beta) const {
  impl_->gemm(x, w, n, out, in, y, CUDA_R_32F, beta);
}

void Gemm::linear(const uint16_t* x, const uint16_t* w, int64_t n, int64_t out, int64_t in, uint16_t* y) const {
  impl_->gemm(x, w, n, out, in, y, CUDA_R_16BF, 0.0f);
}

}  // namespace fasttree
