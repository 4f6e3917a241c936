// NcclComm: one rank's NCCL communicator for tensor parallelism on the GPU (the device counterpart
// of engine/all_reduce.h's LocalGroup). Includes no CUDA header: device pointers are void*, streams
// CUstream_st* (= cudaStream_t, as in cuda/device.h; nullptr = the legacy default stream).
//
// Communicators are created once, non-blocking (ncclConfig_t.blocking = 0), with
// NCCL_NVLS_ENABLE=0 set in the process environment first (NVLink multicast stays off: it can take
// a shared host's GPUs out of service; child processes inherit the setting). Two ways:
//   create_group(devices)        one thread creates every rank of this process (rank i on device
//                                devices[i]) inside ncclGroupStart/End;
//   NcclComm(id, rank, n, dev)   one thread (or process) per rank, all with the same NcclId
//                                (nccl_unique_id() on one of them, shared before the calls).
// Either waits for initialisation with a timeout and throws (after ncclCommAbort) when it fails.
//
// Collectives are enqueued on the caller's stream (the rank's compute stream: no extra sync) and
// return once enqueued; wait(stream, timeout) then polls cudaStreamQuery and
// ncclCommGetAsyncError: on an NCCL error, a CUDA error or when `timeout` passes (a peer rank
// failed, is missing or is stuck: NCCL would spin forever) it calls ncclCommAbort, which also
// stops this rank's pending NCCL kernels, and throws fasttree::Error naming the rank and device.
// A rank that catches its own failure should call abort(): its peers' wait() then fails promptly
// instead of at the timeout. After an abort every call throws.
//
// Symmetric windows (NCCL >= 2.27): create_symmetric_windows(comms, bytes) gives every rank of a
// group `bytes` of device memory from ncclMemAlloc (CUDA VMM), registered collectively with
// NCCL_WIN_COLL_SYMMETRIC. An all-reduce on the same offset of every rank's window then runs NCCL's
// symmetric kernels (ranks load and store each other's windows over NVLink), which cut the
// latency of small and medium all-reduces; elsewhere NCCL runs its usual kernels. The windows are
// deregistered and freed with the communicators (destroy_group / the destructor).
//
// The caller's thread must have the rank's device current (cudaSetDevice) for the collectives.
// Built without NCCL (no CUDA backend, or no libnccl in the CUDA toolkit), nccl_available() is
// false and every other function throws "NCCL not available: ...".
#pragma once
#include <array>
#include <chrono>
#include <cstddef>
#include <memory>
#include <span>
#include <string>
#include <vector>

struct CUstream_st;

namespace fasttree {

// True when this binary was built with the CUDA toolkit's NCCL.
bool nccl_available();

// An ncclUniqueId (opaque bytes, NCCL_UNIQUE_ID_BYTES = 128) to share between the ranks.
struct NcclId {
  std::array<char, 128> bytes{};
};
NcclId nccl_unique_id();

inline constexpr std::chrono::milliseconds kNcclDefaultTimeout{60000};

class NcclComm {
 public:
  // Every rank of a communicator of `size` ranks calls this concurrently (one thread or process
  // each) with the same id; `device` becomes current on the calling thread.
  NcclComm(const NcclId& id, int rank, int size, int device,
           std::chrono::milliseconds init_timeout = kNcclDefaultTimeout);
  // Rank i on devices[i], all created by the calling thread. Devices must be distinct.
  static std::vector<std::unique_ptr<NcclComm>> create_group(std::span<const int> devices,
                                                             std::chrono::milliseconds init_timeout = kNcclDefaultTimeout);
  // ncclCommFinalize + ncclCommDestroy (ncclCommAbort when finalizing fails or takes longer than
  // 10 s, e.g. a peer never finalizes). Finalizing synchronizes with the peers: ranks of one
  // communicator owned by one thread must be released together with destroy_group.
  ~NcclComm();
  // Finalizes every communicator of `comms` at once (non-blocking), then destroys them; clears it.
  static void destroy_group(std::vector<std::unique_ptr<NcclComm>>& comms) noexcept;
  NcclComm(const NcclComm&) = delete;
  NcclComm& operator=(const NcclComm&) = delete;

  // Allocates and registers a symmetric window of `bytes` on every communicator of `comms` (one
  // group, created by create_group: one thread drives every rank). Returns "" on success, else why
  // the windows could not be made (e.g. CUDA VMM memory or peer mappings unsupported on this host:
  // then nothing is left allocated or registered and the communicators stay usable). Throws (after
  // aborting the group) when a registration was started but did not finish within the timeout.
  static std::string create_symmetric_windows(std::span<const std::unique_ptr<NcclComm>> comms, size_t bytes);

  int rank() const;
  int size() const;
  int device() const;
  // This rank's symmetric window (nullptr when none) and its size in bytes.
  void* window() const;
  size_t window_bytes() const;

  // In-place sum over the ranks of `count` elements at device pointer `data`, on `stream`.
  void all_reduce_sum_bf16(void* data, size_t count, CUstream_st* stream);
  void all_reduce_sum_fp32(float* data, size_t count, CUstream_st* stream);
  // Waits for `stream` (see above); throws after aborting on error or timeout.
  void wait(CUstream_st* stream, std::chrono::milliseconds timeout = kNcclDefaultTimeout);
  // Aborts the communicator (idempotent, never throws): pending and future collectives fail.
  // Call it from the thread that uses the communicator (NCCL calls on one comm are not thread-safe).
  void abort() noexcept;
  // Thread-safe request from ANOTHER thread (a peer rank that failed): the owning thread's next or
  // current wait() / all-reduce enqueue / collective call fails at once, aborting the communicator
  // there, with an Error naming `reason` (kept from the first request).
  void request_abort(const std::string& reason) noexcept;
  bool aborted() const;

 private:
  struct Impl;
  NcclComm();
  std::unique_ptr<Impl> impl_;
};

}  // namespace fasttree
