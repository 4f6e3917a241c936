#!/usr/bin/env python3
"""Bar chart of `fasttree bench --csv` results, normalized like the paper's kernel figure: for each
cell, every method's latency divided by FastTree's (FastTree = 1; higher is slower).

usage: scripts/plot_bench.py bench/results/h200-paper-suite.csv out.png [--dtype fp16]
needs matplotlib (pip install matplotlib)."""
import argparse
import csv
import math

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

METHODS = [
    ("fasttree_us", "FastTree (this project)"),
    ("per_request_us", "per-request (same kernel, no sharing)"),
    ("no_greedy_us", "ablation: no greedy"),
    ("fasttree_triton_us", "paper's Triton kernel"),
    ("sdpa_flash_us", "PyTorch SDPA (flash)"),
    ("pat_us", "PAT"),
]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("csv")
    ap.add_argument("png")
    ap.add_argument("--dtype", default="fp16")
    a = ap.parse_args()
    rows = [r for r in csv.DictReader(open(a.csv)) if r["dtype"] == a.dtype]
    if not rows:
        raise SystemExit(f"{a.csv}: no rows with dtype {a.dtype}")
    labels = [f"{r['nodes_per_level']}\n{r['context_per_level']}\n{r['num_qo_heads']}/{r['num_kv_heads']}" for r in rows]
    fig, ax = plt.subplots(figsize=(max(12, len(rows) * 0.55), 5.5))
    width = 0.8 / len(METHODS)
    for m, (col, name) in enumerate(METHODS):
        ys = []
        for r in rows:
            v, base = r.get(col, ""), float(r["fasttree_us"])
            ys.append(float(v) / base if v not in ("", "nan") and not math.isnan(float(v)) else 0.0)
        ax.bar([i + (m - len(METHODS) / 2 + 0.5) * width for i in range(len(rows))], ys, width, label=name)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_yscale("log")
    ax.set_ylabel("latency / FastTree latency (log)")
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels(labels, fontsize=6)
    ax.set_title(f"H200 decode attention, paper suite, {a.dtype}, head_dim 128 (lower than 1 = faster than FastTree)")
    ax.legend(fontsize=7, ncol=3)
    fig.tight_layout()
    fig.savefig(a.png, dpi=130)


if __name__ == "__main__":
    main()
