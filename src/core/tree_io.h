// Tree file formats (DESIGN.md §5). Every reader validates the tree (validate_tree) and throws
// fasttree::Error messages that start with the source name and name the node / field at fault.
//
// Tree JSON:
//   {"nodes": [{"parent": -1, "len": 4000}, {"parent": 0, "len": 3, "slots": [7, 8, 9]}],
//    "queries": [1, 1, 0]}
//   - "slots" (optional) holds exactly "len" KV-pool slots; without it node i's tokens occupy the
//     consecutive slots right after the last slot stored so far (KvTree::add_node(parent, len)).
//   - "queries" (optional) lists the node of every query; without it, one query per leaf (node
//     without children), leaves in node order. Unknown extra keys are ignored.
//   tree_to_json writes "slots" only where they differ from the implicit ones, always "queries".
//
// Artifact text format (the paper's tool): first line n, then n lines "parent id seqlen num_children"
// with id = 0..n-1 in order and parent -1 for a root. Slots are implicit, one query per leaf. The
// text form keeps only structure and lengths: tree_to_text drops explicit slots and queries.
#pragma once
#include <string>
#include <string_view>

#include "core/kv_tree.h"

namespace fasttree {

KvTree parse_tree_json(std::string_view text, const std::string& source_name);
KvTree read_tree_json(const std::string& path);
std::string tree_to_json(const KvTree& tree);
void write_tree_json(const std::string& path, const KvTree& tree);

KvTree parse_tree_text(std::string_view text, const std::string& source_name);
KvTree read_tree_text(const std::string& path);
std::string tree_to_text(const KvTree& tree);
void write_tree_text(const std::string& path, const KvTree& tree);

// JSON when the file's first non-space character is '{', otherwise the artifact text format.
KvTree load_tree(const std::string& path);

}  // namespace fasttree
