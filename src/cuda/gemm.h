// cuBLAS GEMMs of the engine's linear layers (engine/gpu_model.h). No CUDA header here.
//
//   y[n, out] = x[n, in] · W[out, in]ᵀ (+ beta · y)
// x and W bf16 (uint16_t, row-major; W in HF's [out, in] layout), fp32 accumulation, y fp32 or
// bf16 (row-major). cuBLAS is column-major: W row-major [out, in] is column-major [in, out], so the
// call is C[out, n] = op_T(W) · X with X column-major [in, n] (= x row-major) and C = y row-major.
//
// A Gemm owns a cuBLAS handle bound to one stream and a fixed workspace (set once), so a call
// never allocates and can be captured in a CUDA graph. Calls enqueue on that stream.
#pragma once
#include <cstdint>
#include <memory>

struct CUstream_st;

namespace fasttree {

inline constexpr size_t kGemmWorkspaceBytes = size_t{32} << 20;  // cuBLAS' recommendation on Hopper

class Gemm {
 public:
  explicit Gemm(CUstream_st* stream);
  ~Gemm();
  Gemm(const Gemm&) = delete;
  Gemm& operator=(const Gemm&) = delete;

  // y fp32 [n, out] = x [n, in] · Wᵀ + beta · y. Sizes must be positive and below 2^31.
  void linear(const uint16_t* x, const uint16_t* w, int64_t n, int64_t out, int64_t in, float* y,
              float beta = 0.0f) const;
  // y bf16 [n, out] = bf16(x [n, in] · Wᵀ).
  void linear(const uint16_t* x, const uint16_t* w, int64_t n, int64_t out, int64_t in, uint16_t* y) const;

  CUstream_st* stream() const { return stream_; }

 private:
  struct Impl;
  CUstream_st* stream_;
  std::unique_ptr<Impl> impl_;
};

}  // namespace fasttree
