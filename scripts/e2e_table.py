#!/usr/bin/env python3
"""Markdown summary of `fasttree bench-e2e --csv` (the README's end-to-end table): per workload and
model, FastTree vs per-request throughput and speedup, FastTree's decode step split, planner share and
distance to the step floor; then each model's average speedup against its target (the issue's targets
are averages over the workloads: >= 1.6x llama2-7b, >= 1.9x mistral-7b).
When a (workload, preset, attention) appears in several rows, the last row wins (re-runs append).

usage: scripts/e2e_table.py bench/results/h200-e2e.csv"""
import csv
import math
import sys

TARGETS = {"llama2-7b": 1.6, "mistral-7b": 1.9}


def num(x):
    try:
        return float(x)
    except (TypeError, ValueError):
        return float("nan")


def fmt(x, digits=1):
    return "–" if math.isnan(x) else f"{x:.{digits}f}"


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    rows = list(csv.DictReader(open(sys.argv[1], newline="")))
    if not rows:
        sys.exit(f"{sys.argv[1]}: no rows")
    last = {}
    order = []
    for r in rows:
        key = (r["workload"], r["preset"])
        if key not in order:
            order.append(key)
        last[key + (r["attention"],)] = r
    print("| workload | model | batch | FastTree tok/s | per-request tok/s | speedup | step ms | attention ms | GEMM ms | rest ms "
          "| planner % of step | cache hit | floor ms | × floor |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    speedups = {}
    for wl, preset in sorted(order):
        ft = last.get((wl, preset, "fasttree"))
        pr = last.get((wl, preset, "per-request"))
        a = ft or pr
        ft_tps = num(ft["tokens_per_s"]) if ft else float("nan")
        pr_tps = num(pr["tokens_per_s"]) if pr else float("nan")
        speed = ft_tps / pr_tps if pr_tps > 0 else float("nan")
        if not math.isnan(speed):
            speedups.setdefault(preset, []).append(speed)
        print(f"| {wl} | {preset} | {fmt(num(a['mean_batch']))} | {fmt(ft_tps)} | {fmt(pr_tps)} | "
              f"{fmt(speed, 2)}× | {fmt(num(a['decode_step_ms']), 2)} | {fmt(num(a['attention_ms']), 2)} | "
              f"{fmt(num(a['gemm_ms']), 2)} | {fmt(num(a['rest_ms']), 2)} | {fmt(100 * num(a['plan_share']), 2)} | "
              f"{fmt(num(a['cache_hit_rate']), 3)} | {fmt(num(a['floor_step_ms']), 2)} | {fmt(num(a['step_vs_floor']), 2)} |")
    print()
    for preset, sp in sorted(speedups.items()):
        mean = sum(sp) / len(sp)
        target = TARGETS.get(preset)
        verdict = "" if target is None else f" (target {target}×: {'met' if mean >= target else 'missed'})"
        print(f"- {preset}: average FastTree / per-request speedup {mean:.2f}× over {len(sp)} workloads{verdict}")
    commits = sorted({r["commit"] for r in rows})
    print(f"\nStep, split, planner share, hit rate and floor columns are FastTree's (per-request's when FastTree is absent); "
          f"commit{'s' if len(commits) > 1 else ''} {', '.join(commits)}.")


if __name__ == "__main__":
    main()
