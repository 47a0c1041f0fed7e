#!/usr/bin/env python3
"""Trains the AttentionPredictor CNN of kvsparse on the real traces (traces/) and writes
src/policy/predictor_weights.safetensors, which the library embeds (the default weights for SmolLM2).

One command, deterministic (fixed seed, one thread, deterministic algorithms), a few minutes on a CPU:

    .venv/bin/python scripts/train_predictor.py [--out FILE] [--epochs N]     # the venv of scripts/setup-python.sh (torch)

The model and its training follow the AttentionPredictor paper (section 4.2, appendix C "Training
Details"), whose reference network is Conv2d 1->16 (3x3, pad 1) + ReLU, Conv2d 16->32 (3x3, pad 1) + ReLU,
average pooling over the time axis, Conv1d 32->1 (1x1): 4833 parameters.

Data. For every (trace, recorded layer, KV head), one *row* per query (the 32 prompt-tail queries, then
every decode step): the exact softmax weights of the group's query heads over every key the query sees,
max-pooled over each block of 16 tokens and over the group (kvsparse keeps one selection per KV head).
An example is (the previous H = 64 rows, zero-padded, as an H x W image -> the next row), with targets
from decode steps only (the paper: "only the attention scores from the decoding phase are used as output
data"; the prompt-tail rows appear as history). The sink and local blocks (first and last 64 tokens),
which the selection always keeps, are cropped from input and output, as the authors' code does.

Training: MSE between predicted and true block scores; Adam, lr 1e-3, 30 epochs, minibatches of 8
examples of one series (same width); the checkpoint with the best attention recovery rate (paper eq. 4:
true attention mass on the tokens selected from the prediction, budget 512) on the validation series is
kept. Split: train on needle_2k and generation_2k, validate on needle_4k, test on document_4k and
needle_8k (never seen). Printed: test recovery at budgets 512/1024/2048 for the predictor and for "last
row" (the most recent history row as the prediction).
"""
import argparse
import copy
import json
import os
import sys

import numpy as np
import torch
import torch.nn as nn
from safetensors.torch import load_file, save_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRACES = os.path.join(ROOT, "traces")
OUT = os.path.join(ROOT, "src", "policy", "predictor_weights.safetensors")
H = 64
BLOCK = 16
SINK = 64
LOCAL = 64
TRAIN = {"needle_2k", "generation_2k"}
VALID = {"needle_4k"}
TEST = {"document_4k", "needle_8k"}


class Predictor(nn.Module):
    """The paper's CNN: input [B, H, W] raw block scores, output [B, W] predicted next-row scores."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.conv3 = nn.Conv1d(32, 1, 1)

    def forward(self, x):
        y = torch.relu(self.conv1(x[:, None]))
        y = torch.relu(self.conv2(y))
        y = y.mean(dim=2)  # average pooling over time: [B, 32, W]
        return self.conv3(y)[:, 0]


def crop(nb):
    """Block range [start, end) the model sees: without the sink and local blocks."""
    return SINK // BLOCK, max(SINK // BLOCK, nb - LOCAL // BLOCK)


def rows_of(trace, layer, manifest):
    """Per KV head: list of (block max scores [nb], token weights [g, n], is_decode)."""
    hq, hk, scale = manifest["num_q_heads"], manifest["num_kv_heads"], manifest["scale"]
    g = hq // hk
    t = trace
    k = t[f"layer{layer}.k"].float()
    qs = torch.cat([t[f"layer{layer}.q_prompt_tail"].float(), t[f"layer{layer}.q"].float()])
    w_tail = t[f"layer{layer}.q_prompt_tail"].shape[0]
    p = k.shape[0] - t[f"layer{layer}.q"].shape[0]
    out = [[] for _ in range(hk)]
    for i in range(qs.shape[0]):
        pos = p - w_tail + i if i < w_tail else p + (i - w_tail)
        n = pos + 1
        nb = (n + BLOCK - 1) // BLOCK
        for h in range(hk):
            q = qs[i, h * g:(h + 1) * g] * scale
            w = torch.softmax((q @ k[:n, h].T).double(), dim=-1).float()
            wp = torch.nn.functional.pad(w, (0, nb * BLOCK - n)).view(g, nb, BLOCK)
            out[h].append((wp.amax(dim=(0, 2)), w, i >= w_tail))
    return out


def history(rows, i, nb):
    """The H rows before row i, cropped to the model's blocks of an nb-block row: [H, W]."""
    s, e = crop(nb)
    x = torch.zeros(H, e - s)
    for j in range(max(0, i - H), i):
        r = rows[j][0][s:e]
        x[H - (i - j), : r.shape[0]] = r
    return x


def select(scores, n, budget):
    """Token mask: first SINK, last LOCAL, then the best whole blocks by `scores` (absolute block index)."""
    keep = torch.zeros(n, dtype=torch.bool)
    keep[: min(SINK, n)] = True
    keep[max(0, n - LOCAL):] = True
    extra = max(0, budget - SINK - LOCAL) // BLOCK
    nb = (n + BLOCK - 1) // BLOCK
    cand = [b for b in range(nb) if not keep[b * BLOCK: min(n, (b + 1) * BLOCK)].all()]
    cand.sort(key=lambda b: (-float(scores[b]), -b))
    for b in cand[:extra]:
        keep[b * BLOCK: min(n, (b + 1) * BLOCK)] = True
    return keep


def full_scores(pred, nb):
    s, e = crop(nb)
    out = torch.full((nb,), float("-inf"))
    out[s:e] = pred[: e - s]
    return out


def recovery(w, keep):
    return float(w[:, keep].sum(dim=1).mean())


def examples_of(series):
    """(x [H, W], target [W], series id, row index) for every decode row with a history."""
    ex = []
    for sid, rows in enumerate(series):
        for i in range(1, len(rows)):
            if not rows[i][2]:
                continue
            nb = rows[i][0].shape[0]
            s, e = crop(nb)
            ex.append((history(rows, i, nb), rows[i][0][s:e].clone(), sid, i))
    return ex


def mean_recovery(model, series, budget, last_row=False):
    rec = []
    with torch.no_grad():
        for rows in series:
            for i in range(1, len(rows)):
                if not rows[i][2]:
                    continue
                nb = rows[i][0].shape[0]
                x = history(rows, i, nb)
                pred = x[-1] if last_row else model(x[None])[0]
                n = rows[i][1].shape[1]
                rec.append(recovery(rows[i][1], select(full_scores(pred, nb), n, budget)))
    return float(np.mean(rec))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=OUT)
    ap.add_argument("--epochs", type=int, default=30)
    args = ap.parse_args()
    torch.manual_seed(0)
    np.random.seed(0)
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    manifest = json.load(open(os.path.join(TRACES, "manifest.json")))
    split = {"train": [], "valid": [], "test": []}
    names = {"test": []}
    for info in manifest["traces"]:
        name = info["file"].replace(".safetensors", "")
        t = load_file(os.path.join(TRACES, info["file"]))
        part = "train" if name in TRAIN else "valid" if name in VALID else "test"
        for layer in info["layers"]:
            for rows in rows_of(t, layer, manifest):
                split[part].append(rows)
                if part == "test":
                    names["test"].append((name, layer))
        print(f"loaded {name} layers {info['layers']} -> {part}", file=sys.stderr)
    train = examples_of(split["train"])
    print(f"{len(train)} training examples (decode steps) from {len(split['train'])} (trace, layer, KV head) series; "
          f"validation {sorted(VALID)}, test {sorted(TEST)}")
    model = Predictor()
    print(f"parameters: {sum(p.numel() for p in model.parameters())}")
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    # Minibatches of up to 8 consecutive examples of one series (one width).
    batches = []
    cur = []
    for e in train:
        if cur and (cur[-1][2] != e[2] or cur[-1][0].shape[1] != e[0].shape[1] or len(cur) == 8):
            batches.append(cur)
            cur = []
        cur.append(e)
    batches.append(cur)
    best = (-1.0, None, -1)
    for epoch in range(args.epochs):
        model.train()
        order = np.random.permutation(len(batches))
        total = 0.0
        for bi in order:
            b = batches[bi]
            x = torch.stack([e[0] for e in b])
            y = torch.stack([e[1] for e in b])
            loss = torch.mean((model(x) - y) ** 2)
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += float(loss.detach()) * len(b)
        model.eval()
        val = mean_recovery(model, split["valid"], 512)
        mark = ""
        if val > best[0]:
            best = (val, copy.deepcopy(model.state_dict()), epoch + 1)
            mark = " (best)"
        print(f"epoch {epoch + 1}: train MSE {total / len(train):.3e}, validation recovery@512 {val:.4f}{mark}", flush=True)
    model.load_state_dict(best[1])
    model.eval()
    print(f"\nkept epoch {best[2]} (validation recovery@512 {best[0]:.4f})")
    print("\ntest recovery (decode steps; sink=64, local=64, block=16, one selection per KV head):")
    print("| trace | budget | predictor | last row |")
    print("|---|---|---|---|")
    summary = {}
    for budget in (512, 1024, 2048):
        for name in sorted(TEST):
            series = [r for r, (nm, _) in zip(split["test"], names["test"]) if nm == name]
            p = mean_recovery(model, series, budget)
            lr = mean_recovery(model, series, budget, last_row=True)
            print(f"| {name} | {budget} | {p:.3f} | {lr:.3f} |")
            summary[f"{name}@{budget}"] = round(p, 4)
    # A check vector for the Rust implementation (tests in src/policy/predictor.rs): 40 raw rows of growing
    # length (the history), the block count of the predicted row and the model's output on its crop.
    g = torch.Generator().manual_seed(1)
    rows = [torch.rand(30 + j // 4, generator=g) ** 8 for j in range(40)]
    nb = 41
    fake = [(r, None, True) for r in rows]
    x = history(fake, len(fake), nb)
    with torch.no_grad():
        check_out = model(x[None])[0]
    check_in = torch.zeros(40, max(r.shape[0] for r in rows))
    for j, r in enumerate(rows):
        check_in[j, : r.shape[0]] = r
    sd = {
        "check.rows": check_in.contiguous(),
        "check.row_len": torch.tensor([float(r.shape[0]) for r in rows]),
        "check.nb": torch.tensor([float(nb)]),
        "check.out": check_out.contiguous(),
    }
    for k, v in model.state_dict().items():
        sd[k] = v.detach().contiguous()
    meta = {"architecture": "conv2d(1,16,3)-relu-conv2d(16,32,3)-relu-mean_t-conv1d(32,1,1)", "history": str(H),
            "block": str(BLOCK), "sink": str(SINK), "local": str(LOCAL), "input": "raw block-max attention",
            "train": ",".join(sorted(TRAIN)), "valid": ",".join(sorted(VALID)), "test": ",".join(sorted(TEST)),
            "kept_epoch": str(best[2]), "test_recovery": json.dumps(summary)}
    save_file(sd, args.out, metadata=meta)
    print(f"\nwrote {args.out} ({os.path.getsize(args.out)} bytes)")


if __name__ == "__main__":
    main()
