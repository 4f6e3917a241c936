// Tree generators and small helpers for trees built from command-line specs (DESIGN.md §5).
//   tree_from_levels: the paper's level trees (--levels 1,16,64 --lens 1024,256,32). Nodes are
//     numbered level by level; child j of level i > 0 hangs under node (j * counts[i-1]) / counts[i]
//     of level i-1; every node of level i holds lens[i] tokens in implicit consecutive slots; one
//     query per node of the last level, in node order.
//   random_forest: deterministic random forests (std::mt19937_64) for property tests. Nodes are
//     numbered breadth-first (parents before children); every leaf holds 1..max_queries_per_leaf
//     queries, an internal node holds 1..max_queries_per_leaf with probability internal_query_prob;
//     queries are listed in node order unless shuffle_queries. The result passes validate_tree.
#pragma once
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "core/kv_tree.h"

namespace fasttree {

// "1,16,64" -> {1, 16, 64}; spaces around items are allowed. Throws naming `what` on an empty
// item, a non-number or a negative value.
std::vector<int64_t> parse_int_list(std::string_view text, const std::string& what);

KvTree tree_from_levels(std::span<const int64_t> counts, std::span<const int64_t> lens);

struct RandomForestSpec {
  int min_roots = 1, max_roots = 3;
  int max_depth = 4;   // levels, a root alone is depth 1
  int max_fanout = 4;  // children per node uniform in [0, max_fanout] (a root above depth 1: >= 1)
  int64_t min_len = 0, max_len = 64;  // tokens per non-empty node, uniform
  double empty_node_prob = 0.1;       // probability of a zero-token node
  int max_queries_per_leaf = 3;
  double internal_query_prob = 0.2;
  bool explicit_slots = false;  // shuffled unique slots from a pool about twice the token count
  bool shuffle_queries = false;  // list queries in random order instead of node order
};

KvTree random_forest(const RandomForestSpec& spec, uint64_t seed);

// Number of slots the K/V tensors must have: 1 + the largest slot used (0 for a tree without tokens).
int64_t max_slot_plus_one(const KvTree& tree);

}  // namespace fasttree
