// P2pAllReduce: a one-shot fp32 all-reduce (sum) for the tensor-parallel ranks of one process, over
// CUDA peer access (NVLink), for the small, latency-bound all-reduces of decode steps. NCCL stays
// for everything else (engine/tp_gpu_model.h picks per call). Includes no CUDA header.
//
//   auto group = P2pAllReduce::create_group(devices, max_bytes, timeout, &why);  // empty + why if the
//                                                 // devices lack peer access (every pair must have it)
//   float* buf = group[r]->buffer();              // rank r's buffer: the data to sum lives here
//   group[r]->all_reduce_sum_fp32(buf, count, stream);   // on rank r's thread and device
//
// Each rank owns a buffer of max_bytes (cudaMalloc, readable by its peers through peer access). One
// kernel launch per all-reduce: block b of every rank handles the same element range; it signals
// "my data is ready" to block b of every peer (a flag store with release semantics at system
// scope), waits for theirs, loads the range from every rank's buffer in rank order and sums in
// fp32 (so every rank gets bit-identical results), signals "done reading", waits, and writes the sum
// into its own buffer. Flags carry a per-block epoch kept in device memory, so the launches can be
// captured in CUDA graphs and replayed. Counts must be a multiple of 4 and fit in the buffer and
// in one wave of the kernel (max_count()); larger all-reduces go to NCCL.
//
// Never a hang: a kernel waiting for a peer gives up after `timeout` (device clock) or soon after
// abort() is called on any rank of the group (a flag in mapped host memory that a wait reads once it
// has lasted 1 ms: reading host memory on every wait cost ~100 us per all-reduce), leaves its buffer
// unchanged and records the failure; check() (after the stream completed) then throws an Error
// naming the rank. After an abort the group stays aborted.
#pragma once
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

struct CUstream_st;

namespace fasttree {

class P2pAllReduce {
 public:
  // One object per device (rank i on devices[i]), all made by the calling thread. Returns an empty
  // vector and sets *why when peer access between some pair is unsupported. Throws on CUDA errors.
  static std::vector<std::unique_ptr<P2pAllReduce>> create_group(std::span<const int> devices, size_t max_bytes,
                                                                 std::chrono::milliseconds timeout, std::string* why);
  ~P2pAllReduce();
  P2pAllReduce(const P2pAllReduce&) = delete;
  P2pAllReduce& operator=(const P2pAllReduce&) = delete;

  int rank() const;
  float* buffer() const;
  size_t buffer_bytes() const;
  // Largest count one all-reduce takes (buffer size and one wave of blocks).
  size_t max_count() const;
  // True when `count` floats at `data` can go through this group (data == buffer(), count % 4 == 0,
  // count <= max_count()).
  bool accepts(const float* data, size_t count) const;
  // Sums `count` floats of every rank's buffer into every rank's buffer, enqueued on `stream`
  // (the caller's thread has this rank's device current). Throws when !accepts or after an abort.
  void all_reduce_sum_fp32(float* data, size_t count, CUstream_st* stream);
  // Throws when one of this rank's kernels gave up (timeout or abort). Call after the stream finished.
  void check() const;
  // Makes every waiting or future kernel of the whole group give up at once (any thread; never throws).
  void abort() noexcept;
  bool aborted() const;

 private:
  struct Shared;
  struct Impl;
  explicit P2pAllReduce(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace fasttree
