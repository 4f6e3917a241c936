#!/usr/bin/env python3
"""Markdown summary of `fasttree bench --csv` (the README's performance table).

usage: scripts/bench_table.py bench/results/h200-paper-suite.csv"""
import csv
import math
import sys


def geomean(xs):
    xs = [x for x in xs if x > 0 and not math.isnan(x)]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


def main():
    rows = list(csv.DictReader(open(sys.argv[1])))
    # fasttree_dirty_flush_us (since the twenty-seventh session): FastTree under the earlier harness's
    # memset flush, beside fasttree_us under the CSV's l2_mode.
    dirty = all(r.get("fasttree_dirty_flush_us") not in (None, "", "nan") for r in rows)
    by = {}
    for r in rows:
        by.setdefault((r["nodes_per_level"], r["context_per_level"], r["num_qo_heads"], r["num_kv_heads"]), {})[r["dtype"]] = r
    print("| tree: nodes per level / tokens per node | heads | floor µs | FastTree fp16 | bf16 | per-request | no greedy | no split "
          + ("| fp16, memset flush " if dirty else "") + "| best anchor | vs best anchor | × floor |")
    print("|---|---|---:|---:|---:|---:|---:|---:|" + ("---:|" if dirty else "") + "---:|---:|---:|")
    f = lambda x: float(x) if x not in ("", "nan") else float("nan")
    for (nodes, ctx, hq, hkv), d in by.items():
        a = d.get("fp16") or next(iter(d.values()))
        b = d.get("bf16")
        ft = f(a["fasttree_us"])
        best = f(a["best_anchor_us"])
        speed = best / ft if ft > 0 else float("nan")
        mark = "" if math.isnan(speed) or speed >= 1 else " ✗"
        print(f"| `{nodes}` / `{ctx}` | {hq}/{hkv} | {f(a['floor_us']):.1f} | {ft:.1f} | "
              f"{f(b['fasttree_us']) if b else float('nan'):.1f} | {f(a['per_request_us']):.1f} | {f(a['no_greedy_us']):.1f} | "
              f"{f(a['no_split_us']):.1f} | " + (f"{f(a['fasttree_dirty_flush_us']):.1f} | " if dirty else "") +
              f"{best:.1f} | {speed:.2f}×{mark} | {ft / f(a['floor_us']):.2f} |")
    for dt in ("fp16", "bf16"):
        sel = [r for r in rows if r["dtype"] == dt]
        if not sel:
            continue
        over = geomean([f(r["fasttree_us"]) / f(r["floor_us"]) for r in sel])
        vs_best = geomean([f(r["best_anchor_us"]) / f(r["fasttree_us"]) for r in sel])
        vs_pr = geomean([f(r["per_request_us"]) / f(r["fasttree_us"]) for r in sel])
        wins = sum(1 for r in sel if f(r["fasttree_us"]) < f(r["best_anchor_us"]))
        mode = sel[0].get("l2_mode") or "dirty"
        print(f"\n{dt} (L2 mode {mode}): geomean FastTree / floor = {over:.2f} over {len(sel)} cells; geomean speedup vs "
              f"best anchor {vs_best:.2f}× (faster on {wins} of {len(sel)} cells); vs per-request {vs_pr:.2f}×.")
        if dirty and mode != "dirty":
            d_over = geomean([f(r["fasttree_dirty_flush_us"]) / f(r["floor_us"]) for r in sel])
            d_best = geomean([f(r["best_anchor_us"]) / f(r["fasttree_dirty_flush_us"]) for r in sel])
            d_wins = sum(1 for r in sel if f(r["fasttree_dirty_flush_us"]) < f(r["best_anchor_us"]))
            print(f"{dt} (memset flush, the harness before the twenty-seventh session): geomean FastTree / floor = "
                  f"{d_over:.2f}; geomean speedup vs best anchor {d_best:.2f}× (faster on {d_wins} of {len(sel)} cells).")


if __name__ == "__main__":
    main()
