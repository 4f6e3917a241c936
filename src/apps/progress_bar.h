// A one-line progress bar on stderr for long commands (fasttree bench-e2e): redrawn in place with
// '\r' at most every 0.2 s, cleared by finish(). Disabled bars do nothing.
#pragma once
#include <chrono>
#include <cstdint>
#include <string>

namespace fasttree {

// True when stderr is a terminal.
bool stderr_is_tty();

class ProgressBar {
 public:
  ProgressBar(bool enabled, std::string label, int64_t total);
  ~ProgressBar();
  ProgressBar(const ProgressBar&) = delete;
  ProgressBar& operator=(const ProgressBar&) = delete;

  // `done` of `total` units (generated tokens) so far; `batch`: sequences in the last decode step.
  void update(int64_t done, int64_t batch);
  void finish();  // ends the line (idempotent)

 private:
  void draw(int64_t done, int64_t batch);

  bool enabled_;
  bool drawn_ = false;
  int64_t done_ = 0, batch_ = 0;
  std::string label_;
  int64_t total_;
  std::chrono::steady_clock::time_point start_, last_;
};

}  // namespace fasttree
