// Bridge from the radix prefix cache to the planner: builds the KvTree (core/kv_tree.h) of a
// decode batch from the live requests' cached prefixes and private tails.
#pragma once
#include <cstdint>
#include <span>
#include <vector>

#include "core/kv_tree.h"
#include "core/radix_cache.h"

namespace fasttree {

// A live request: its cached prefix is the path root -> `node` of the RadixCache (kRootNode when
// nothing is cached; the node should be locked while the request lives), and it privately owns
// the KV slots of the tokens after that prefix (`tail_slots`, possibly empty).
struct LiveRequest {
  NodeId node = kRootNode;
  std::vector<int32_t> tail_slots;
};

// Builds the KvTree for `requests`:
//   * tree nodes [0, C): one per cache node on the union of the requests' root -> node paths, the
//     cache root (empty key) omitted so top-level cache nodes become tree roots (a forest),
//     parents before children, each with the cache node's slots;
//   * tree nodes [C, C + R): request r's tail node C + r, a child of its cache node's tree node
//     (a root when the request sits at the cache root), holding tail_slots (may be empty);
//   * query r at tail node C + r, queries in request order.
// Query r's context is thus its cached prefix slots followed by its tail slots. When
// tree_to_cache is given it receives, per tree node, its cache NodeId (kNoNode for tail nodes).
// Throws if a request names an invalid node or a tail slot outside the cache's pool.
KvTree build_kv_tree(const RadixCache& cache, std::span<const LiveRequest> requests,
                     std::vector<NodeId>* tree_to_cache = nullptr);

}  // namespace fasttree
