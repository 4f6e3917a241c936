#include "engine/slot_paths.h"

#include <unordered_map>

namespace fasttree {

KvTree kv_tree_from_paths(std::span<const std::vector<int32_t>> paths, PathSharing sharing) {
  KvTree tree;
  if (sharing == PathSharing::kPerRequest) {
    for (const std::vector<int32_t>& p : paths) tree.add_query(tree.add_node(-1, std::span<const int32_t>(p)));
    return tree;
  }
  // Uncompressed trie: one entry per distinct (parent entry, slot); entries are created parents first.
  struct Entry {
    int32_t slot;
    int32_t parent;        // -1 at the top level
    int32_t children = 0;
    bool path_end = false;
    int32_t segment = -1;  // KvTree node the entry's token lands in
  };
  std::vector<Entry> trie;
  std::unordered_map<uint64_t, int32_t> child;  // (parent + 1) << 32 | slot -> entry
  std::vector<int32_t> end_entry(paths.size(), -1);
  for (size_t r = 0; r < paths.size(); ++r) {
    int32_t cur = -1;
    for (int32_t s : paths[r]) {
      const uint64_t key = (static_cast<uint64_t>(static_cast<uint32_t>(cur + 1)) << 32) | static_cast<uint32_t>(s);
      auto [it, inserted] = child.emplace(key, static_cast<int32_t>(trie.size()));
      if (inserted) {
        trie.push_back({s, cur});
        if (cur >= 0) ++trie[cur].children;
      }
      cur = it->second;
    }
    end_entry[r] = cur;
    if (cur >= 0) trie[cur].path_end = true;
  }
  // Segments: an entry continues its parent's node iff the parent has one child and no path ends there.
  std::vector<int32_t> seg_parent;
  std::vector<std::vector<int32_t>> seg_slots;
  for (Entry& e : trie) {
    const bool continues = e.parent >= 0 && trie[e.parent].children == 1 && !trie[e.parent].path_end;
    if (continues) {
      e.segment = trie[e.parent].segment;
    } else {
      e.segment = static_cast<int32_t>(seg_slots.size());
      seg_parent.push_back(e.parent >= 0 ? trie[e.parent].segment : -1);
      seg_slots.emplace_back();
    }
    seg_slots[e.segment].push_back(e.slot);
  }
  for (size_t s = 0; s < seg_slots.size(); ++s) tree.add_node(seg_parent[s], std::span<const int32_t>(seg_slots[s]));
  int empty_root = -1;
  for (size_t r = 0; r < paths.size(); ++r) {
    if (end_entry[r] >= 0) {
      tree.add_query(trie[end_entry[r]].segment);
    } else {
      if (empty_root < 0) empty_root = tree.add_node(-1, std::span<const int32_t>());
      tree.add_query(empty_root);
    }
  }
  return tree;
}

}  // namespace fasttree
