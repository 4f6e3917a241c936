// parallel_for: a minimal fork-join loop over [0, n) on std::thread (no pool; threads live for one
// call). Indices are handed out dynamically in order (an atomic counter), so an index list sorted
// longest-first balances well. The first exception thrown by f stops the hand-out of new indices
// and is rethrown on the calling thread after all workers joined.
#pragma once
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

namespace fasttree {

// Number of worker threads parallel_for uses for `n` indices when asked for `num_threads`
// (0 = std::thread::hardware_concurrency()).
inline int resolve_num_threads(int64_t n, int num_threads) {
  int t = num_threads > 0 ? num_threads : static_cast<int>(std::thread::hardware_concurrency());
  t = std::max(t, 1);
  return static_cast<int>(std::min<int64_t>(t, std::max<int64_t>(n, 1)));
}

// Calls f(i) once for every i in [0, n). With one thread (or n <= 1) it runs inline.
template <class F>
void parallel_for(int64_t n, F f, int num_threads = 0) {
  if (n <= 0) return;
  const int threads = resolve_num_threads(n, num_threads);
  if (threads == 1) {
    for (int64_t i = 0; i < n; ++i) f(i);
    return;
  }
  std::atomic<int64_t> next{0};
  std::atomic<bool> failed{false};
  std::exception_ptr error;
  std::mutex error_mutex;
  auto worker = [&] {
    for (;;) {
      if (failed.load(std::memory_order_relaxed)) return;
      const int64_t i = next.fetch_add(1, std::memory_order_relaxed);
      if (i >= n) return;
      try {
        f(i);
      } catch (...) {
        std::lock_guard<std::mutex> lock(error_mutex);
        if (!error) error = std::current_exception();
        failed.store(true, std::memory_order_relaxed);
        return;
      }
    }
  };
  std::vector<std::thread> pool;
  pool.reserve(static_cast<size_t>(threads - 1));
  for (int t = 1; t < threads; ++t) pool.emplace_back(worker);
  worker();
  for (auto& th : pool) th.join();
  if (error) std::rethrow_exception(error);
}

}  // namespace fasttree
