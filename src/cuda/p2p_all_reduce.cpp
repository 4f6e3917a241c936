#include "cuda/p2p_all_reduce.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>

#include "core/error.h"
#include "cuda/cuda_check.h"
#include "cuda/p2p_all_reduce_kernel.cuh"

namespace fasttree {

namespace {
std::string str(int64_t v) { return std::to_string(v); }
}  // namespace

// Group-wide state: the abort flag every rank's kernels poll (mapped, portable host memory).
struct P2pAllReduce::Shared {
  int* abort_host = nullptr;
  std::atomic<bool> aborted{false};
  ~Shared() {
    if (abort_host != nullptr) cudaFreeHost(abort_host);
  }
};

struct P2pAllReduce::Impl {
  std::shared_ptr<Shared> shared;
  int rank = 0, nranks = 0, device = -1;
  size_t bytes = 0;
  float* buf = nullptr;
  uint32_t* flags = nullptr;
  uint32_t* epoch = nullptr;
  int* error_host = nullptr;  // mapped host memory: set by a kernel that gave up
  int64_t timeout_ms = 0;
  P2pAllReduceParams params{};

  ~Impl() {
    if (device >= 0) cudaSetDevice(device);
    if (buf != nullptr) cudaFree(buf);
    if (flags != nullptr) cudaFree(flags);
    if (epoch != nullptr) cudaFree(epoch);
    if (error_host != nullptr) cudaFreeHost(error_host);
  }
  std::string who() const { return "P2P all-reduce rank " + str(rank) + " of " + str(nranks) + " (device " + str(device) + ")"; }
};

P2pAllReduce::P2pAllReduce(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
P2pAllReduce::~P2pAllReduce() = default;

std::vector<std::unique_ptr<P2pAllReduce>> P2pAllReduce::create_group(std::span<const int> devices, size_t max_bytes,
                                                                      std::chrono::milliseconds timeout,
                                                                      std::string* why) {
  const int n = static_cast<int>(devices.size());
  FT_CHECK(n >= 1, "P2pAllReduce::create_group: no devices");
  FT_CHECK(max_bytes > 0, "P2pAllReduce::create_group: zero bytes");
  FT_CHECK(timeout.count() > 0, "P2pAllReduce::create_group: the timeout must be positive");
  std::string reason;
  if (n > kP2pMaxRanks) reason = str(n) + " ranks (at most " + str(kP2pMaxRanks) + ")";
  for (int i = 0; i < n && reason.empty(); ++i)
    for (int j = 0; j < n && reason.empty(); ++j) {
      if (i == j) continue;
      int can = 0;
      FT_CUDA_CHECK(cudaDeviceCanAccessPeer(&can, devices[i], devices[j]));
      if (!can) reason = "device " + str(devices[i]) + " cannot access device " + str(devices[j]) + "'s memory (no peer access)";
    }
  if (!reason.empty()) {
    if (why != nullptr) *why = reason;
    return {};
  }
  int current = 0;
  FT_CUDA_CHECK(cudaGetDevice(&current));
  const size_t count = std::min(kP2pMaxCount, (max_bytes + 15) / 16 * 4);
  auto shared = std::make_shared<Shared>();
  FT_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&shared->abort_host), sizeof(int), cudaHostAllocMapped | cudaHostAllocPortable));
  *shared->abort_host = 0;
  std::vector<std::unique_ptr<Impl>> impls;
  try {
    for (int i = 0; i < n; ++i) {
      auto m = std::make_unique<Impl>();
      m->shared = shared;
      m->rank = i;
      m->nranks = n;
      m->device = devices[i];
      m->timeout_ms = timeout.count();
      FT_CUDA_CHECK(cudaSetDevice(m->device));
      for (int j = 0; j < n; ++j) {
        if (j == i) continue;
        const cudaError_t e = cudaDeviceEnablePeerAccess(devices[j], 0);
        if (e == cudaErrorPeerAccessAlreadyEnabled) {
          (void)cudaGetLastError();
        } else {
          FT_CUDA_CHECK(e);
        }
      }
      m->bytes = count * 4;
      const size_t flag_bytes = size_t{2} * kP2pMaxBlocks * kP2pMaxRanks * 4;
      FT_CUDA_CHECK(cudaMalloc(&m->buf, m->bytes));
      FT_CUDA_CHECK(cudaMalloc(&m->flags, flag_bytes));
      FT_CUDA_CHECK(cudaMalloc(&m->epoch, kP2pMaxBlocks * 4));
      FT_CUDA_CHECK(cudaMemset(m->buf, 0, m->bytes));
      FT_CUDA_CHECK(cudaMemset(m->flags, 0, flag_bytes));
      FT_CUDA_CHECK(cudaMemset(m->epoch, 0, kP2pMaxBlocks * 4));
      FT_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&m->error_host), sizeof(int), cudaHostAllocMapped | cudaHostAllocPortable));
      *m->error_host = 0;
      impls.push_back(std::move(m));
    }
    for (int i = 0; i < n; ++i) {
      FT_CUDA_CHECK(cudaSetDevice(devices[i]));
      FT_CUDA_CHECK(cudaDeviceSynchronize());  // the memsets are done before a peer's first read
      P2pAllReduceParams& p = impls[static_cast<size_t>(i)]->params;
      p.data = impls[static_cast<size_t>(i)]->buf;
      for (int j = 0; j < n; ++j) {
        p.bufs[j] = impls[static_cast<size_t>(j)]->buf;
        p.flags[j] = impls[static_cast<size_t>(j)]->flags;
      }
      p.epoch = impls[static_cast<size_t>(i)]->epoch;
      void* dev = nullptr;
      FT_CUDA_CHECK(cudaHostGetDevicePointer(&dev, shared->abort_host, 0));
      p.abort_flag = static_cast<const volatile int*>(dev);
      FT_CUDA_CHECK(cudaHostGetDevicePointer(&dev, impls[static_cast<size_t>(i)]->error_host, 0));
      p.error_flag = static_cast<volatile int*>(dev);
      p.rank = i;
      p.nranks = n;
      p.timeout_ns = static_cast<uint64_t>(timeout.count()) * 1000000ull;
    }
  } catch (...) {
    impls.clear();
    cudaSetDevice(current);
    throw;
  }
  FT_CUDA_CHECK(cudaSetDevice(current));
  std::vector<std::unique_ptr<P2pAllReduce>> group;
  for (auto& m : impls) group.push_back(std::unique_ptr<P2pAllReduce>(new P2pAllReduce(std::move(m))));
  return group;
}

int P2pAllReduce::rank() const { return impl_->rank; }
float* P2pAllReduce::buffer() const { return impl_->buf; }
size_t P2pAllReduce::buffer_bytes() const { return impl_->bytes; }
size_t P2pAllReduce::max_count() const { return impl_->bytes / 4; }
bool P2pAllReduce::accepts(const float* data, size_t count) const {
  return data == impl_->buf && count > 0 && count % 4 == 0 && count <= max_count();
}
bool P2pAllReduce::aborted() const { return impl_->shared->aborted.load(); }

void P2pAllReduce::all_reduce_sum_fp32(float* data, size_t count, CUstream_st* stream) {
  Impl& m = *impl_;
  FT_CHECK(!aborted(), m.who() + ": all-reduce after the group was aborted");
  FT_CHECK(accepts(data, count), m.who() + ": cannot sum " + str(static_cast<int64_t>(count)) +
                                     " floats at that address (the rank's buffer, a multiple of 4, at most " +
                                     str(static_cast<int64_t>(max_count())) + ")");
  const int64_t count4 = static_cast<int64_t>(count / 4);
  int vec = 1;
  while (vec < kP2pMaxVecPerThread && count4 > int64_t{kP2pMaxBlocks} * kP2pThreads * vec) ++vec;
  const int blocks = static_cast<int>((count4 + int64_t{kP2pThreads} * vec - 1) / (int64_t{kP2pThreads} * vec));
  P2pAllReduceParams p = m.params;
  p.count4 = count4;
  p.vec_per_thread = vec;
  launch_p2p_all_reduce(p, blocks, stream);
  FT_CUDA_CHECK(cudaGetLastError());
}

void P2pAllReduce::check() const {
  const Impl& m = *impl_;
  if (*static_cast<volatile int*>(m.error_host) != 0)
    FT_FAIL(m.who() + ": a peer did not reach the all-reduce within " + str(m.timeout_ms) +
            " ms or the group was aborted; the step's result is invalid");
}

void P2pAllReduce::abort() noexcept {
  impl_->shared->aborted.store(true);
  *static_cast<volatile int*>(impl_->shared->abort_host) = 1;
}

}  // namespace fasttree
