// Head configuration of one attention call (DESIGN.md §2).
//   Q   [num_queries, num_qo_heads, head_dim]
//   K,V [num_slots,   num_kv_heads, head_dim]   (slot = one token of the KV pool)
//   O   [num_queries, num_qo_heads, head_dim]   LSE [num_queries, num_qo_heads] (natural log)
// GQA: qo head h reads kv head h / (num_qo_heads / num_kv_heads).
#pragma once
#include <cmath>
#include <string>

#include "core/error.h"

namespace fasttree {

struct AttnShape {
  int num_qo_heads = 32;
  int num_kv_heads = 32;
  int head_dim = 128;

  int gqa() const { return num_qo_heads / num_kv_heads; }
  float default_sm_scale() const { return 1.0f / std::sqrt(static_cast<float>(head_dim)); }
  void validate() const {
    FT_CHECK(num_qo_heads > 0 && num_kv_heads > 0 && head_dim > 0,
             "heads and head_dim must be positive (got " + std::to_string(num_qo_heads) + "/" +
                 std::to_string(num_kv_heads) + ", d=" + std::to_string(head_dim) + ")");
    FT_CHECK(num_qo_heads % num_kv_heads == 0,
             "num_qo_heads " + std::to_string(num_qo_heads) + " is not a multiple of num_kv_heads " +
                 std::to_string(num_kv_heads));
  }
};

}  // namespace fasttree
