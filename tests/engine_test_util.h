// Helpers shared by the engine tests (tests/test_engine_*.cpp): a fresh temporary folder per test,
// seeded random vectors, and an expectation that a call throws a one-line fasttree::Error
// containing given fragments.
#pragma once
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <functional>
#include <initializer_list>
#include <random>
#include <string>
#include <vector>

#include "core/error.h"

namespace fasttree::test {

class TempDir {
 public:
  TempDir() {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = std::filesystem::temp_directory_path() /
           ("fasttree_engine_" + std::string(info->test_suite_name()) + "_" + info->name() + "_" +
            std::to_string(::getpid()));
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_);
  }
  ~TempDir() { std::filesystem::remove_all(dir_); }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  std::string path(const std::string& name = "") const { return name.empty() ? dir_.string() : (dir_ / name).string(); }
  std::string write(const std::string& name, const std::string& bytes) const {
    const std::string p = path(name);
    std::ofstream f(p, std::ios::binary);
    f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    return p;
  }

 private:
  std::filesystem::path dir_;
};

inline std::vector<float> random_floats(size_t n, uint64_t seed, float lo = -1.0f, float hi = 1.0f) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> x(n);
  for (float& e : x) e = dist(rng);
  return x;
}

// Runs f, expecting a fasttree::Error with a one-line message containing every fragment.
inline void expect_error(const std::function<void()>& f, const std::vector<std::string>& fragments,
                         const std::string& label = "") {
  try {
    f();
    ADD_FAILURE() << label << ": no error thrown";
  } catch (const Error& e) {
    const std::string msg = e.message();
    EXPECT_EQ(msg.find('\n'), std::string::npos) << label << ": multi-line message: " << msg;
    for (const std::string& frag : fragments)
      EXPECT_NE(msg.find(frag), std::string::npos) << label << ": '" << frag << "' not in: " << msg;
  }
}

// max |a - b| / max(1e-6, max |b|)
inline double rel_err(const std::vector<float>& a, const std::vector<float>& b) {
  EXPECT_EQ(a.size(), b.size());
  double diff = 0.0, scale = 1e-6;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
    diff = std::max(diff, static_cast<double>(std::abs(a[i] - b[i])));
    scale = std::max(scale, static_cast<double>(std::abs(b[i])));
  }
  return diff / scale;
}

}  // namespace fasttree::test
