#!/usr/bin/env python3
"""Would 8-bit page bounds keep Quest's choice? A study on the committed traces (issue 34: "lower-precision
page bounds (fp8/int8 min/max) if the quality check holds"), before any kernel is written for them.

Quest scores a page by sum_c max(q_c * min_c, q_c * max_c) from the channel-wise key bounds of the page
(docs/policies.md). kvsparse stores the bounds in fp16, min rounded down and max rounded up; the traces'
keys are fp16, so those bounds are exact here. This script rounds the same bounds outward to 8-bit codes
(the score stays an upper bound of every key's q.k in the page, only looser) and compares, per decode step
and query head, the attention mass the chosen pages hold (the softmax over every visible key, in f64) with
the exact bounds' choice, and how many pages the two choices share.

Schemes (per page and KV head, 16-token pages):
  fp16   the bounds as kvsparse stores them today (2 bytes per channel and bound)
  e4m3   FP8 E4M3 with a power-of-two scale per page and head (1 byte per channel and bound + the scale)
  e5m2   FP8 E5M2, likewise
  int8   an affine code per page and head: zero = the page's lowest min, step = (highest max - zero) / 255,
         min codes rounded down, max codes rounded up (1 byte + two fp16 words)

Usage: .venv/bin/python scripts/quest_bounds_precision.py [--budget-frac 16] [--budget 1024] [--traces DIR]
Prints one table row per trace, layer and scheme: mean and 1st-percentile mass recovered, the mean mass
lost against the exact bounds' choice, and the share of pages both choices keep.
"""
import argparse
import json
import math
import pathlib

import numpy as np
from safetensors.numpy import load_file

PAGE = 16


def e4m3_grid():
    vals = [0.0]
    for e in range(16):
        for m in range(8):
            if e == 15 and m == 7:
                continue  # NaN
            v = (m / 8) * 2.0 ** -6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)
            vals.append(v)
    g = np.array(sorted(set(vals)))
    return np.concatenate([-g[::-1], g[1:]])


def e5m2_grid():
    vals = [0.0]
    for e in range(31):
        for m in range(4):
            v = (m / 4) * 2.0 ** -14 if e == 0 else (1 + m / 4) * 2.0 ** (e - 15)
            vals.append(v)
    g = np.array(sorted(set(vals)))
    return np.concatenate([-g[::-1], g[1:]])


def round_to_grid(x, grid, up):
    """x (any shape) rounded to the sorted grid, toward +inf (up) or -inf; x must lie within the grid."""
    i = np.searchsorted(grid, x, side="left" if up else "right")
    if up:
        return grid[np.minimum(i, len(grid) - 1)]
    return grid[np.maximum(i - 1, 0)]


def fp8_bounds(mn, mx, grid):
    """mn, mx: [pages, heads, d] f64. A power-of-two scale per page and head brings the largest |bound|
    into the grid's range; min rounded down, max rounded up."""
    top = np.maximum(np.abs(mn).max(-1), np.abs(mx).max(-1))  # [pages, heads]
    e = np.where(top > 0, np.ceil(np.log2(np.maximum(top, 1e-30) / grid[-1])), 0.0)
    s = (2.0 ** e)[..., None]
    return round_to_grid(mn / s, grid, up=False) * s, round_to_grid(mx / s, grid, up=True) * s


def int8_bounds(mn, mx):
    lo = mn.min(-1, keepdims=True)
    hi = mx.max(-1, keepdims=True)
    step = np.where(hi > lo, (hi - lo) / 255.0, 1.0)
    cmn = np.clip(np.floor((mn - lo) / step), 0, 255)
    cmx = np.clip(np.ceil((mx - lo) / step), 0, 255)
    return lo + cmn * step, lo + cmx * step


def page_bounds(k, n):
    """k: [positions, heads, d]; bounds of the pages covering positions 0..n-1."""
    np_ = (n + PAGE - 1) // PAGE
    pad = np_ * PAGE - n
    kk = k[:n].astype(np.float64)
    mn = np.concatenate([kk, np.full((pad,) + kk.shape[1:], np.inf)]).reshape(np_, PAGE, *kk.shape[1:]).min(1)
    mx = np.concatenate([kk, np.full((pad,) + kk.shape[1:], -np.inf)]).reshape(np_, PAGE, *kk.shape[1:]).max(1)
    return mn, mx


def quest_pages(q_group, mn, mx, k_pages):
    """q_group: [g, d]; mn, mx: [pages, d]. The decode token's page and the best k_pages - 1 others
    (ties: the later page)."""
    s = np.maximum(q_group[:, None, :] * mn[None], q_group[:, None, :] * mx[None]).sum(-1).max(0)  # [pages]
    npg = len(s)
    if npg <= k_pages:
        return np.arange(npg)
    cand = np.arange(npg - 1)
    order = np.lexsort((-cand, -s[:-1]))  # score descending, later page first
    return np.sort(np.concatenate([cand[order[: k_pages - 1]], [npg - 1]]))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--traces", default="traces")
    ap.add_argument("--budget-frac", type=int, default=16, help="budget = context / N tokens (default 16)")
    ap.add_argument("--budget", type=int, default=0, help="a fixed budget in tokens instead")
    a = ap.parse_args()
    root = pathlib.Path(a.traces)
    man = json.loads((root / "manifest.json").read_text())
    hq, hk, scale = man["num_q_heads"], man["num_kv_heads"], man["scale"]
    g = hq // hk
    grids = {"e4m3": e4m3_grid(), "e5m2": e5m2_grid()}
    print(f"{'trace':<22} {'layer':>5} {'budget':>6} {'scheme':<6} {'mass mean':>9} {'mass p1':>8} {'lost vs fp16':>12} {'pages shared':>12}")
    for t in man["traces"]:
        data = load_file(str(root / t["file"]))
        budget = a.budget or t["context"] // a.budget_frac
        kp = math.ceil(budget / PAGE)
        for layer in t["layers"]:
            k = data[f"layer{layer}.k"]
            qs = data[f"layer{layer}.q"].astype(np.float64)
            res = {name: ([], [], []) for name in ("fp16", "e4m3", "e5m2", "int8")}
            for step in range(qs.shape[0]):
                n = t["prompt_len"] + step + 1
                if n > k.shape[0]:
                    break
                mn, mx = page_bounds(k, n)
                kk = k[:n].astype(np.float64)
                variants = {"fp16": (mn, mx), "int8": int8_bounds(mn, mx)}
                for name, grid in grids.items():
                    variants[name] = fp8_bounds(mn, mx, grid)
                for h in range(hk):
                    qg = qs[step, h * g:(h + 1) * g]
                    logits = scale * qg @ kk[:, h].T  # [g, n]
                    p = np.exp(logits - logits.max(1, keepdims=True))
                    p /= p.sum(1, keepdims=True)
                    page_mass = np.add.reduceat(p, np.arange(0, n, PAGE), axis=1)  # [g, pages]
                    ref = None
                    for name in ("fp16", "e4m3", "e5m2", "int8"):
                        vmn, vmx = variants[name]
                        sel = quest_pages(qg, vmn[:, h], vmx[:, h], kp)
                        mass = page_mass[:, sel].sum(1)
                        if name == "fp16":
                            ref = (set(sel.tolist()), mass)
                        res[name][0].extend(mass.tolist())
                        res[name][1].extend((ref[1] - mass).tolist())
                        res[name][2].append(len(ref[0] & set(sel.tolist())) / len(ref[0]))
            for name, (mass, lost, shared) in res.items():
                m = np.array(mass)
                print(f"{t['file'].split('.')[0]:<22} {layer:>5} {budget:>6} {name:<6} {m.mean():9.4f} {np.percentile(m, 1):8.4f} {np.mean(lost):12.5f} {np.mean(shared):12.4f}")


if __name__ == "__main__":
    main()
