#include "cuda/nccl_comm.h"

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "core/error.h"

#if defined(FASTTREE_HAVE_NCCL)
#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <cstring>
#include <mutex>
#include <thread>

#include "cuda/cuda_check.h"
#endif

namespace fasttree {

#if defined(FASTTREE_HAVE_NCCL)

static_assert(sizeof(ncclUniqueId) == sizeof(NcclId::bytes), "NcclId must hold an ncclUniqueId");

namespace {

using Clock = std::chrono::steady_clock;
constexpr std::chrono::milliseconds kFinalizeTimeout{10000};

std::string str(int64_t v) { return std::to_string(v); }

// NCCL reads its environment at initialisation: NVLink multicast must be off before the first init.
void disable_nvls() { ::setenv("NCCL_NVLS_ENABLE", "0", 1); }

std::string describe(ncclResult_t r, ncclComm_t comm) {
  std::string s = ncclGetErrorString(r);
  const char* last = ncclGetLastError(comm);
  if (last != nullptr && last[0] != '\0') s += " (" + std::string(last) + ")";
  std::replace(s.begin(), s.end(), '\n', ' ');
  return s;
}

// Backs off from spinning to short sleeps while polling.
void pause(int64_t iteration) {
  if (iteration < 1000) {
    std::this_thread::yield();
  } else {
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
}

// Polls a non-blocking communicator until it leaves ncclInProgress or the deadline passes
// (then returns ncclInProgress). A failing query is returned as its error.
ncclResult_t poll_state(ncclComm_t comm, Clock::time_point deadline) {
  for (int64_t i = 0;; ++i) {
    ncclResult_t state = ncclInProgress;
    const ncclResult_t r = ncclCommGetAsyncError(comm, &state);
    if (r != ncclSuccess) return r;
    if (state != ncclInProgress) return state;
    if (Clock::now() > deadline) return ncclInProgress;
    pause(i);
  }
}

ncclConfig_t nonblocking_config() {
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  return config;
}

}  // namespace

struct NcclComm::Impl {
  ncclComm_t comm = nullptr;
  int rank = 0;
  int size = 0;
  int device = -1;
  std::chrono::milliseconds timeout{kNcclDefaultTimeout};
  std::atomic<bool> aborted{false};
  std::atomic<bool> abort_requested{false};
  std::mutex reason_mu;
  std::string abort_reason;  // of the first request_abort
  bool finalizing = false;

  std::string who() const {
    return "NCCL rank " + str(rank) + " of " + str(size) + " (device " + str(device) + ")";
  }
  void abort() noexcept {
    if (!aborted.exchange(true) && comm != nullptr) {
      ncclCommAbort(comm);
      comm = nullptr;
    }
  }
  [[noreturn]] void fail(const std::string& what) {
    abort();
    FT_FAIL(who() + ": " + what + "; communicator aborted");
  }
  void check_usable(const char* op) {
    FT_CHECK(!aborted.load() && comm != nullptr, who() + ": " + op + " on an aborted communicator");
    check_requested();
  }
  // A peer asked this rank to stop (request_abort): abort here, on the owning thread, and throw.
  void check_requested() {
    if (!abort_requested.load()) return;
    std::string reason;
    {
      std::lock_guard<std::mutex> lock(reason_mu);
      reason = abort_reason;
    }
    fail("stopped because " + reason);
  }
  // Waits for initialisation to finish; aborts and throws on failure or timeout.
  void finish_init(Clock::time_point deadline) {
    const ncclResult_t r = poll_state(comm, deadline);
    if (r == ncclInProgress)
      fail("initialisation did not finish within " + str(timeout.count()) + " ms (a rank failed or is missing)");
    if (r != ncclSuccess) fail("initialisation failed: " + describe(r, comm));
  }
  void all_reduce(void* data, size_t count, ncclDataType_t type, cudaStream_t stream) {
    check_usable("all_reduce");
    if (count == 0) return;
    FT_CHECK(data != nullptr, who() + ": all_reduce of " + str(static_cast<int64_t>(count)) + " elements at nullptr");
    ncclResult_t r = ncclAllReduce(data, data, count, type, ncclSum, comm, stream);
    if (r == ncclInProgress) {
      const auto deadline = Clock::now() + timeout;
      do {
        check_requested();
        r = poll_state(comm, std::min(deadline, Clock::now() + std::chrono::milliseconds(5)));
      } while (r == ncclInProgress && Clock::now() <= deadline);
      if (r == ncclInProgress) fail("enqueueing an all-reduce did not finish within " + str(timeout.count()) + " ms");
    }
    if (r != ncclSuccess) fail("ncclAllReduce failed: " + describe(r, comm));
  }
  void start_finalize() noexcept {
    if (aborted.load() || comm == nullptr || finalizing) return;
    cudaSetDevice(device);
    const ncclResult_t r = ncclCommFinalize(comm);
    if (r != ncclSuccess && r != ncclInProgress) {
      abort();
      return;
    }
    finalizing = true;
  }
  void finish_destroy(Clock::time_point deadline) noexcept {
    if (aborted.load() || comm == nullptr) return;
    start_finalize();
    if (aborted.load() || comm == nullptr) return;
    if (poll_state(comm, deadline) != ncclSuccess) {
      abort();
      return;
    }
    ncclCommDestroy(comm);
    comm = nullptr;
  }
};

bool nccl_available() { return true; }

NcclId nccl_unique_id() {
  disable_nvls();
  ncclUniqueId uid;
  const ncclResult_t r = ncclGetUniqueId(&uid);
  FT_CHECK(r == ncclSuccess, std::string("ncclGetUniqueId failed: ") + ncclGetErrorString(r));
  NcclId id;
  std::memcpy(id.bytes.data(), &uid, sizeof(uid));
  return id;
}

NcclComm::NcclComm() : impl_(std::make_unique<Impl>()) {}

NcclComm::NcclComm(const NcclId& id, int rank, int size, int device, std::chrono::milliseconds init_timeout)
    : impl_(std::make_unique<Impl>()) {
  FT_CHECK(size >= 1 && rank >= 0 && rank < size,
           "NcclComm: rank " + str(rank) + " outside a communicator of " + str(size) + " ranks");
  FT_CHECK(device >= 0, "NcclComm: bad device " + str(device));
  FT_CHECK(init_timeout.count() > 0, "NcclComm: the timeout must be positive");
  Impl& c = *impl_;
  c.rank = rank;
  c.size = size;
  c.device = device;
  c.timeout = init_timeout;
  disable_nvls();
  FT_CUDA_CHECK(cudaSetDevice(device));
  ncclUniqueId uid;
  std::memcpy(&uid, id.bytes.data(), sizeof(uid));
  ncclConfig_t config = nonblocking_config();
  const auto deadline = Clock::now() + init_timeout;
  const ncclResult_t r = ncclCommInitRankConfig(&c.comm, size, uid, rank, &config);
  if (r != ncclSuccess && r != ncclInProgress) {
    const std::string msg = describe(r, c.comm);
    c.abort();
    FT_FAIL(c.who() + ": ncclCommInitRankConfig failed: " + msg);
  }
  c.finish_init(deadline);
}

std::vector<std::unique_ptr<NcclComm>> NcclComm::create_group(std::span<const int> devices,
                                                              std::chrono::milliseconds init_timeout) {
  const int n = static_cast<int>(devices.size());
  FT_CHECK(n >= 1, "NcclComm::create_group: no devices");
  FT_CHECK(init_timeout.count() > 0, "NcclComm::create_group: the timeout must be positive");
  for (int i = 0; i < n; ++i) {
    FT_CHECK(devices[i] >= 0, "NcclComm::create_group: rank " + str(i) + " has a negative device " + str(devices[i]));
    for (int j = 0; j < i; ++j)
      FT_CHECK(devices[j] != devices[i], "NcclComm::create_group: device " + str(devices[i]) + " given twice");
  }
  int visible = 0;
  FT_CUDA_CHECK(cudaGetDeviceCount(&visible));
  for (int i = 0; i < n; ++i)
    FT_CHECK(devices[i] < visible, "NcclComm::create_group: rank " + str(i) + "'s device " + str(devices[i]) +
                                       " is missing (" + str(visible) + " visible)");
  const NcclId id = nccl_unique_id();  // also disables NVLS
  ncclUniqueId uid;
  std::memcpy(&uid, id.bytes.data(), sizeof(uid));
  std::vector<std::unique_ptr<NcclComm>> comms;
  for (int i = 0; i < n; ++i) {
    comms.push_back(std::unique_ptr<NcclComm>(new NcclComm()));
    Impl& c = *comms.back()->impl_;
    c.rank = i;
    c.size = n;
    c.device = devices[i];
    c.timeout = init_timeout;
  }
  int current = 0;
  FT_CUDA_CHECK(cudaGetDevice(&current));
  ncclConfig_t config = nonblocking_config();
  const auto deadline = Clock::now() + init_timeout;
  std::string error;
  ncclResult_t r = ncclGroupStart();
  FT_CHECK(r == ncclSuccess, std::string("ncclGroupStart failed: ") + ncclGetErrorString(r));
  for (int i = 0; i < n && error.empty(); ++i) {
    Impl& c = *comms[static_cast<size_t>(i)]->impl_;
    const cudaError_t e = cudaSetDevice(c.device);
    if (e != cudaSuccess) {
      error = c.who() + ": cudaSetDevice failed: " + cudaGetErrorName(e);
      break;
    }
    r = ncclCommInitRankConfig(&c.comm, n, uid, i, &config);
    if (r != ncclSuccess && r != ncclInProgress) error = c.who() + ": ncclCommInitRankConfig failed: " + describe(r, c.comm);
  }
  r = ncclGroupEnd();
  if (error.empty() && r != ncclSuccess && r != ncclInProgress)
    error = std::string("ncclGroupEnd failed: ") + ncclGetErrorString(r);
  cudaSetDevice(current);
  if (!error.empty()) {
    for (auto& c : comms) c->impl_->abort();
    FT_FAIL(error);
  }
  try {
    for (auto& c : comms) c->impl_->finish_init(deadline);
  } catch (...) {
    for (auto& c : comms) c->impl_->abort();
    throw;
  }
  return comms;
}

void NcclComm::destroy_group(std::vector<std::unique_ptr<NcclComm>>& comms) noexcept {
  for (auto& c : comms)
    if (c) c->impl_->start_finalize();
  const auto deadline = Clock::now() + kFinalizeTimeout;
  for (auto& c : comms)
    if (c) c->impl_->finish_destroy(deadline);
  comms.clear();
}

NcclComm::~NcclComm() {
  if (impl_) impl_->finish_destroy(Clock::now() + kFinalizeTimeout);
}

int NcclComm::rank() const { return impl_->rank; }
int NcclComm::size() const { return impl_->size; }
int NcclComm::device() const { return impl_->device; }
bool NcclComm::aborted() const { return impl_->aborted.load(); }
void NcclComm::abort() noexcept { impl_->abort(); }
void NcclComm::request_abort(const std::string& reason) noexcept {
  try {
    std::lock_guard<std::mutex> lock(impl_->reason_mu);
    if (impl_->abort_reason.empty()) impl_->abort_reason = reason;
  } catch (...) {
  }
  impl_->abort_requested.store(true);
}

void NcclComm::all_reduce_sum_bf16(void* data, size_t count, CUstream_st* stream) {
  impl_->all_reduce(data, count, ncclBfloat16, stream);
}

void NcclComm::all_reduce_sum_fp32(float* data, size_t count, CUstream_st* stream) {
  impl_->all_reduce(data, count, ncclFloat32, stream);
}

void NcclComm::wait(CUstream_st* stream, std::chrono::milliseconds timeout) {
  Impl& c = *impl_;
  c.check_usable("wait");
  const auto deadline = Clock::now() + timeout;
  const cudaStream_t s = stream;
  for (int64_t i = 0;; ++i) {
    const cudaError_t q = cudaStreamQuery(s);
    if (q == cudaSuccess) return;
    if (q != cudaErrorNotReady)
      c.fail(std::string("the stream failed: ") + cudaGetErrorName(q) + " (" + cudaGetErrorString(q) + ")");
    ncclResult_t state = ncclSuccess;
    c.check_requested();
    const ncclResult_t r = ncclCommGetAsyncError(c.comm, &state);
    if (r != ncclSuccess) c.fail("ncclCommGetAsyncError failed: " + describe(r, c.comm));
    if (state != ncclSuccess && state != ncclInProgress) c.fail("asynchronous NCCL error: " + describe(state, c.comm));
    if (Clock::now() > deadline)
      c.fail("the stream did not finish within " + str(timeout.count()) +
             " ms (a peer rank failed, is missing or is stuck)");
    pause(i);
  }
}

#else  // !FASTTREE_HAVE_NCCL

namespace {
[[noreturn]] void not_available() {
  FT_FAIL(
      "NCCL not available: this binary was built without the CUDA toolkit's NCCL (libnccl and nccl.h under the "
      "toolkit; see CMakeLists.txt), so tensor parallelism on GPUs cannot run");
}
}  // namespace

struct NcclComm::Impl {};

bool nccl_available() { return false; }
NcclId nccl_unique_id() { not_available(); }
NcclComm::NcclComm() = default;
NcclComm::NcclComm(const NcclId&, int, int, int, std::chrono::milliseconds) { not_available(); }
std::vector<std::unique_ptr<NcclComm>> NcclComm::create_group(std::span<const int>, std::chrono::milliseconds) {
  not_available();
}
void NcclComm::destroy_group(std::vector<std::unique_ptr<NcclComm>>& comms) noexcept { comms.clear(); }
NcclComm::~NcclComm() = default;
int NcclComm::rank() const { not_available(); }
int NcclComm::size() const { not_available(); }
int NcclComm::device() const { not_available(); }
bool NcclComm::aborted() const { not_available(); }
void NcclComm::abort() noexcept {}
void NcclComm::request_abort(const std::string&) noexcept {}
void NcclComm::all_reduce_sum_bf16(void*, size_t, CUstream_st*) { not_available(); }
void NcclComm::all_reduce_sum_fp32(float*, size_t, CUstream_st*) { not_available(); }
void NcclComm::wait(CUstream_st*, std::chrono::milliseconds) { not_available(); }

#endif

}  // namespace fasttree
