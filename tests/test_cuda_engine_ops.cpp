// The engine's CUDA kernels (cuda/engine_ops.h) against independent CPU references:
// engine/cpu_ops.h (rms_norm, silu_mul), engine/rope.h (Rope::apply), core/half.h (bf16 rounding)
// and an fp64 causal attention loop. GPU tests skip themselves without a device; the host-check
// tests (HostChecks*) run everywhere: bad shapes must throw fasttree::Error naming the problem
// BEFORE any CUDA call (they pass null device pointers).
//
// Inputs are random (never zeros), rounded to bf16 where the kernel reads bf16. Every output buffer
// is poisoned with 0xFF bytes (fp32 / bf16 NaN, int32 -1) before each kernel, so an unwritten element
// fails. Tolerances (bf16 has 8 significant bits, relative rounding error <= 2^-9 ~ 2e-3):
//   exact fp32 ops (embed, add_bias, the resid += delta of add_rms_norm, f32_to_bf16): bit-exact;
//   rms_norm / silu_mul bf16 outputs: |gpu - ref| <= 1e-2 * |ref| + 1e-6 (fp32 vs fp64 sums, one rounding);
//   rope: bf16 outputs equal the CPU's bf16-rounded fp32 result, or differ by 1 bf16 ulp on at most
//     0.1% of elements (a cos/sin rounding difference of the two libms can flip a rounding);
//   varlen prefill: each sequence's rows bit-identical to the single-sequence call on it;
//   prefill attention (bf16 out, |O| <= 2 since |V| <= 2): |gpu - ref| <= 2e-2 + 1e-2 |ref| (P is rounded
//     to bf16 for P·V on tensor cores, plus the bf16 output rounding).
#include <gtest/gtest.h>

#if FASTTREE_HAVE_CUDA
#include <cuda_runtime.h>

#include <algorithm>
#include <bit>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/half.h"
#include "cuda/backend.h"
#include "cuda/cuda_check.h"
#include "cuda/engine_ops.h"
#include "engine/cpu_ops.h"
#include "engine/rope.h"

namespace fasttree {
namespace {

namespace ops = cuda_ops;

#define SKIP_WITHOUT_GPU() \
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device"

// Device buffer of n elements; poison() fills it with 0xFF bytes.
template <class T>
class DevBuf {
 public:
  explicit DevBuf(size_t n) : n_(n) { FT_CUDA_CHECK(cudaMalloc(&p_, std::max<size_t>(n, 1) * sizeof(T))); }
  explicit DevBuf(const std::vector<T>& host) : DevBuf(host.size()) { upload(host); }
  ~DevBuf() { cudaFree(p_); }
  DevBuf(const DevBuf&) = delete;
  DevBuf& operator=(const DevBuf&) = delete;
  T* get() { return p_; }
  void upload(const std::vector<T>& host) {
    FT_CHECK(host.size() == n_, "DevBuf::upload size mismatch");
    FT_CUDA_CHECK(cudaMemcpy(p_, host.data(), n_ * sizeof(T), cudaMemcpyHostToDevice));
  }
  std::vector<T> download() const {
    std::vector<T> host(n_);
    FT_CUDA_CHECK(cudaMemcpy(host.data(), p_, n_ * sizeof(T), cudaMemcpyDeviceToHost));
    return host;
  }
  void poison() { FT_CUDA_CHECK(cudaMemset(p_, 0xff, n_ * sizeof(T))); }

 private:
  T* p_ = nullptr;
  size_t n_;
};

void sync() {
  FT_CUDA_CHECK(cudaDeviceSynchronize());
  FT_CUDA_CHECK(cudaGetLastError());
}

float rbf(float x) { return bf16_to_float(float_to_bf16(x)); }

// Uniform in [lo, hi), |x| >= 1e-3 (never zero).
std::vector<float> random_floats(size_t n, float lo, float hi, std::mt19937& rng) {
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> x(n);
  for (float& e : x) {
    do e = dist(rng);
    while (std::abs(e) < 1e-3f);
  }
  return x;
}
std::vector<uint16_t> to_bf16(const std::vector<float>& x) {
  std::vector<uint16_t> b(x.size());
  for (size_t i = 0; i < x.size(); ++i) b[i] = float_to_bf16(x[i]);
  return b;
}
std::vector<float> from_bf16(const std::vector<uint16_t>& b) {
  std::vector<float> x(b.size());
  for (size_t i = 0; i < b.size(); ++i) x[i] = bf16_to_float(b[i]);
  return x;
}

// Max violation of |got - ref| <= abs_tol + rel_tol |ref| (NaN in got: infinite), as a ratio: <= 1 passes.
double tol_ratio(const std::vector<float>& got, const std::vector<double>& ref, double abs_tol, double rel_tol,
                 size_t* worst = nullptr) {
  double r = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double e = std::isnan(got[i]) ? INFINITY : std::abs(double(got[i]) - ref[i]) / (abs_tol + rel_tol * std::abs(ref[i]));
    if (e > r) {
      r = e;
      if (worst != nullptr) *worst = i;
    }
  }
  return r;
}

// Throws fasttree::Error whose message contains `what`.
#define EXPECT_ERROR_WITH(stmt, substr)                                                                   \
  do {                                                                                                  \
    try {                                                                                               \
      stmt;                                                                                             \
      ADD_FAILURE() << #stmt " did not throw";                                                          \
    } catch (const Error& e) {                                                                          \
      EXPECT_NE(std::string(e.what()).find(substr), std::string::npos) << #stmt " threw: " << e.what(); \
    }                                                                                                   \
  } while (0)

// ---- host checks: no GPU needed --------------------------------------------------------------------

TEST(CudaEngineOps, HostChecksThrowOnBadShapes) {
  const int32_t* ci = nullptr;
  const uint16_t* cb = nullptr;
  const float* cf = nullptr;
  uint16_t* b = nullptr;
  float* f = nullptr;
  int32_t* i = nullptr;
  // Negative sizes.
  EXPECT_ERROR_WITH(ops::embed(ci, -1, cb, 10, 8, f, nullptr), "negative");
  EXPECT_ERROR_WITH(ops::add_rms_norm(f, cf, cb, 1e-5f, -3, 8, b, nullptr), "negative");
  EXPECT_ERROR_WITH(ops::rope_qkv_append(cf, cf, ci, ci, -1, 4, 2, 64, cf, b, b, b, nullptr), "negative");
  EXPECT_ERROR_WITH(ops::silu_mul(cb, -1, 8, b, nullptr), "negative");
  EXPECT_ERROR_WITH(ops::add_bias(f, cf, -1, 8, nullptr), "negative");
  EXPECT_ERROR_WITH(ops::f32_to_bf16(cf, -5, b, nullptr), "negative");
  EXPECT_ERROR_WITH(ops::argmax_rows(cf, -1, 100, i, nullptr), "negative");
  EXPECT_ERROR_WITH(ops::fill_uniform_bf16(b, -1, 0.f, 1.f, 1, nullptr), "negative");
  EXPECT_ERROR_WITH(ops::prefill_attention(cb, cb, cb, ci, 10, -1, 4, 4, 128, 0.1f, b, nullptr), "negative");
  EXPECT_ERROR_WITH(ops::prefill_attention_simple(cb, cb, cb, ci, 10, -1, 4, 4, 128, 0.1f, b, nullptr), "negative");
  // Bad dimensions.
  EXPECT_ERROR_WITH(ops::embed(ci, 2, cb, 0, 8, f, nullptr), "vocab");
  EXPECT_ERROR_WITH(ops::embed(ci, 2, cb, 10, 0, f, nullptr), "h =");
  EXPECT_ERROR_WITH(ops::add_rms_norm(f, cf, cb, 1e-5f, 2, 0, b, nullptr), "h =");
  EXPECT_ERROR_WITH(ops::add_rms_norm(f, cf, cb, -1.0f, 2, 8, b, nullptr), "eps");
  EXPECT_ERROR_WITH(ops::add_rms_norm(f, cf, cb, NAN, 2, 8, b, nullptr), "eps");
  EXPECT_ERROR_WITH(ops::rope_qkv_append(cf, cf, ci, ci, 2, 4, 2, 63, cf, b, b, b, nullptr), "even");
  EXPECT_ERROR_WITH(ops::rope_qkv_append(cf, cf, ci, ci, 2, 4, 2, 0, cf, b, b, b, nullptr), "head_dim");
  EXPECT_ERROR_WITH(ops::rope_qkv_append(cf, cf, ci, ci, 2, 0, 2, 64, cf, b, b, b, nullptr), "num_q_heads");
  EXPECT_ERROR_WITH(ops::rope_qkv_append(cf, cf, ci, ci, 2, 4, -2, 64, cf, b, b, b, nullptr), "num_kv_heads");
  EXPECT_ERROR_WITH(ops::silu_mul(cb, 2, 0, b, nullptr), "inter");
  EXPECT_ERROR_WITH(ops::add_bias(f, cf, 2, 0, nullptr), "dim");
  EXPECT_ERROR_WITH(ops::argmax_rows(cf, 2, 0, i, nullptr), "vocab");
  EXPECT_ERROR_WITH(ops::argmax_rows(cf, 2, int64_t{1} << 33, i, nullptr), "vocab");
  EXPECT_ERROR_WITH(ops::fill_uniform_bf16(b, 10, 1.f, 1.f, 1, nullptr), "lo < hi");
  EXPECT_ERROR_WITH(ops::fill_uniform_bf16(b, 10, 0.f, INFINITY, 1, nullptr), "lo < hi");
  EXPECT_ERROR_WITH(ops::prefill_attention(cb, cb, cb, ci, 10, 4, 4, 4, 96, 0.1f, b, nullptr), "head_dim");
  EXPECT_ERROR_WITH(ops::prefill_attention(cb, cb, cb, ci, 10, 4, 6, 4, 128, 0.1f, b, nullptr), "multiple");
  EXPECT_ERROR_WITH(ops::prefill_attention(cb, cb, cb, ci, 10, 4, 4, 0, 128, 0.1f, b, nullptr), "num_kv_heads");
  EXPECT_ERROR_WITH(ops::prefill_attention(cb, cb, cb, ci, 3, 4, 4, 4, 128, 0.1f, b, nullptr), "num_keys");
  EXPECT_ERROR_WITH(ops::prefill_attention(cb, cb, cb, ci, 10, 4, 4, 4, 128, NAN, b, nullptr), "sm_scale");
  EXPECT_ERROR_WITH(ops::prefill_attention_simple(cb, cb, cb, ci, 10, 4, 4, 4, 100, 0.1f, b, nullptr), "head_dim");
  // Good shapes but null device pointers.
  EXPECT_ERROR_WITH(ops::embed(ci, 2, cb, 10, 8, f, nullptr), "null");
  EXPECT_ERROR_WITH(ops::add_rms_norm(f, cf, cb, 1e-5f, 2, 8, b, nullptr), "null");
  EXPECT_ERROR_WITH(ops::rope_qkv_append(cf, cf, ci, ci, 2, 4, 2, 64, cf, b, b, b, nullptr), "null");
  EXPECT_ERROR_WITH(ops::silu_mul(cb, 2, 8, b, nullptr), "null");
  EXPECT_ERROR_WITH(ops::add_bias(f, cf, 2, 8, nullptr), "null");
  EXPECT_ERROR_WITH(ops::f32_to_bf16(cf, 5, b, nullptr), "null");
  EXPECT_ERROR_WITH(ops::argmax_rows(cf, 2, 100, i, nullptr), "null");
  EXPECT_ERROR_WITH(ops::fill_uniform_bf16(b, 10, 0.f, 1.f, 1, nullptr), "null");
  EXPECT_ERROR_WITH(ops::prefill_attention(cb, cb, cb, ci, 10, 4, 4, 4, 128, 0.1f, b, nullptr), "null");
}

TEST(CudaEngineOps, HostChecksZeroRowsIsNoOp) {
  // n == 0 returns before any check of the other arguments or any CUDA call.
  EXPECT_NO_THROW(ops::embed(nullptr, 0, nullptr, 0, 0, nullptr, nullptr));
  EXPECT_NO_THROW(ops::add_rms_norm(nullptr, nullptr, nullptr, -1.f, 0, 0, nullptr, nullptr));
  EXPECT_NO_THROW(ops::rope_qkv_append(nullptr, nullptr, nullptr, nullptr, 0, 0, 0, 3, nullptr, nullptr, nullptr,
                                       nullptr, nullptr));
  EXPECT_NO_THROW(ops::silu_mul(nullptr, 0, 0, nullptr, nullptr));
  EXPECT_NO_THROW(ops::add_bias(nullptr, nullptr, 0, 0, nullptr));
  EXPECT_NO_THROW(ops::f32_to_bf16(nullptr, 0, nullptr, nullptr));
  EXPECT_NO_THROW(ops::argmax_rows(nullptr, 0, 0, nullptr, nullptr));
  EXPECT_NO_THROW(ops::fill_uniform_bf16(nullptr, 0, 1.f, 0.f, 0, nullptr));
  EXPECT_NO_THROW(ops::prefill_attention(nullptr, nullptr, nullptr, nullptr, 0, 0, 0, 0, 0, 0.f, nullptr, nullptr));
  EXPECT_NO_THROW(
      ops::prefill_attention_simple(nullptr, nullptr, nullptr, nullptr, 0, 0, 0, 0, 0, 0.f, nullptr, nullptr));
}

// ---- elementwise ops ---------------------------------------------------------------------------------

void check_embed(int n, int64_t vocab, int64_t h, uint32_t seed) {
  std::mt19937 rng(seed);
  const std::vector<uint16_t> table = to_bf16(random_floats(static_cast<size_t>(vocab * h), -1, 1, rng));
  std::vector<int32_t> tokens(n);
  std::uniform_int_distribution<int32_t> tok(0, static_cast<int32_t>(vocab - 1));
  for (auto& t : tokens) t = tok(rng);
  if (n > 2) {
    tokens[1] = -7;                                // out of range: clamped to 0
    tokens[2] = static_cast<int32_t>(vocab + 3);  // out of range: clamped to 0
  }
  DevBuf<uint16_t> d_table(table);
  DevBuf<int32_t> d_tokens(tokens);
  DevBuf<float> d_resid(static_cast<size_t>(n * h));
  d_resid.poison();
  ops::embed(d_tokens.get(), n, d_table.get(), vocab, h, d_resid.get(), nullptr);
  sync();
  const std::vector<float> got = d_resid.download();
  for (int i = 0; i < n; ++i) {
    const int64_t t = tokens[i] < 0 || tokens[i] >= vocab ? 0 : tokens[i];
    for (int64_t c = 0; c < h; ++c)
      ASSERT_EQ(std::bit_cast<uint32_t>(got[i * h + c]), std::bit_cast<uint32_t>(bf16_to_float(table[t * h + c])))
          << "row " << i << " col " << c << " h " << h;
  }
}

TEST(CudaEngineOps, EmbedSmall) {
  SKIP_WITHOUT_GPU();
  check_embed(5, 11, 32, 1);  // vectorized
  check_embed(4, 7, 30, 2);   // scalar (h % 4 != 0)
}

TEST(CudaEngineOps, Embed) {
  SKIP_WITHOUT_GPU();
  check_embed(300, 1000, 4096, 3);
  check_embed(17, 50, 1001, 4);
}

void check_add_rms_norm(int n, int64_t h, bool with_delta, uint32_t seed) {
  SCOPED_TRACE("n " + std::to_string(n) + " h " + std::to_string(h) + " delta " + std::to_string(with_delta));
  std::mt19937 rng(seed);
  const float eps = 1e-5f;
  const std::vector<float> resid = random_floats(static_cast<size_t>(n * h), -3, 3, rng);
  const std::vector<float> delta = random_floats(static_cast<size_t>(n * h), -1, 1, rng);
  const std::vector<uint16_t> weight = to_bf16(random_floats(static_cast<size_t>(h), -2, 2, rng));
  DevBuf<float> d_resid(resid), d_delta(delta);
  DevBuf<uint16_t> d_weight(weight), d_out(static_cast<size_t>(n * h));
  d_out.poison();
  ops::add_rms_norm(d_resid.get(), with_delta ? d_delta.get() : nullptr, d_weight.get(), eps, n, h, d_out.get(),
                    nullptr);
  sync();
  // Reference: resid += delta in fp32 (bit-exact), then engine/cpu_ops rms_norm, then bf16.
  std::vector<float> x = resid;
  if (with_delta)
    for (size_t i = 0; i < x.size(); ++i) x[i] += delta[i];
  const std::vector<float> got_resid = d_resid.download();
  for (size_t i = 0; i < x.size(); ++i) ASSERT_EQ(got_resid[i], x[i]) << "resid " << i;
  std::vector<float> ref(x.size());
  rms_norm(x, from_bf16(weight), eps, ref);
  const std::vector<double> ref_d(ref.begin(), ref.end());
  size_t worst = 0;
  const std::vector<float> got = from_bf16(d_out.download());
  EXPECT_LE(tol_ratio(got, ref_d, 1e-6, 1e-2, &worst), 1.0) << "at " << worst << ": " << got[worst] << " vs " << ref_d[worst];
}

TEST(CudaEngineOps, AddRmsNormSmall) {
  SKIP_WITHOUT_GPU();
  check_add_rms_norm(3, 64, true, 5);
  check_add_rms_norm(2, 33, false, 6);
}

TEST(CudaEngineOps, AddRmsNorm) {
  SKIP_WITHOUT_GPU();
  for (int64_t h : {1000, 2048, 4096, 5120, 8192, 10000, 4097}) {
    check_add_rms_norm(37, h, true, static_cast<uint32_t>(h));
    check_add_rms_norm(5, h, false, static_cast<uint32_t>(h + 1));
  }
}

void check_rope(int n, int hq, int hkv, int d, bool with_bias, uint32_t seed) {
  SCOPED_TRACE("n " + std::to_string(n) + " hq " + std::to_string(hq) + " hkv " + std::to_string(hkv) + " d " +
               std::to_string(d) + " bias " + std::to_string(with_bias));
  std::mt19937 rng(seed);
  const int width = (hq + 2 * hkv) * d;
  const int num_slots = n + 13;
  const std::vector<float> qkv = random_floats(static_cast<size_t>(n) * width, -2, 2, rng);
  const std::vector<float> bias = random_floats(static_cast<size_t>(width), -0.5, 0.5, rng);
  std::vector<int32_t> positions(n), slots(num_slots);
  std::uniform_int_distribution<int32_t> pos(0, 130000);
  for (int i = 0; i < n; ++i) positions[i] = i < 3 ? i : pos(rng);  // 0, 1, 2 and large angles
  std::iota(slots.begin(), slots.end(), 0);
  std::shuffle(slots.begin(), slots.end(), rng);
  slots.resize(n);
  RopeScaling scaling;
  if (d == 128) {  // llama3 scaling on one shape
    scaling.type = RopeScalingType::kLlama3;
  }
  const Rope rope(d, 500000.0, scaling);
  const std::vector<float> inv(rope.inv_freq().begin(), rope.inv_freq().end());

  DevBuf<float> d_qkv(qkv), d_bias(bias), d_inv(inv);
  DevBuf<int32_t> d_pos(positions), d_slots(slots);
  DevBuf<uint16_t> d_q(static_cast<size_t>(n) * hq * d), d_k(static_cast<size_t>(num_slots) * hkv * d),
      d_v(static_cast<size_t>(num_slots) * hkv * d);
  d_q.poison();
  d_k.poison();
  d_v.poison();
  ops::rope_qkv_append(d_qkv.get(), with_bias ? d_bias.get() : nullptr, d_pos.get(), d_slots.get(), n, hq, hkv, d,
                       d_inv.get(), d_q.get(), d_k.get(), d_v.get(), nullptr);
  sync();
  const std::vector<uint16_t> q = d_q.download(), k = d_k.download(), v = d_v.download();

  size_t compared = 0, off_by_one = 0;
  auto cmp = [&](uint16_t got, float ref, const char* what, int i, int e) {
    const uint16_t want = float_to_bf16(ref);
    ++compared;
    if (got == want) return;
    const int diff = std::abs(static_cast<int>(got) - static_cast<int>(want));
    ASSERT_TRUE(diff == 1 && (got & 0x8000) == (want & 0x8000))
        << what << " row " << i << " elem " << e << ": got " << bf16_to_float(got) << " want " << ref;
    ++off_by_one;
  };
  std::vector<bool> used(num_slots, false);
  for (int i = 0; i < n; ++i) {
    std::vector<float> row(qkv.begin() + static_cast<int64_t>(i) * width, qkv.begin() + static_cast<int64_t>(i + 1) * width);
    if (with_bias)
      for (int c = 0; c < width; ++c) row[c] += bias[c];
    rope.apply(std::span<float>(row.data(), static_cast<size_t>(hq + hkv) * d), hq + hkv, positions[i]);
    const int64_t s = slots[i];
    used[s] = true;
    for (int e = 0; e < hq * d; ++e) cmp(q[static_cast<int64_t>(i) * hq * d + e], row[e], "q", i, e);
    for (int e = 0; e < hkv * d; ++e) cmp(k[s * hkv * d + e], row[hq * d + e], "k", i, e);
    for (int e = 0; e < hkv * d; ++e) ASSERT_EQ(v[s * hkv * d + e], float_to_bf16(row[(hq + hkv) * d + e])) << "v " << i;
    if (::testing::Test::HasFatalFailure()) return;
  }
  EXPECT_LE(off_by_one, compared / 1000) << off_by_one << " of " << compared << " elements off by one bf16 ulp";
  for (int s = 0; s < num_slots; ++s) {  // slots not appended stay untouched
    if (used[s]) continue;
    for (int e = 0; e < hkv * d; ++e) {
      ASSERT_EQ(k[static_cast<int64_t>(s) * hkv * d + e], 0xffff) << "k slot " << s << " written";
      ASSERT_EQ(v[static_cast<int64_t>(s) * hkv * d + e], 0xffff) << "v slot " << s << " written";
    }
  }
}

TEST(CudaEngineOps, RopeQkvAppendSmall) {
  SKIP_WITHOUT_GPU();
  check_rope(3, 2, 1, 64, true, 7);
}

TEST(CudaEngineOps, RopeQkvAppend) {
  SKIP_WITHOUT_GPU();
  check_rope(100, 32, 8, 128, false, 8);
  check_rope(37, 28, 4, 128, true, 9);  // qwen2-like: bias
  check_rope(20, 8, 8, 64, true, 10);
  check_rope(9, 8, 2, 256, false, 11);
}

void check_silu_mul(int n, int64_t inter, uint32_t seed) {
  SCOPED_TRACE("n " + std::to_string(n) + " I " + std::to_string(inter));
  std::mt19937 rng(seed);
  const std::vector<uint16_t> gu = to_bf16(random_floats(static_cast<size_t>(n * 2 * inter), -8, 8, rng));
  DevBuf<uint16_t> d_gu(gu), d_out(static_cast<size_t>(n * inter));
  d_out.poison();
  ops::silu_mul(d_gu.get(), n, inter, d_out.get(), nullptr);
  sync();
  std::vector<float> gate(static_cast<size_t>(n * inter)), up(gate.size());
  for (int i = 0; i < n; ++i)
    for (int64_t c = 0; c < inter; ++c) {
      gate[i * inter + c] = bf16_to_float(gu[i * 2 * inter + c]);
      up[i * inter + c] = bf16_to_float(gu[i * 2 * inter + inter + c]);
    }
  silu_mul(gate, up);
  const std::vector<double> ref(gate.begin(), gate.end());
  size_t worst = 0;
  const std::vector<float> got = from_bf16(d_out.download());
  EXPECT_LE(tol_ratio(got, ref, 1e-6, 1e-2, &worst), 1.0) << "at " << worst << ": " << got[worst] << " vs " << ref[worst];
}

TEST(CudaEngineOps, SiluMulSmall) {
  SKIP_WITHOUT_GPU();
  check_silu_mul(3, 16, 12);
  check_silu_mul(2, 7, 13);
}

TEST(CudaEngineOps, SiluMul) {
  SKIP_WITHOUT_GPU();
  check_silu_mul(64, 11008, 14);
  check_silu_mul(5, 14336, 15);
  check_silu_mul(7, 1001, 16);
}

void check_add_bias(int n, int64_t dim, uint32_t seed) {
  SCOPED_TRACE("n " + std::to_string(n) + " dim " + std::to_string(dim));
  std::mt19937 rng(seed);
  const std::vector<float> x = random_floats(static_cast<size_t>(n * dim), -4, 4, rng);
  const std::vector<float> bias = random_floats(static_cast<size_t>(dim), -1, 1, rng);
  DevBuf<float> d_x(x), d_bias(bias);
  ops::add_bias(d_x.get(), d_bias.get(), n, dim, nullptr);
  sync();
  const std::vector<float> got = d_x.download();
  for (int i = 0; i < n; ++i)
    for (int64_t c = 0; c < dim; ++c) ASSERT_EQ(got[i * dim + c], x[i * dim + c] + bias[c]) << i << "," << c;
}

TEST(CudaEngineOps, AddBiasSmall) {
  SKIP_WITHOUT_GPU();
  check_add_bias(3, 12, 17);
  check_add_bias(3, 13, 18);
}

TEST(CudaEngineOps, AddBias) {
  SKIP_WITHOUT_GPU();
  check_add_bias(100, 3584 + 2 * 512, 19);
  check_add_bias(9, 999, 20);
}

void check_f32_to_bf16(int64_t count, bool misalign, uint32_t seed) {
  SCOPED_TRACE("count " + std::to_string(count) + " misaligned " + std::to_string(misalign));
  std::mt19937 rng(seed);
  std::vector<float> x = random_floats(static_cast<size_t>(count), -1000, 1000, rng);
  // Specials: exact ties (round to even both ways), inf, -inf, NaN, denormal, huge.
  const float specials[] = {std::bit_cast<float>(0x3f808000u), std::bit_cast<float>(0x3f818000u), INFINITY, -INFINITY,
                            NAN, 1e-40f, -3.0e38f, std::bit_cast<float>(0x7f7fffffu)};
  for (size_t s = 0; s < std::size(specials) && s < x.size(); ++s) x[s * 3 % x.size()] = specials[s];
  const int off = misalign ? 1 : 0;
  std::vector<float> padded(x.size() + off, 1.0f);
  std::copy(x.begin(), x.end(), padded.begin() + off);
  DevBuf<float> d_x(padded);
  DevBuf<uint16_t> d_out(static_cast<size_t>(count) + off);
  d_out.poison();
  ops::f32_to_bf16(d_x.get() + off, count, d_out.get() + off, nullptr);
  sync();
  const std::vector<uint16_t> got = d_out.download();
  for (int64_t i = 0; i < count; ++i) {
    if (std::isnan(x[i])) {
      ASSERT_TRUE(std::isnan(bf16_to_float(got[i + off]))) << i;
    } else {
      ASSERT_EQ(got[i + off], float_to_bf16(x[i])) << "at " << i << " x = " << x[i];
    }
  }
}

TEST(CudaEngineOps, F32ToBf16Small) {
  SKIP_WITHOUT_GPU();
  check_f32_to_bf16(12, false, 21);
  check_f32_to_bf16(11, true, 22);
}

TEST(CudaEngineOps, F32ToBf16) {
  SKIP_WITHOUT_GPU();
  check_f32_to_bf16(1 << 20, false, 23);
  check_f32_to_bf16(100003, true, 24);
}

// Reference argmax: lowest index among the maximal non-NaN values; 0 when all are NaN.
int32_t ref_argmax(const float* x, int64_t vocab) {
  int32_t best = -1;
  for (int64_t j = 0; j < vocab; ++j) {
    if (std::isnan(x[j])) continue;
    if (best < 0 || x[j] > x[best]) best = static_cast<int32_t>(j);
  }
  return best < 0 ? 0 : best;
}

void check_argmax(int64_t vocab, uint32_t seed) {
  SCOPED_TRACE("vocab " + std::to_string(vocab));
  std::mt19937 rng(seed);
  const int n = 12;
  std::vector<float> logits = random_floats(static_cast<size_t>(n * vocab), -20, 20, rng);
  std::uniform_int_distribution<int64_t> col(0, vocab - 1);
  auto row = [&](int r) { return logits.data() + r * vocab; };
  // Row 1: a tie of the maximum at two random places. Row 2: ties at the last and first column.
  { const int64_t a = col(rng), b = col(rng); row(1)[a] = 100.f; row(1)[b] = 100.f; }
  row(2)[vocab - 1] = 50.f;
  row(2)[0] = 50.f;
  // Row 3: NaN at the front and NaNs in many places, the max elsewhere.
  row(3)[0] = NAN;
  for (int k = 0; k < 50; ++k) row(3)[col(rng)] = NAN;
  row(3)[col(rng)] = 99.f;
  // Row 4: all NaN -> 0. Row 5: all -inf -> 0. Row 6: NaN except one -inf.
  for (int64_t j = 0; j < vocab; ++j) row(4)[j] = NAN;
  for (int64_t j = 0; j < vocab; ++j) row(5)[j] = -INFINITY;
  for (int64_t j = 0; j < vocab; ++j) row(6)[j] = NAN;
  row(6)[col(rng)] = -INFINITY;
  // Row 7: +inf and NaN. Row 8: equal values everywhere -> 0. Row 9: max at the last column.
  row(7)[col(rng)] = INFINITY;
  row(7)[col(rng)] = NAN;
  for (int64_t j = 0; j < vocab; ++j) row(8)[j] = 1.5f;
  row(9)[vocab - 1] = 1000.f;
  DevBuf<float> d_logits(logits);
  DevBuf<int32_t> d_out(n);
  d_out.poison();
  ops::argmax_rows(d_logits.get(), n, vocab, d_out.get(), nullptr);
  sync();
  const std::vector<int32_t> got = d_out.download();
  for (int r = 0; r < n; ++r) EXPECT_EQ(got[r], ref_argmax(row(r), vocab)) << "row " << r;
}

TEST(CudaEngineOps, ArgmaxRowsSmall) {
  SKIP_WITHOUT_GPU();
  check_argmax(1, 25);
  check_argmax(37, 26);
}

TEST(CudaEngineOps, ArgmaxRows) {
  SKIP_WITHOUT_GPU();
  check_argmax(32000, 27);
  check_argmax(151936, 28);
  check_argmax(128256 + 3, 29);
}

TEST(CudaEngineOps, FillUniformBf16) {
  SKIP_WITHOUT_GPU();
  const int64_t count = 1 << 20;
  const float lo = -0.05f, hi = 0.0625f;
  DevBuf<uint16_t> a(count), b(1000), c(count);
  a.poison();
  b.poison();
  c.poison();
  ops::fill_uniform_bf16(a.get(), count, lo, hi, 42, nullptr);
  ops::fill_uniform_bf16(b.get(), 1000, lo, hi, 42, nullptr);
  ops::fill_uniform_bf16(c.get(), count, lo, hi, 43, nullptr);
  sync();
  const std::vector<float> x = from_bf16(a.download()), y = from_bf16(b.download()), z = from_bf16(c.download());
  double sum = 0, sum2 = 0;
  int64_t same = 0;
  for (int64_t i = 0; i < count; ++i) {
    ASSERT_TRUE(x[i] >= lo && x[i] < hi) << "value " << i << " = " << x[i];
    sum += x[i];
    sum2 += double(x[i]) * x[i];
    same += x[i] == z[i];
  }
  for (int i = 0; i < 1000; ++i) ASSERT_EQ(x[i], y[i]) << "value " << i << " depends on count";
  const double mean = sum / count, var = sum2 / count - mean * mean;
  const double want_mean = (lo + hi) / 2, want_var = (hi - lo) * (hi - lo) / 12;
  EXPECT_NEAR(mean, want_mean, 0.01 * (hi - lo));
  EXPECT_NEAR(var, want_var, 0.03 * want_var);
  EXPECT_LT(same, count / 20) << "seeds 42 and 43 give nearly the same values";
  // bf16 has 2^7 values per binade: many distinct values, not a handful.
  std::vector<float> sorted(x.begin(), x.begin() + 100000);
  std::sort(sorted.begin(), sorted.end());
  EXPECT_GT(std::unique(sorted.begin(), sorted.end()) - sorted.begin(), 200);
}

TEST(CudaEngineOps, FillUniformBf16Small) {
  SKIP_WITHOUT_GPU();
  DevBuf<uint16_t> a(7);
  a.poison();
  ops::fill_uniform_bf16(a.get(), 7, 1.0f, 1.0078125f, 5, nullptr);  // [1, 1 + 2^-7): one bf16 value, 1
  sync();
  for (float v : from_bf16(a.download())) EXPECT_EQ(v, 1.0f);
}

// ---- prefill attention ---------------------------------------------------------------------------------

struct PrefillCase {
  int n, ctx, hq, hkv, d;
};

struct PrefillData {
  PrefillCase c;
  int64_t num_keys, num_slots;
  std::vector<uint16_t> q, k, v;  // q [n, Hq, d]; k, v [num_slots, Hkv, d] (unused slots NaN)
  std::vector<int32_t> key_slots;
  float sm_scale;

  PrefillData(const PrefillCase& pc, uint32_t seed) : c(pc) {
    std::mt19937 rng(seed);
    num_keys = c.ctx + c.n;
    num_slots = num_keys + 29;
    q = to_bf16(random_floats(static_cast<size_t>(c.n) * c.hq * c.d, -2, 2, rng));
    k = to_bf16(random_floats(static_cast<size_t>(num_slots) * c.hkv * c.d, -2, 2, rng));
    v = to_bf16(random_floats(static_cast<size_t>(num_slots) * c.hkv * c.d, -2, 2, rng));
    std::vector<int32_t> perm(num_slots);
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng);
    key_slots.assign(perm.begin(), perm.begin() + num_keys);
    // Slots no key uses hold NaN: gathering a wrong slot poisons the output.
    for (int64_t s = num_keys; s < num_slots; ++s) {
      const int64_t slot = perm[s];
      std::fill(k.begin() + slot * c.hkv * c.d, k.begin() + (slot + 1) * c.hkv * c.d, uint16_t{0xffff});
      std::fill(v.begin() + slot * c.hkv * c.d, v.begin() + (slot + 1) * c.hkv * c.d, uint16_t{0xffff});
    }
    sm_scale = 1.0f / std::sqrt(static_cast<float>(c.d));
  }

  // fp64 causal attention of query i, head h -> d values.
  std::vector<double> reference(int i, int h) const {
    const int d = c.d, kvh = h / (c.hq / c.hkv);
    const int64_t keys = c.ctx + i + 1;
    std::vector<double> s(keys), o(d, 0.0);
    double mx = -INFINITY;
    for (int64_t j = 0; j < keys; ++j) {
      const int64_t base = (static_cast<int64_t>(key_slots[j]) * c.hkv + kvh) * d;
      double dot = 0;
      for (int e = 0; e < d; ++e)
        dot += double(bf16_to_float(q[(static_cast<int64_t>(i) * c.hq + h) * d + e])) * bf16_to_float(k[base + e]);
      s[j] = dot * sm_scale;
      mx = std::max(mx, s[j]);
    }
    double l = 0;
    for (int64_t j = 0; j < keys; ++j) {
      const double p = std::exp(s[j] - mx);
      l += p;
      const int64_t base = (static_cast<int64_t>(key_slots[j]) * c.hkv + kvh) * d;
      for (int e = 0; e < d; ++e) o[e] += p * bf16_to_float(v[base + e]);
    }
    for (double& x : o) x /= l;
    return o;
  }
};

std::string case_name(const PrefillCase& c) {
  return "n " + std::to_string(c.n) + " ctx " + std::to_string(c.ctx) + " Hq " + std::to_string(c.hq) + " Hkv " +
         std::to_string(c.hkv) + " d " + std::to_string(c.d);
}

// Runs the tensor-core kernel (simple = false) or the simple one; returns out [n, Hq, d] as floats.
std::vector<float> run_prefill(const PrefillData& pd, bool simple, double* ms = nullptr) {
  const PrefillCase& c = pd.c;
  DevBuf<uint16_t> d_q(pd.q), d_k(pd.k), d_v(pd.v), d_out(static_cast<size_t>(c.n) * c.hq * c.d);
  DevBuf<int32_t> d_slots(pd.key_slots);
  d_out.poison();
  auto call = [&] {
    if (simple) {
      ops::prefill_attention_simple(d_q.get(), d_k.get(), d_v.get(), d_slots.get(), pd.num_keys, c.n, c.hq, c.hkv,
                                    c.d, pd.sm_scale, d_out.get(), nullptr);
    } else {
      ops::prefill_attention(d_q.get(), d_k.get(), d_v.get(), d_slots.get(), pd.num_keys, c.n, c.hq, c.hkv, c.d,
                             pd.sm_scale, d_out.get(), nullptr);
    }
  };
  call();
  sync();
  std::vector<float> out = from_bf16(d_out.download());
  if (ms != nullptr) {  // median of 5 timed runs after the checked one
    std::vector<double> times;
    for (int r = 0; r < 5; ++r) {
      cudaEvent_t e0, e1;
      FT_CUDA_CHECK(cudaEventCreate(&e0));
      FT_CUDA_CHECK(cudaEventCreate(&e1));
      FT_CUDA_CHECK(cudaEventRecord(e0));
      call();
      FT_CUDA_CHECK(cudaEventRecord(e1));
      FT_CUDA_CHECK(cudaEventSynchronize(e1));
      float t = 0;
      FT_CUDA_CHECK(cudaEventElapsedTime(&t, e0, e1));
      times.push_back(t);
      cudaEventDestroy(e0);
      cudaEventDestroy(e1);
    }
    std::sort(times.begin(), times.end());
    *ms = times[times.size() / 2];
    sync();
  }
  return out;
}

// Compares rows `queries` (all heads) of out with the fp64 reference.
void expect_close_to_reference(const PrefillData& pd, const std::vector<float>& out, const std::vector<int>& queries,
                               const char* kernel) {
  const PrefillCase& c = pd.c;
  double worst = 0;
  std::string where;
  for (int i : queries) {
    for (int h = 0; h < c.hq; ++h) {
      const std::vector<double> ref = pd.reference(i, h);
      for (int e = 0; e < c.d; ++e) {
        const float g = out[(static_cast<int64_t>(i) * c.hq + h) * c.d + e];
        const double r = std::isnan(g) ? INFINITY : std::abs(g - ref[e]) / (2e-2 + 1e-2 * std::abs(ref[e]));
        if (r > worst) {
          worst = r;
          where = "query " + std::to_string(i) + " head " + std::to_string(h) + " elem " + std::to_string(e) +
                  ": got " + std::to_string(g) + " want " + std::to_string(ref[e]);
        }
      }
    }
  }
  EXPECT_LE(worst, 1.0) << kernel << " " << case_name(c) << ": worst " << where;
}

void check_prefill(const PrefillCase& c, uint32_t seed) {
  const PrefillData pd(c, seed);
  std::vector<int> all(c.n);
  std::iota(all.begin(), all.end(), 0);
  expect_close_to_reference(pd, run_prefill(pd, false), all, "tensor-core");
  expect_close_to_reference(pd, run_prefill(pd, true), all, "simple");
}

TEST(CudaEngineOps, PrefillAttentionSmall) {
  SKIP_WITHOUT_GPU();
  check_prefill({5, 3, 2, 1, 64}, 30);
  check_prefill({70, 10, 2, 2, 128}, 31);
  check_prefill({3, 40, 4, 2, 256}, 32);
}

TEST(CudaEngineOps, PrefillAttention) {
  SKIP_WITHOUT_GPU();
  uint32_t seed = 100;
  // (n, ctx): one token, exact tile multiples, one past, long context, n > ctx, ragged everything.
  const std::pair<int, int> lens[] = {{1, 0},   {1, 1},    {1, 37},   {2, 0},    {16, 0},  {17, 5},
                                      {64, 0},  {64, 64},  {65, 0},   {63, 129}, {128, 1}, {130, 300},
                                      {200, 64}, {300, 0}, {257, 500}, {31, 480}};
  const int heads[][2] = {{4, 4}, {8, 2}, {4, 1}};  // GQA 1, 4, 4 (one kv head)
  for (int d : {64, 128, 256}) {
    for (const auto& hh : heads) {
      for (const auto& [n, ctx] : lens) {
        if (d == 256 && n * (n + ctx) > 40000) continue;  // keep the fp64 reference quick
        check_prefill({n, ctx, hh[0], hh[1], d}, seed++);
        if (HasFailure()) return;
      }
    }
  }
}

// Model shapes at prompt length: llama2-7b (32 / 32 heads, d 128) and mistral-7b (32 / 8), a
// 3193-token prompt (no cache) and 700 tokens after a 2500-token cached context. The tensor-core
// kernel is compared with the simple kernel on every element and with the fp64 reference on a
// sample of query rows; both kernels' times are printed.
TEST(CudaEngineOps, PrefillAttentionModelShapes) {
  SKIP_WITHOUT_GPU();
  const PrefillCase cases[] = {{3193, 0, 32, 32, 128}, {3193, 0, 32, 8, 128}, {700, 2500, 32, 8, 128}};
  uint32_t seed = 500;
  for (const PrefillCase& c : cases) {
    const PrefillData pd(c, seed++);
    double ms_tc = 0, ms_simple = 0;
    const std::vector<float> tc = run_prefill(pd, false, &ms_tc);
    const std::vector<float> simple = run_prefill(pd, true, &ms_simple);
    const double flops = 4.0 * c.hq * c.d * (double(c.n) * c.ctx + double(c.n) * (c.n + 1) / 2);
    std::printf("[ prefill ] %s: tensor-core %.3f ms (%.0f TFLOP/s), simple %.3f ms\n", case_name(c).c_str(), ms_tc,
                flops / (ms_tc * 1e-3) / 1e12, ms_simple);
    double worst = 0;
    for (size_t i = 0; i < tc.size(); ++i) {
      const double r = std::isnan(tc[i]) || std::isnan(simple[i])
                           ? INFINITY
                           : std::abs(double(tc[i]) - simple[i]) / (2e-2 + 1e-2 * std::abs(double(simple[i])));
      worst = std::max(worst, r);
    }
    EXPECT_LE(worst, 1.0) << case_name(c) << ": tensor-core vs simple kernel";
    std::vector<int> sample;
    for (int i : {0, 1, 63, 64, 1000, c.n / 2, c.n - 2, c.n - 1})
      if (i < c.n) sample.push_back(i);
    expect_close_to_reference(pd, tc, sample, "tensor-core");
  }
}

// ---- batched (varlen) prefill attention and the row gather -----------------------------------------

TEST(CudaEngineOps, HostChecksVarlenPrefill) {
  const uint16_t* cb = reinterpret_cast<const uint16_t*>(16);  // never dereferenced: the checks throw first
  uint16_t* b = reinterpret_cast<uint16_t*>(16);
  const int32_t* ci = reinterpret_cast<const int32_t*>(16);
  // Two sequences: 70 rows over 100 keys, 3 rows over 3 keys.
  const std::vector<int32_t> rows = {0, 70, 73}, keys = {0, 100, 103};
  const std::vector<int32_t> blocks = ops::prefill_varlen_blocks(rows, keys);
  EXPECT_EQ(blocks, (std::vector<int32_t>{0, 64, 0, 0, 1, 0}));  // heaviest (most keys) first
  auto call = [&](const std::vector<int32_t>& r, const std::vector<int32_t>& k, const std::vector<int32_t>& bl,
                  int hd = 128) {
    ops::PrefillVarlen v{r.data(), k.data(), bl.data(), static_cast<int>(r.size()) - 1,
                         static_cast<int>(bl.size() / 2), ci, ci, ci};
    ops::prefill_attention_varlen(cb, cb, cb, ci, v, 4, 4, hd, 0.1f, b, nullptr);
  };
  EXPECT_ERROR_WITH(call({0, 70, 73}, {0, 60, 63}, blocks), "60 keys for 70 rows");
  EXPECT_ERROR_WITH(call({0, 70, 69}, {0, 100, 103}, blocks), "decrease");
  EXPECT_ERROR_WITH(call({1, 70, 73}, {0, 100, 103}, blocks), "must be 0");
  EXPECT_ERROR_WITH(call(rows, keys, {0, 0, 1, 0}), "cover 64 rows of sequence 0");
  EXPECT_ERROR_WITH(call(rows, keys, {0, 0, 0, 32, 1, 0}), "not a block");
  EXPECT_ERROR_WITH(call(rows, keys, {0, 0, 0, 64, 2, 0}), "names sequence 2");
  EXPECT_ERROR_WITH(call(rows, keys, blocks, 96), "head_dim");
  EXPECT_ERROR_WITH(ops::prefill_varlen_blocks(rows, std::vector<int32_t>{0, 1}), "S + 1");
  EXPECT_ERROR_WITH(ops::gather_rows_bf16(cb, ci, 2, 0, b, nullptr), "dim");
  EXPECT_ERROR_WITH(ops::gather_rows_bf16(nullptr, ci, 2, 8, b, nullptr), "null");
  EXPECT_NO_THROW(ops::gather_rows_bf16(nullptr, nullptr, 0, 0, nullptr, nullptr));
}

// Sequences packed row-wise: every sequence's rows equal, bit for bit, what the single-sequence call
// computes for it alone (tensor-core and simple kernels each), and the tensor-core rows are within
// the prefill tolerance of the simple ones. Rows of the packed output are poisoned first. Lengths
// cover empty, 1-row, block-crossing and long sequences with contexts of 0..300 keys; the last
// sequence's context contains the first one's new slots (a prefix computed in the same batch).
TEST(CudaEngineOps, PrefillAttentionVarlenEqualsPerSequence) {
  SKIP_WITHOUT_GPU();
  struct Seq {
    int n, ctx;
  };
  const Seq seqs[] = {{70, 0}, {0, 5}, {1, 0}, {64, 64}, {130, 300}, {3, 17}, {65, 70}};
  for (const int d : {64, 128, 256}) {
    for (const auto [hq, hkv] : {std::pair{4, 4}, std::pair{8, 2}}) {
      std::mt19937 rng(900 + d + hq);
      const int ns = static_cast<int>(std::size(seqs));
      int64_t total_rows = 0, total_ctx = 0;
      for (const Seq& q : seqs) total_rows += q.n, total_ctx += q.ctx;
      const int64_t num_slots = total_rows + total_ctx + 11;
      std::vector<int32_t> perm(static_cast<size_t>(num_slots));
      std::iota(perm.begin(), perm.end(), 0);
      std::shuffle(perm.begin(), perm.end(), rng);
      const std::vector<uint16_t> k = to_bf16(random_floats(static_cast<size_t>(num_slots * hkv * d), -2, 2, rng));
      const std::vector<uint16_t> v = to_bf16(random_floats(static_cast<size_t>(num_slots * hkv * d), -2, 2, rng));
      const std::vector<uint16_t> q = to_bf16(random_floats(static_cast<size_t>(total_rows * hq * d), -2, 2, rng));
      // New slots: perm[0 .. total_rows); contexts: distinct slots from the rest, the last sequence's
      // context starts with the first sequence's new slots.
      std::vector<int32_t> seq_rows = {0}, seq_keys = {0}, key_slots;
      std::vector<std::vector<int32_t>> own_keys;
      size_t next_ctx = static_cast<size_t>(total_rows);
      for (int s = 0; s < ns; ++s) {
        std::vector<int32_t> ks;
        for (int j = 0; j < seqs[s].ctx; ++j) {
          if (s == ns - 1 && j < seqs[0].n) ks.push_back(perm[static_cast<size_t>(j)]);
          else ks.push_back(perm[next_ctx++]);
        }
        for (int j = 0; j < seqs[s].n; ++j) ks.push_back(perm[static_cast<size_t>(seq_rows.back() + j)]);
        key_slots.insert(key_slots.end(), ks.begin(), ks.end());
        own_keys.push_back(ks);
        seq_rows.push_back(seq_rows.back() + seqs[s].n);
        seq_keys.push_back(static_cast<int32_t>(key_slots.size()));
      }
      const std::vector<int32_t> blocks = ops::prefill_varlen_blocks(seq_rows, seq_keys);
      DevBuf<uint16_t> d_q(q), d_k(k), d_v(v), d_out(q.size());
      DevBuf<int32_t> d_keys(key_slots), d_rows(seq_rows), d_seq_keys(seq_keys), d_blocks(blocks);
      const ops::PrefillVarlen pv{seq_rows.data(), seq_keys.data(), blocks.data(), ns, static_cast<int>(blocks.size() / 2),
                                  d_rows.get(), d_seq_keys.get(), d_blocks.get()};
      const float scale = 1.0f / std::sqrt(static_cast<float>(d));
      std::vector<float> packed[2];
      for (int simple = 0; simple < 2; ++simple) {
        d_out.poison();
        ops::prefill_attention_varlen(d_q.get(), d_k.get(), d_v.get(), d_keys.get(), pv, hq, hkv, d, scale, d_out.get(),
                                      nullptr, simple != 0);
        sync();
        packed[simple] = from_bf16(d_out.download());
        for (int s = 0; s < ns; ++s) {
          const int n = seqs[s].n;
          if (n == 0) continue;
          const size_t row_elems = static_cast<size_t>(hq) * d;
          const std::vector<uint16_t> qs(q.begin() + seq_rows[s] * row_elems, q.begin() + seq_rows[s + 1] * row_elems);
          DevBuf<uint16_t> d_qs(qs), d_os(qs.size());
          DevBuf<int32_t> d_ks(own_keys[static_cast<size_t>(s)]);
          d_os.poison();
          const int64_t nk = static_cast<int64_t>(own_keys[static_cast<size_t>(s)].size());
          if (simple != 0)
            ops::prefill_attention_simple(d_qs.get(), d_k.get(), d_v.get(), d_ks.get(), nk, n, hq, hkv, d, scale, d_os.get(), nullptr);
          else
            ops::prefill_attention(d_qs.get(), d_k.get(), d_v.get(), d_ks.get(), nk, n, hq, hkv, d, scale, d_os.get(), nullptr);
          sync();
          const std::vector<float> alone = from_bf16(d_os.download());
          size_t bad = 0;
          for (size_t e = 0; e < alone.size(); ++e)
            bad += std::bit_cast<uint32_t>(alone[e]) != std::bit_cast<uint32_t>(packed[simple][seq_rows[s] * row_elems + e]);
          EXPECT_EQ(bad, 0u) << (simple ? "simple" : "tensor-core") << " d " << d << " heads " << hq << "/" << hkv
                             << " sequence " << s << ": elements differing from the sequence alone";
        }
      }
      double worst = 0;
      for (size_t e = 0; e < packed[0].size(); ++e)
        worst = std::max(worst, std::isnan(packed[0][e]) ? INFINITY
                                                         : std::abs(double(packed[0][e]) - packed[1][e]) /
                                                               (2e-2 + 1e-2 * std::abs(double(packed[1][e]))));
      EXPECT_LE(worst, 1.0) << "d " << d << ": tensor-core vs simple varlen";
      if (HasFailure()) return;
    }
  }
}

TEST(CudaEngineOps, GatherRowsBf16) {
  SKIP_WITHOUT_GPU();
  std::mt19937 rng(77);
  for (const int64_t dim : {int64_t{4096}, int64_t{100}}) {  // vector and scalar paths
    const std::vector<uint16_t> x = to_bf16(random_floats(static_cast<size_t>(50 * dim), -1, 1, rng));
    const std::vector<int32_t> rows = {49, 0, 7, 7, 23};
    DevBuf<uint16_t> d_x(x), d_out(rows.size() * static_cast<size_t>(dim));
    DevBuf<int32_t> d_rows(rows);
    d_out.poison();
    ops::gather_rows_bf16(d_x.get(), d_rows.get(), static_cast<int>(rows.size()), dim, d_out.get(), nullptr);
    sync();
    const std::vector<uint16_t> out = d_out.download();
    for (size_t i = 0; i < rows.size(); ++i)
      EXPECT_TRUE(std::equal(out.begin() + static_cast<int64_t>(i) * dim, out.begin() + static_cast<int64_t>(i + 1) * dim,
                             x.begin() + int64_t{rows[i]} * dim))
          << "row " << i << " dim " << dim;
  }
}

}  // namespace
}  // namespace fasttree

#endif  // FASTTREE_HAVE_CUDA
