// The HF transformers golden data of the engine tests (data/golden/<model>/, made on the GPU
// machine by scripts/make_golden.py): config.json + model.safetensors of a tiny random model and
// golden.json with prompts, the last position's logits, greedy continuations and (optionally) the
// logits of each greedy step. Shared by the CPU, GPU and tensor-parallel engine tests.
#pragma once
#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <system_error>
#include <vector>

#include <nlohmann/json.hpp>

namespace fasttree::test {

struct Golden {
  std::string dir;
  std::vector<std::vector<int32_t>> prompts;
  std::vector<std::vector<float>> logits_last;
  std::vector<std::vector<int32_t>> greedy;
  std::vector<std::vector<std::vector<float>>> greedy_logits;  // may be empty
};

inline std::string golden_root() { return std::string(FASTTREE_SOURCE_DIR) + "/data/golden"; }

// Model folders under data/golden/ that hold a golden.json, sorted; empty when there are none.
inline std::vector<std::string> golden_dirs() {
  std::vector<std::string> dirs;
  std::error_code ec;
  if (!std::filesystem::is_directory(golden_root(), ec)) return dirs;
  for (const auto& e : std::filesystem::directory_iterator(golden_root()))
    if (e.is_directory() && std::filesystem::exists(e.path() / "golden.json")) dirs.push_back(e.path().string());
  std::sort(dirs.begin(), dirs.end());
  return dirs;
}

inline Golden load_golden(const std::string& dir) {
  std::ifstream f(dir + "/golden.json");
  std::stringstream ss;
  ss << f.rdbuf();
  const nlohmann::json j = nlohmann::json::parse(ss.str());
  Golden g;
  g.dir = dir;
  g.prompts = j.at("prompts").get<std::vector<std::vector<int32_t>>>();
  g.logits_last = j.at("logits_last").get<std::vector<std::vector<float>>>();
  g.greedy = j.at("greedy").get<std::vector<std::vector<int32_t>>>();
  if (j.contains("greedy_logits"))
    g.greedy_logits = j.at("greedy_logits").get<std::vector<std::vector<std::vector<float>>>>();
  return g;
}

}  // namespace fasttree::test
