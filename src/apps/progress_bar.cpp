#include "apps/progress_bar.h"

#include <unistd.h>

#include <algorithm>
#include <cstdio>

#include <fmt/format.h>

namespace fasttree {

namespace {
constexpr auto kRedrawEvery = std::chrono::milliseconds(200);
constexpr int kBarWidth = 30;
}  // namespace

bool stderr_is_tty() { return ::isatty(STDERR_FILENO) == 1; }

ProgressBar::ProgressBar(bool enabled, std::string label, int64_t total)
    : enabled_(enabled), label_(std::move(label)), total_(std::max<int64_t>(total, 1)),
      start_(std::chrono::steady_clock::now()), last_(start_ - kRedrawEvery) {}

ProgressBar::~ProgressBar() { finish(); }

void ProgressBar::update(int64_t done, int64_t batch) {
  if (!enabled_) return;
  done_ = done;
  batch_ = batch;
  const auto now = std::chrono::steady_clock::now();
  if (now - last_ < kRedrawEvery) return;
  last_ = now;
  draw(done, batch);
}

void ProgressBar::draw(int64_t done, int64_t batch) {
  const double frac = std::clamp(static_cast<double>(done) / static_cast<double>(total_), 0.0, 1.0);
  const int fill = static_cast<int>(frac * kBarWidth);
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  const double rate = secs > 0 ? static_cast<double>(done) / secs : 0.0;
  const std::string line = fmt::format("\r{} [{}{}] {}/{} tok  {:.0f} tok/s  batch {}  ", label_, std::string(fill, '#'),
                                       std::string(kBarWidth - fill, '.'), done, total_, rate, batch);
  std::fputs(line.c_str(), stderr);
  std::fflush(stderr);
  drawn_ = true;
}

void ProgressBar::finish() {
  if (!enabled_ || !drawn_) return;
  draw(done_, batch_);
  std::fputs("\n", stderr);
  std::fflush(stderr);
  drawn_ = false;
}

}  // namespace fasttree
