// validate_plan(plan, tree): proves that executing `plan` computes exact attention for `tree`:
// every query covers every token of its root->node path exactly once across its work items,
// partial rows are written by exactly one (item, query) and merged exactly once, direct queries
// are covered by a single item. Throws fasttree::Error describing the first violation.
#pragma once
#include "core/kv_tree.h"
#include "plan/plan.h"

namespace fasttree {

void validate_plan(const Plan& plan, const KvTree& tree);

}  // namespace fasttree
