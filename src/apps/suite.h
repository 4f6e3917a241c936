// The paper's kernel suite: 15 level trees x 3 head settings (head_dim 128), with the anchors'
// measured times (bench/anchors/h200-paper-suite.csv, copied from shared/anchors).
#pragma once
#include <string>
#include <vector>

#include "core/attention_shape.h"
#include "core/kv_tree.h"

namespace fasttree {

struct SuiteCell {
  std::string nodes_per_level, context_per_level;  // space-separated, as in the anchors file
  KvTree tree;
  AttnShape shape;
  double triton_us = 0, sdpa_us = 0, pat_us = 0, best_anchor_us = 0;  // NaN when absent
};

// Splits a CSV line or a comma list (a trailing '\r' of CRLF files is dropped).
std::vector<std::string> split_fields(std::string s, char sep);

std::string default_anchors_path();
std::vector<SuiteCell> load_suite(const std::string& path);

}  // namespace fasttree
