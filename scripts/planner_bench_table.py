#!/usr/bin/env python3
"""Turns `planner_bench --benchmark_repetitions=N --benchmark_format=csv` output into the README's
Markdown table (median CPU time per plan, microseconds)."""
import csv
import sys

rows = list(csv.reader(open(sys.argv[1])))
hdr = rows[0]
i_name, i_cpu = hdr.index("name"), hdr.index("cpu_time")
med = {r[i_name][: -len("_median")]: float(r[i_cpu]) for r in rows[1:] if r[i_name].endswith("_median")}
trees, order = {}, []
for name, v in med.items():
    if name.startswith("paper/"):
        tree, heads = name[len("paper/"):].rsplit("|", 1)
        if tree not in trees:
            trees[tree] = {}
            order.append(tree)
        trees[tree][heads] = v
sep = " \\| "
out = ["| tree (nodes per level \\| tokens per node) | heads 32/32 | 32/8 | 16/1 |", "|---|---:|---:|---:|"]
for t in order:
    d = trees[t]
    label = t.replace("|", sep)
    out.append("| `%s` | %.1f | %.1f | %.1f |" % (label, d.get("32/32", 0), d.get("32/8", 0), d.get("16/1", 0)))
rf = med.get("random_forest/4096q")
if rf is not None:
    out.append("| random forest: 4096 queries, ~7000 nodes (heads 32/8) | | %.0f | |" % rf)
print("\n".join(out))
