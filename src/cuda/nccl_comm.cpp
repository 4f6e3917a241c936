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
  // Symmetric window (create_symmetric_windows): memory from ncclMemAlloc, registered when `win` is set.
  void* win_ptr = nullptr;
  size_t win_bytes = 0;
  ncclWindow_t win = nullptr;

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
  // Starts the (collective) deregistration of the window; the caller polls the communicator.
  void start_deregister() noexcept {
    if (win == nullptr) return;
    if (!aborted.load() && comm != nullptr) {
      cudaSetDevice(device);
      const ncclResult_t r = ncclCommWindowDeregister(comm, win);
      if (r != ncclSuccess && r != ncclInProgress) abort();
    }
    win = nullptr;
  }
  // Frees the window's memory (after the communicator is destroyed or the registration undone).
  void free_window() noexcept {
    if (win_ptr == nullptr) return;
    cudaSetDevice(device);
    ncclMemFree(win_ptr);
    win_ptr = nullptr;
    win_bytes = 0;
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
  const auto deadline = Clock::now() + kFinalizeTimeout;
  bool windows = false;
  for (auto& c : comms) windows = windows || (c && c->impl_->win != nullptr);
  if (windows) {  // deregistration is collective: every rank's inside one group, then wait for them
    int current = 0;
    cudaGetDevice(&current);
    if (ncclGroupStart() == ncclSuccess) {
      for (auto& c : comms)
        if (c) c->impl_->start_deregister();
      const ncclResult_t r = ncclGroupEnd();
      if (r != ncclSuccess && r != ncclInProgress)
        for (auto& c : comms)
          if (c) c->impl_->abort();
    } else {
      for (auto& c : comms)
        if (c) c->impl_->abort();
    }
    for (auto& c : comms)
      if (c && !c->impl_->aborted.load() && c->impl_->comm != nullptr &&
          poll_state(c->impl_->comm, deadline) != ncclSuccess)
        c->impl_->abort();
    cudaSetDevice(current);
  }
  for (auto& c : comms)
    if (c) c->impl_->start_finalize();
  for (auto& c : comms)
    if (c) c->impl_->finish_destroy(deadline);
  for (auto& c : comms)
    if (c) c->impl_->free_window();
  comms.clear();
}

NcclComm::~NcclComm() {
  if (!impl_) return;
  const auto deadline = Clock::now() + kFinalizeTimeout;
  if (impl_->win != nullptr) {
    impl_->start_deregister();
    if (!impl_->aborted.load() && impl_->comm != nullptr && poll_state(impl_->comm, deadline) != ncclSuccess)
      impl_->abort();
  }
  impl_->finish_destroy(deadline);
  impl_->free_window();
}

std::string NcclComm::create_symmetric_windows(std::span<const std::unique_ptr<NcclComm>> comms, size_t bytes) {
  FT_CHECK(bytes > 0, "NcclComm::create_symmetric_windows: zero bytes");
  FT_CHECK(!comms.empty(), "NcclComm::create_symmetric_windows: no communicators");
  for (const auto& c : comms) {
    FT_CHECK(c != nullptr, "NcclComm::create_symmetric_windows: null communicator");
    c->impl_->check_usable("create_symmetric_windows");
    FT_CHECK(c->impl_->win_ptr == nullptr, c->impl_->who() + ": already has a symmetric window");
  }
  constexpr size_t kGranule = size_t{2} << 20;  // CUDA VMM granularity on current GPUs (a multiple of 4 KB)
  static_assert(kGranule % NCCL_WIN_REQUIRED_ALIGNMENT == 0);
  const size_t size = (bytes + kGranule - 1) / kGranule * kGranule;
  int current = 0;
  FT_CUDA_CHECK(cudaGetDevice(&current));
  std::string why;
  for (const auto& c : comms) {  // local allocations first: a refusal here leaves the group untouched
    Impl& m = *c->impl_;
    cudaError_t e = cudaSetDevice(m.device);
    if (e != cudaSuccess) {
      why = m.who() + ": cudaSetDevice failed: " + cudaGetErrorName(e);
      break;
    }
    void* p = nullptr;
    const ncclResult_t r = ncclMemAlloc(&p, size);
    if (r != ncclSuccess || p == nullptr) {
      why = m.who() + ": ncclMemAlloc(" + str(static_cast<int64_t>(size)) + ") failed: " + describe(r, m.comm);
      break;
    }
    m.win_ptr = p;
    m.win_bytes = size;
    e = cudaMemset(p, 0, size);
    if (e != cudaSuccess) {
      why = m.who() + ": cudaMemset of the window failed: " + cudaGetErrorName(e);
      break;
    }
  }
  if (!why.empty()) {
    for (const auto& c : comms) c->impl_->free_window();
    cudaSetDevice(current);
    return why;
  }
  // Registration is collective: every rank's call inside one group.
  const ncclResult_t start = ncclGroupStart();
  if (start != ncclSuccess) why = std::string("ncclGroupStart failed: ") + ncclGetErrorString(start);
  for (size_t i = 0; i < comms.size() && why.empty(); ++i) {
    Impl& m = *comms[i]->impl_;
    cudaSetDevice(m.device);
    const ncclResult_t r = ncclCommWindowRegister(m.comm, m.win_ptr, m.win_bytes, &m.win, NCCL_WIN_COLL_SYMMETRIC);
    if (r != ncclSuccess && r != ncclInProgress) why = m.who() + ": ncclCommWindowRegister failed: " + describe(r, m.comm);
  }
  if (start == ncclSuccess) {
    const ncclResult_t end = ncclGroupEnd();
    if (why.empty() && end != ncclSuccess && end != ncclInProgress)
      why = std::string("ncclGroupEnd (window registration) failed: ") + ncclGetErrorString(end);
  }
  cudaSetDevice(current);
  const auto deadline = Clock::now() + comms[0]->impl_->timeout;
  for (const auto& c : comms) {
    if (!why.empty()) break;
    Impl& m = *c->impl_;
    const ncclResult_t s = poll_state(m.comm, deadline);
    if (s == ncclInProgress) why = m.who() + ": window registration did not finish within " + str(m.timeout.count()) + " ms";
    else if (s != ncclSuccess) why = m.who() + ": window registration failed: " + describe(s, m.comm);
  }
  if (why.empty()) return "";
  // A registration that was started may be half done on some ranks: the group is not safe to use.
  for (const auto& c : comms) {
    c->impl_->win = nullptr;
    c->impl_->abort();
    c->impl_->free_window();
  }
  FT_FAIL(why + "; communicators aborted");
}

int NcclComm::rank() const { return impl_->rank; }
int NcclComm::size() const { return impl_->size; }
int NcclComm::device() const { return impl_->device; }
void* NcclComm::window() const { return impl_->win != nullptr ? impl_->win_ptr : nullptr; }
size_t NcclComm::window_bytes() const { return impl_->win != nullptr ? impl_->win_bytes : 0; }
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
std::string NcclComm::create_symmetric_windows(std::span<const std::unique_ptr<NcclComm>>, size_t) { not_available(); }
void* NcclComm::window() const { not_available(); }
size_t NcclComm::window_bytes() const { not_available(); }
bool NcclComm::aborted() const { not_available(); }
void NcclComm::abort() noexcept {}
void NcclComm::request_abort(const std::string&) noexcept {}
void NcclComm::all_reduce_sum_bf16(void*, size_t, CUstream_st*) { not_available(); }
void NcclComm::all_reduce_sum_fp32(float*, size_t, CUstream_st*) { not_available(); }
void NcclComm::wait(CUstream_st*, std::chrono::milliseconds) { not_available(); }

#endif

}  // namespace fasttree
