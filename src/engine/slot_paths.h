// KvTree (core/kv_tree.h) of a decode batch from each request's context given as a slot path
// (the KV slots of its tokens, root -> newest; the newest is the token being decoded).
//
//   kv_tree_from_paths(paths, kShared)      a compressed trie over slot values: requests whose paths
//                                           start with the same slots share those nodes, so the
//                                           planner can group them (FastTree);
//   kv_tree_from_paths(paths, kPerRequest)  one root node per request holding its whole path (the
//                                           per-request attention baseline: nothing shared).
// Query r sits at the node where path r ends (a node always ends where a path ends, so every
// query's context is exactly its path). An empty path gets a zero-token root node.
// Slots are not range-checked here (validate_tree does that); O(total path tokens).
#pragma once
#include <cstdint>
#include <span>
#include <vector>

#include "core/kv_tree.h"

namespace fasttree {

enum class PathSharing { kShared, kPerRequest };

KvTree kv_tree_from_paths(std::span<const std::vector<int32_t>> paths, PathSharing sharing = PathSharing::kShared);

}  // namespace fasttree
