#include "engine/all_reduce.h"

#include <algorithm>
#include <cstdint>

#include "core/error.h"

namespace fasttree {

namespace {
std::string str(int64_t v) { return std::to_string(v); }
}  // namespace

class LocalGroup::Rank final : public Communicator {
 public:
  Rank(LocalGroup& group, int rank) : group_(group), rank_(rank) {}
  int rank() const override { return rank_; }
  int size() const override { return group_.size(); }
  void all_reduce_sum(std::span<float> x) override { group_.all_reduce_sum(rank_, x); }

 private:
  LocalGroup& group_;
  int rank_;
};

LocalGroup::LocalGroup(int size, std::chrono::milliseconds timeout) : size_(size), timeout_(timeout) {
  FT_CHECK(size >= 1, "LocalGroup: size must be at least 1, got " + str(size));
  FT_CHECK(timeout.count() > 0, "LocalGroup: timeout must be positive, got " + str(timeout.count()) + " ms");
  for (int r = 0; r < size; ++r) ranks_.push_back(std::make_unique<Rank>(*this, r));
  bufs_.assign(static_cast<size_t>(size), nullptr);
  lens_.assign(static_cast<size_t>(size), 0);
}

LocalGroup::~LocalGroup() = default;

Communicator& LocalGroup::comm(int rank) {
  FT_CHECK(rank >= 0 && rank < size_, "LocalGroup: no rank " + str(rank) + " in a group of " + str(size_));
  return *ranks_[static_cast<size_t>(rank)];
}

void LocalGroup::abort(int rank, const std::string& reason) {
  std::lock_guard<std::mutex> lock(mu_);
  abort_locked(rank, reason);
}

void LocalGroup::abort_locked(int rank, const std::string& reason) {
  if (!aborted_) {
    aborted_ = true;
    reason_ = "rank " + str(rank) + ": " + reason;
  }
  // The buffers of ranks that leave are no longer valid; nobody touches them after an abort.
  std::fill(bufs_.begin(), bufs_.end(), nullptr);
  std::fill(lens_.begin(), lens_.end(), 0);
  arrived_ = 0;
  cv_.notify_all();
}

bool LocalGroup::aborted() const {
  std::lock_guard<std::mutex> lock(mu_);
  return aborted_;
}

std::string LocalGroup::abort_reason() const {
  std::lock_guard<std::mutex> lock(mu_);
  return reason_;
}

void LocalGroup::reset() {
  std::lock_guard<std::mutex> lock(mu_);
  aborted_ = false;
  reason_.clear();
  std::fill(bufs_.begin(), bufs_.end(), nullptr);
  std::fill(lens_.begin(), lens_.end(), 0);
  arrived_ = 0;
  generation_ = 0;
}

int64_t LocalGroup::completed() const {
  std::lock_guard<std::mutex> lock(mu_);
  return generation_;
}

void LocalGroup::all_reduce_sum(int rank, std::span<float> x) {
  const std::string who = "all_reduce on rank " + str(rank) + " of " + str(size_);
  std::unique_lock<std::mutex> lock(mu_);
  FT_CHECK(!aborted_, who + ": the group was aborted (" + reason_ + ")");
  FT_CHECK(bufs_[static_cast<size_t>(rank)] == nullptr && lens_[static_cast<size_t>(rank)] == 0,
           who + ": this rank is already inside a collective");
  if (size_ == 1) {
    ++generation_;
    return;
  }
  const int64_t gen = generation_;
  bufs_[static_cast<size_t>(rank)] = x.data();
  lens_[static_cast<size_t>(rank)] = x.size();
  // lens_ marks arrival even for an empty span (whose data() may be null).
  if (x.empty()) lens_[static_cast<size_t>(rank)] = SIZE_MAX;
  ++arrived_;
  if (arrived_ == size_) {
    const size_t n = x.size();
    for (int r = 0; r < size_; ++r) {
      const size_t len = lens_[static_cast<size_t>(r)] == SIZE_MAX ? 0 : lens_[static_cast<size_t>(r)];
      if (len != n) {
        const std::string msg = "ranks passed different lengths to all_reduce #" + str(gen) + " (rank " + str(r) +
                                ": " + str(static_cast<int64_t>(len)) + ", rank " + str(rank) + ": " +
                                str(static_cast<int64_t>(n)) + ")";
        abort_locked(rank, msg);
        FT_FAIL(who + ": " + msg);
      }
    }
    // Sum in rank order so that every rank gets the same bits.
    sum_.assign(n, 0.0f);
    for (int r = 0; r < size_; ++r) {
      const float* b = bufs_[static_cast<size_t>(r)];
      for (size_t i = 0; i < n; ++i) sum_[i] += b[i];
    }
    for (int r = 0; r < size_; ++r)
      if (n > 0) std::copy(sum_.begin(), sum_.end(), bufs_[static_cast<size_t>(r)]);
    std::fill(bufs_.begin(), bufs_.end(), nullptr);
    std::fill(lens_.begin(), lens_.end(), 0);
    arrived_ = 0;
    ++generation_;
    cv_.notify_all();
    return;
  }
  const auto deadline = std::chrono::steady_clock::now() + timeout_;
  const bool done = cv_.wait_until(lock, deadline, [&] { return generation_ != gen || aborted_; });
  if (done && generation_ != gen) return;  // completed (possibly aborted later by another rank)
  if (!done) {
    std::string missing;
    for (int r = 0; r < size_; ++r)
      if (lens_[static_cast<size_t>(r)] == 0 && r != rank) missing += (missing.empty() ? "" : ", ") + str(r);
    const std::string msg = "timed out after " + str(timeout_.count()) + " ms in all_reduce #" + str(gen) +
                            " waiting for rank(s) " + missing + " (failed, missing or stuck)";
    abort_locked(rank, msg);
    FT_FAIL(who + ": " + msg);
  }
  FT_FAIL(who + ": the group was aborted (" + reason_ + ")");
}

}  // namespace fasttree
