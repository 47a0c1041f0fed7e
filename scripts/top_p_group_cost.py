#!/usr/bin/env python3
"""Twilight's top-p set per KV head (kvsparse: one kept set shared by the GQA group, the smallest threshold
set {j : max_h w_hj >= t} in which every query head keeps >= p of its mass) against per-query-head sets
(each head's own smallest top-p set), on every decode step of the committed traces, with exact softmax
weights over all keys (top_p alone, no base selector). Prints the mean set sizes in tokens:
  per KV head | per query head (mean over the group) | union of the group's per-head sets.
The per-KV-head set is what a GQA kernel reads once for the group; the per-query-head sets are the
paper's (one budget per head).

    .venv/bin/python scripts/top_p_group_cost.py [--p 0.95]     # the venv of scripts/setup-python.sh (numpy, safetensors)
"""
import argparse
import json
import os

import numpy as np
from safetensors.numpy import load_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def head_set_size(w, p):
    s = np.sort(w)[::-1]
    return int(np.searchsorted(np.cumsum(s), p * s.sum()) + 1)


def group_set_size(w, p):
    """Smallest k such that the k heaviest tokens by max-over-group weight hold >= p of every head's mass."""
    agg = w.max(axis=0)
    order = np.argsort(-agg, kind="stable")
    cum = np.cumsum(w[:, order], axis=1)  # [g, n]
    need = [int(np.searchsorted(cum[h], p * cum[h, -1]) + 1) for h in range(w.shape[0])]
    return max(need)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--p", type=float, default=0.95)
    a = ap.parse_args()
    m = json.load(open(os.path.join(ROOT, "traces", "manifest.json")))
    hq, hk, scale = m["num_q_heads"], m["num_kv_heads"], m["scale"]
    g = hq // hk
    print(f"p = {a.p}; exact weights; decode steps of every trace and recorded layer")
    print("| trace | rows | context | per KV head | per query head (mean) | union of the group's sets | KV head / per-head mean |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    tot = np.zeros(3)
    nrows = 0
    for info in m["traces"]:
        t = load_file(os.path.join(ROOT, "traces", info["file"]))
        p = info["prompt_len"]
        sizes = []
        for layer in info["layers"]:
            k = t[f"layer{layer}.k"].astype(np.float64)
            q = t[f"layer{layer}.q"].astype(np.float64)
            for step in range(q.shape[0]):
                n = p + step + 1
                for h in range(hk):
                    qs = q[step, h * g:(h + 1) * g] * scale
                    lg = qs @ k[:n, h].T
                    w = np.exp(lg - lg.max(axis=1, keepdims=True))
                    w /= w.sum(axis=1, keepdims=True)
                    per = [head_set_size(w[i], a.p) for i in range(g)]
                    union = set()
                    for i in range(g):
                        order = np.argsort(-w[i], kind="stable")[: per[i]]
                        union.update(order.tolist())
                    sizes.append((group_set_size(w, a.p), np.mean(per), len(union)))
        s = np.array(sizes)
        mean = s.mean(axis=0)
        tot += s.sum(axis=0)
        nrows += len(s)
        print(f"| {info['file'].replace('.safetensors', '')} | {len(s)} | {p} | {mean[0]:.1f} | {mean[1]:.1f} | {mean[2]:.1f} | {mean[0] / mean[1]:.2f}x |")
    mean = tot / nrows
    print(f"| all | {nrows} | | {mean[0]:.1f} | {mean[1]:.1f} | {mean[2]:.1f} | {mean[0] / mean[1]:.2f}x |")


if __name__ == "__main__":
    main()
