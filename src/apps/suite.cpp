#include "apps/suite.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <sstream>

#include "core/error.h"
#include "core/tree_gen.h"

namespace fasttree {

namespace {

double to_double(const std::string& s, const std::string& where) {
  if (s.empty()) return NAN;
  try {
    return std::stod(s);
  } catch (...) {
    FT_FAIL(where + ": '" + s + "' is not a number");
  }
}

}  // namespace

std::vector<std::string> split_fields(std::string s, char sep) {
  if (!s.empty() && s.back() == '\r') s.pop_back();
  std::vector<std::string> out;
  std::stringstream ss(s);
  for (std::string item; std::getline(ss, item, sep);) out.push_back(item);
  return out;
}

// The source tree's copy when it exists (the build machine), else relative to the working folder
// (binaries carried to another machine run from the repository root there).
std::string default_anchors_path() {
  const std::string built = std::string(FASTTREE_SOURCE_DIR) + "/bench/anchors/h200-paper-suite.csv";
  return std::ifstream(built).good() ? built : "bench/anchors/h200-paper-suite.csv";
}

std::vector<SuiteCell> load_suite(const std::string& path) {
  std::ifstream f(path);
  FT_CHECK(f.good(), path + ": cannot open the suite file");
  std::string line;
  std::getline(f, line);
  const auto hdr = split_fields(line, ',');
  auto col = [&](const std::string& name) {
    const auto it = std::find(hdr.begin(), hdr.end(), name);
    FT_CHECK(it != hdr.end(), path + ": missing column " + name);
    return static_cast<size_t>(it - hdr.begin());
  };
  const size_t c_nodes = col("nodes_per_level"), c_ctx = col("context_per_level"), c_hq = col("num_qo_heads"),
               c_hkv = col("num_kv_heads"), c_tri = col("fasttree_triton_us"), c_sdpa = col("sdpa_flash_us"),
               c_pat = col("pat_us"), c_best = col("best_anchor_us");
  std::vector<SuiteCell> cells;
  int line_no = 1;
  while (std::getline(f, line)) {
    ++line_no;
    if (line.empty()) continue;
    const std::string where = path + ":" + std::to_string(line_no);
    const auto v = split_fields(line, ',');
    FT_CHECK(v.size() == hdr.size(), where + ": expected " + std::to_string(hdr.size()) + " columns");
    SuiteCell c;
    c.nodes_per_level = v[c_nodes];
    c.context_per_level = v[c_ctx];
    std::string counts = v[c_nodes], lens = v[c_ctx];
    std::replace(counts.begin(), counts.end(), ' ', ',');
    std::replace(lens.begin(), lens.end(), ' ', ',');
    c.tree = tree_from_levels(parse_int_list(counts, where + " nodes_per_level"), parse_int_list(lens, where + " context_per_level"));
    c.shape = AttnShape{static_cast<int>(to_double(v[c_hq], where)), static_cast<int>(to_double(v[c_hkv], where)), 128};
    c.shape.validate();
    c.triton_us = to_double(v[c_tri], where);
    c.sdpa_us = to_double(v[c_sdpa], where);
    c.pat_us = to_double(v[c_pat], where);
    c.best_anchor_us = to_double(v[c_best], where);
    cells.push_back(std::move(c));
  }
  FT_CHECK(!cells.empty(), path + ": no cells");
  return cells;
}

}  // namespace fasttree
