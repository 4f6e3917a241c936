// build_kv_tree: RadixCache + live requests -> KvTree (see cache_tree.h).
#include "core/cache_tree.h"

#include <string>

#include "core/error.h"

namespace fasttree {

KvTree build_kv_tree(const RadixCache& cache, std::span<const LiveRequest> requests,
                     std::vector<NodeId>* tree_to_cache) {
  const int32_t capacity = cache.pool().capacity();
  for (size_t r = 0; r < requests.size(); ++r) {
    const LiveRequest& req = requests[r];
    FT_CHECK(cache.is_valid(req.node), "build_kv_tree: request " + std::to_string(r) + " names invalid cache node " +
                                           std::to_string(req.node));
    for (int32_t s : req.tail_slots)
      FT_CHECK(s >= 0 && s < capacity, "build_kv_tree: request " + std::to_string(r) + " has tail slot " +
                                           std::to_string(s) + " out of range [0, " + std::to_string(capacity) + ")");
  }

  KvTree tree;
  std::vector<int32_t> cache_to_tree(static_cast<size_t>(cache.node_id_bound()), -1);
  std::vector<NodeId> path;  // unmapped part of one request's path, deepest first
  if (tree_to_cache) tree_to_cache->clear();

  // Cache nodes: for each request, add the not-yet-added part of its path top-down.
  for (const LiveRequest& req : requests) {
    path.clear();
    for (NodeId v = req.node; v != kRootNode && cache_to_tree[v] < 0; v = cache.node_parent(v)) path.push_back(v);
    for (auto it = path.rbegin(); it != path.rend(); ++it) {
      const NodeId v = *it;
      const NodeId p = cache.node_parent(v);
      const int parent_tree = p == kRootNode ? -1 : cache_to_tree[p];
      cache_to_tree[v] = tree.add_node(parent_tree, cache.node_slots(v));
      if (tree_to_cache) tree_to_cache->push_back(v);
    }
  }
  // Tail nodes and queries, in request order.
  for (const LiveRequest& req : requests) {
    const int parent_tree = req.node == kRootNode ? -1 : cache_to_tree[req.node];
    const int tail = tree.add_node(parent_tree, std::span<const int32_t>(req.tail_slots));
    if (tree_to_cache) tree_to_cache->push_back(kNoNode);
    tree.add_query(tail);
  }
  return tree;
}

}  // namespace fasttree
