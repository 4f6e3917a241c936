// Collectives between the ranks of a tensor-parallel model.
//
// Communicator: one rank's handle on a group of size() ranks. all_reduce_sum(x) replaces x with the
// element-wise sum of every rank's x (same length on every rank); every rank must make the same
// sequence of calls. A failure anywhere (a rank that threw, a rank that does not arrive within the
// timeout, mismatched lengths) throws fasttree::Error on every rank, never hangs.
//
// LocalGroup: the CPU stand-in for NCCL. N threads of one process (one per rank) reduce through
// shared memory: each arriving rank publishes its buffer; the last to arrive sums the buffers in
// rank order (x_0 + x_1 + ... : the result is bitwise identical on every rank and deterministic)
// and writes the sum into every buffer, then releases the others. A rank waiting longer than
// `timeout` for the others aborts the group. abort() (a rank that failed) wakes every waiting rank
// at once. Once aborted, every collective throws "... aborted: <first reason>" until reset(), which
// may only be called while no rank is inside a collective (e.g. after joining the rank threads).
#pragma once
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <vector>

namespace fasttree {

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual void all_reduce_sum(std::span<float> x) = 0;
};

class LocalGroup {
 public:
  static constexpr std::chrono::milliseconds kDefaultTimeout{60000};

  explicit LocalGroup(int size, std::chrono::milliseconds timeout = kDefaultTimeout);
  LocalGroup(const LocalGroup&) = delete;
  LocalGroup& operator=(const LocalGroup&) = delete;
  ~LocalGroup();

  int size() const { return size_; }
  std::chrono::milliseconds timeout() const { return timeout_; }
  // Rank r's communicator (owned by the group; valid while the group lives).
  Communicator& comm(int rank);

  // Marks the group failed with `reason` (the first reason is kept) and wakes every waiting rank.
  void abort(int rank, const std::string& reason);
  bool aborted() const;
  std::string abort_reason() const;  // empty when not aborted
  // Clears a failure and any half-finished collective. Only while no rank is inside a collective.
  void reset();
  // Collectives completed since construction / the last reset().
  int64_t completed() const;

 private:
  class Rank;
  void all_reduce_sum(int rank, std::span<float> x);
  void abort_locked(int rank, const std::string& reason);

  int size_;
  std::chrono::milliseconds timeout_;
  std::vector<std::unique_ptr<Rank>> ranks_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  int64_t generation_ = 0;             // collectives completed
  int arrived_ = 0;                    // ranks inside the current collective
  std::vector<float*> bufs_;           // [size] each arrived rank's buffer (nullptr: not arrived)
  std::vector<size_t> lens_;           // [size]
  std::vector<float> sum_;             // scratch of the last arriver
  bool aborted_ = false;
  std::string reason_;
};

}  // namespace fasttree
