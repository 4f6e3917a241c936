#include "cuda/gemm.h"

#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cstdlib>
#include <map>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

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

// Tuning (cublasLt) is on unless FT_GEMM_TUNE=0.
bool tuning_enabled() {
  const char* e = std::getenv("FT_GEMM_TUNE");
  return e == nullptr || std::string(e) != "0";
}

// One tuned GEMM shape: its cublasLt descriptors and the fastest algorithm measured for it.
struct LtPlan {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulAlgo_t algo{};
  bool use_lt = false;  // false: cublasGemmEx's own choice was fastest (or no Lt algorithm fits)
};

// The winner per shape is shared by every Gemm of the process (so two models of the same shapes
// compute bit-identical results, whatever the timing noise), keyed by device and shape.
struct TunedAlgo {
  bool use_lt = false;
  cublasLtMatmulAlgo_t algo{};
};
using TuneKey = std::tuple<int, int64_t, int64_t, int64_t, int, bool>;  // device, n, out, in, y type, accumulate
std::mutex g_tuned_mutex;
std::map<TuneKey, TunedAlgo>& tuned_algos() {
  static std::map<TuneKey, TunedAlgo> m;
  return m;
}

}  // namespace

// Shapes with at most kGemmTuneMaxRows rows (decode batches, short prefills) are timed once with
// up to kGemmTuneCandidates cublasLt heuristic algorithms plus cublasGemmEx's default, on scratch
// output, the first time they are seen (outside stream capture); the winner is cached per shape.
// Skinny decode GEMMs (n = 128 rows) are weight-read bound and the default heuristic leaves
// bandwidth unused on the narrow projections (o_proj, down_proj), where split-K variants win.
struct Gemm::Impl {
  using Key = std::tuple<int64_t, int64_t, int64_t, int, bool>;  // n, out, in, y type, accumulate
  static constexpr int64_t kGemmTuneMaxRows = 512;
  static constexpr int kGemmTuneCandidates = 8;

  cublasHandle_t handle = nullptr;
  cublasLtHandle_t lt = nullptr;
  DeviceBuffer workspace;
  DeviceBuffer scratch;  // tuning output
  cudaStream_t stream = nullptr;
  bool tune = tuning_enabled();
  std::map<Key, LtPlan> plans;

  ~Impl() {
    for (auto& [key, p] : plans) {
      if (p.op != nullptr) (void)cublasLtMatmulDescDestroy(p.op);
      for (auto l : {p.a, p.b, p.c})
        if (l != nullptr) (void)cublasLtMatrixLayoutDestroy(l);
    }
    if (lt != nullptr) (void)cublasLtDestroy(lt);
    if (handle != nullptr) (void)cublasDestroy(handle);
  }

  void gemm_ex(const uint16_t* x, const uint16_t* w, int64_t n, int64_t out, int64_t in, void* y,
               cudaDataType_t y_type, float beta) const {
    const float alpha = 1.0f;
    // Column-major: C[out, n] = Wᵀ(op T of column-major [in, out]) · X (column-major [in, n]).
    FT_CUBLAS_CHECK(cublasGemmEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(out), static_cast<int>(n),
                                 static_cast<int>(in), &alpha, w, CUDA_R_16BF, static_cast<int>(in), x, CUDA_R_16BF,
                                 static_cast<int>(in), &beta, y, y_type, static_cast<int>(out), CUBLAS_COMPUTE_32F,
                                 CUBLAS_GEMM_DEFAULT));
  }

  cublasStatus_t lt_matmul(const LtPlan& p, const cublasLtMatmulAlgo_t& algo, const uint16_t* x, const uint16_t* w,
                           void* y, float beta) const {
    const float alpha = 1.0f;
    return cublasLtMatmul(lt, p.op, &alpha, w, p.a, x, p.b, &beta, y, p.c, y, p.c, &algo, workspace.data(),
                          workspace.bytes(), stream);
  }

  // Median-free quick timing: total of `reps` runs after one warm-up, in ms; < 0 when it fails.
  template <class F>
  float time_runs(F&& f, int reps) {
    if (!f()) return -1.0f;
    cudaEvent_t e0, e1;
    FT_CUDA_CHECK(cudaEventCreate(&e0));
    FT_CUDA_CHECK(cudaEventCreate(&e1));
    FT_CUDA_CHECK(cudaEventRecord(e0, stream));
    bool ok = true;
    for (int r = 0; r < reps && ok; ++r) ok = f();
    FT_CUDA_CHECK(cudaEventRecord(e1, stream));
    FT_CUDA_CHECK(cudaEventSynchronize(e1));
    float ms = 0.0f;
    FT_CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
    (void)cudaEventDestroy(e0);
    (void)cudaEventDestroy(e1);
    return ok ? ms : -1.0f;
  }

  LtPlan make_plan(const uint16_t* x, const uint16_t* w, int64_t n, int64_t out, int64_t in, cudaDataType_t y_type,
                   float beta) {
    LtPlan p;
    FT_CUBLAS_CHECK(cublasLtMatmulDescCreate(&p.op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
    FT_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)));
    FT_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)));
    FT_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.a, CUDA_R_16BF, static_cast<uint64_t>(in), static_cast<uint64_t>(out), in));
    FT_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.b, CUDA_R_16BF, static_cast<uint64_t>(in), static_cast<uint64_t>(n), in));
    FT_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.c, y_type, static_cast<uint64_t>(out), static_cast<uint64_t>(n), out));
    cublasLtMatmulPreference_t pref = nullptr;
    FT_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
    const uint64_t ws = workspace.bytes();
    FT_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)));
    // No in-place (atomic) split-K reduction: results stay deterministic run to run.
    const uint32_t reduction = CUBLASLT_REDUCTION_SCHEME_MASK & ~uint32_t{CUBLASLT_REDUCTION_SCHEME_INPLACE};
    FT_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, &reduction,
                                                         sizeof(reduction)));
    cublasLtMatmulHeuristicResult_t results[kGemmTuneCandidates] = {};
    int count = 0;
    const cublasStatus_t st =
        cublasLtMatmulAlgoGetHeuristic(lt, p.op, p.a, p.b, p.c, p.c, pref, kGemmTuneCandidates, results, &count);
    (void)cublasLtMatmulPreferenceDestroy(pref);
    if (st != CUBLAS_STATUS_SUCCESS || count <= 0) return p;
    int device = 0;
    FT_CUDA_CHECK(cudaGetDevice(&device));
    const TuneKey tkey{device, n, out, in, static_cast<int>(y_type), beta != 0.0f};
    {
      std::lock_guard<std::mutex> lock(g_tuned_mutex);
      auto it = tuned_algos().find(tkey);
      if (it != tuned_algos().end()) {
        p.use_lt = it->second.use_lt;
        p.algo = it->second.algo;
        return p;
      }
    }

    // Time on scratch output (beta = 0 there: accumulating GEMMs must not touch y while tuning).
    const size_t y_bytes = static_cast<size_t>(n * out) * (y_type == CUDA_R_32F ? 4 : 2);
    scratch.reserve(y_bytes);
    void* ys = scratch.data();
    const int reps = 5;
    float best = time_runs([&] { gemm_ex(x, w, n, out, in, ys, y_type, 0.0f); return true; }, reps);
    for (int i = 0; i < count; ++i) {
      if (results[i].state != CUBLAS_STATUS_SUCCESS) continue;
      const float t = time_runs([&] { return lt_matmul(p, results[i].algo, x, w, ys, 0.0f) == CUBLAS_STATUS_SUCCESS; }, reps);
      if (t >= 0.0f && t < best) {
        best = t;
        p.algo = results[i].algo;
        p.use_lt = true;
      }
    }
    std::lock_guard<std::mutex> lock(g_tuned_mutex);
    tuned_algos().emplace(tkey, TunedAlgo{p.use_lt, p.algo});
    return p;
  }

  void gemm(const uint16_t* x, const uint16_t* w, int64_t n, int64_t out, int64_t in, void* y, cudaDataType_t y_type,
            float beta) {
    check_dims(n, out, in);
    if (tune && n <= kGemmTuneMaxRows) {
      const Key key{n, out, in, static_cast<int>(y_type), beta != 0.0f};
      auto it = plans.find(key);
      if (it == plans.end()) {
        cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
        FT_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
        if (capture == cudaStreamCaptureStatusNone) it = plans.emplace(key, make_plan(x, w, n, out, in, y_type, beta)).first;
      }
      if (it != plans.end() && it->second.use_lt) {
        FT_CUBLAS_CHECK(lt_matmul(it->second, it->second.algo, x, w, y, beta));
        return;
      }
    }
    gemm_ex(x, w, n, out, in, y, y_type, beta);
  }
};

Gemm::Gemm(CUstream_st* stream) : stream_(stream), impl_(std::make_unique<Impl>()) {
  impl_->stream = stream;
  FT_CUBLAS_CHECK(cublasCreate(&impl_->handle));
  FT_CUBLAS_CHECK(cublasLtCreate(&impl_->lt));
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
