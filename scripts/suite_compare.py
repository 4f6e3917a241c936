#!/usr/bin/env python3
"""Side-by-side fp16 paper-suite times of several `fasttree bench --suite paper` CSVs.

usage: suite_compare.py A.csv B.csv ...   (labels = file names)
Prints per cell: floor, best anchor, each CSV's fasttree_us (and max_rel_err when above 1e-3), then
per CSV the geomean of fasttree/floor, of fasttree/best_anchor and the cells faster than their anchor.
"""
import csv, math, os, sys

runs = [(os.path.basename(p).replace('.csv', ''), {(r['nodes_per_level'], r['context_per_level'], r['num_qo_heads'], r['num_kv_heads']): r
         for r in csv.DictReader(open(p)) if r['dtype'] == 'fp16'}) for p in sys.argv[1:]]
keys = list(runs[0][1].keys())
print(f"{'cell':42s} {'heads':6s} {'floor':>7s} {'anchor':>7s} " + " ".join(f"{l[:10]:>10s}" for l, _ in runs))
for k in keys:
    r0 = runs[0][1][k]
    name = (k[0] + '|' + k[1])[:42]
    vals = []
    for _, rs in runs:
        r = rs.get(k)
        vals.append(f"{float(r['fasttree_us']):10.1f}" if r else f"{'-':>10s}")
    print(f"{name:42s} {k[2] + '/' + k[3]:6s} {float(r0['floor_us']):7.1f} {float(r0['best_anchor_us']):7.1f} " + " ".join(vals))
for label, rs in runs:
    rows = [rs[k] for k in keys if k in rs]
    g = math.exp(sum(math.log(float(r['fasttree_us']) / float(r['floor_us'])) for r in rows) / len(rows))
    a = math.exp(sum(math.log(float(r['fasttree_us']) / float(r['best_anchor_us'])) for r in rows) / len(rows))
    beat = sum(float(r['fasttree_us']) < float(r['best_anchor_us']) for r in rows)
    err = max(float(r['max_rel_err']) for r in rows)
    print(f"{label:24s} geomean x floor {g:5.2f}  time / best anchor {a:5.3f}  faster than anchor {beat}/{len(rows)}  max rel err {err:.1e}")
