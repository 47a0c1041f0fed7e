#!/usr/bin/env python3
"""Trains the AttentionPredictor CNN of kvsparse on the real traces (traces/) and writes
src/policy/predictor_weights.safetensors, which the library embeds.

One command, deterministic (fixed seed, one thread, deterministic algorithms):

    /work/venv/bin/python scripts/train_predictor.py

Data. For every (trace, recorded layer, KV head), one *row* per query (the 32 prompt-tail queries, then
every decode step): the exact softmax weights of the query heads of the KV head's group over all keys it
sees, block-pooled with max (over the block's tokens and the group's query heads) -> block scores. A
training example is (history of the previous H rows, the next row's true block masses).

Model (the one `policy::predictor` runs): input x[t, b] = (ln(s + 1e-6) + 13.8155) / 13.8155 for the H
most recent rows (oldest first; missing rows and blocks are 0), as a 1-channel H x N image;
conv 3x3 1->8 (pad 1) + ReLU; conv 3x3 8->8 (pad 1) + ReLU; conv 1x1 8->1; then a learned temporal
mix over the H rows: score[b] = sum_t u[t] * y[t, b] + c. Loss: cross-entropy between the true next-row
block-mass distribution (mean over the group's query heads) and softmax(score).

Held out: document_4k and needle_8k (never seen in training). Printed: recovery (true attention mass on
the chosen tokens, mean over query heads and steps) on the held-out traces at budgets 512/1024/2048 with
sink=64, local=64, block=16, for the predictor and for "last row" (the history's most recent row as the
prediction), evaluated on decode steps only.
"""
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
C = 8
EPS = 1e-6
LOG_EPS = -np.log(EPS)  # 13.8155
HELD_OUT = {"document_4k", "needle_8k"}


def feature(s):
    return (torch.log(s + EPS) + LOG_EPS) / LOG_EPS


class Predictor(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, C, 3, padding=1)
        self.conv2 = nn.Conv2d(C, C, 3, padding=1)
        self.conv3 = nn.Conv2d(C, 1, 1)
        t = torch.zeros(H)
        t[-1] = 1.0
        self.temporal = nn.Parameter(t)
        self.temporal_bias = nn.Parameter(torch.zeros(1))

    def forward(self, x):  # x [B, H, N]
        y = torch.relu(self.conv1(x[:, None]))
        y = torch.relu(self.conv2(y))
        y = self.conv3(y)[:, 0]  # [B, H, N]
        return torch.einsum("bhn,h->bn", y, self.temporal) + self.temporal_bias


def rows_of(trace, layer, manifest):
    """Per KV head: list of (block max scores [nb], block masses per query head [g, nb], positions n)."""
    hq, hk, d, scale = manifest["num_q_heads"], manifest["num_kv_heads"], manifest["head_dim"], manifest["scale"]
    g = hq // hk
    t = trace
    k = t[f"layer{layer}.k"].float()  # [P+T, hk, d]
    qs = torch.cat([t[f"layer{layer}.q_prompt_tail"].float(), t[f"layer{layer}.q"].float()])  # [W+T, hq, d]
    w_tail = t[f"layer{layer}.q_prompt_tail"].shape[0]
    total = k.shape[0]
    p = total - t[f"layer{layer}.q"].shape[0]
    out = [[] for _ in range(hk)]
    for i in range(qs.shape[0]):
        pos = p - w_tail + i if i < w_tail else p + (i - w_tail)
        n = pos + 1
        nb = (n + BLOCK - 1) // BLOCK
        pad = nb * BLOCK - n
        for h in range(hk):
            q = qs[i, h * g:(h + 1) * g] * scale  # [g, d]
            logits = q @ k[:n, h].T  # [g, n]
            w = torch.softmax(logits.double(), dim=-1).float()
            wp = torch.nn.functional.pad(w, (0, pad)).view(g, nb, BLOCK)
            smax = wp.amax(dim=(0, 2))
            mass = wp.sum(dim=2)
            out[h].append((smax, mass, w, i >= w_tail))
    return out


def history(rows, i):
    """Input image of the H rows before row i, [H, nb of row i]."""
    nb = rows[i][0].shape[0]
    x = torch.zeros(H, nb)
    for j in range(max(0, i - H), i):
        s = rows[j][0]
        x[H - (i - j), : s.shape[0]] = feature(s)
    return x


def select(scores, n, budget, sink=64, local=64):
    """Token mask of the selection: first `sink`, last `local`, then the best whole blocks."""
    keep = torch.zeros(n, dtype=torch.bool)
    keep[: min(sink, n)] = True
    keep[max(0, n - local):] = True
    extra = max(0, budget - sink - local) // BLOCK
    nb = (n + BLOCK - 1) // BLOCK
    cand = [b for b in range(nb) if not keep[b * BLOCK: min(n, (b + 1) * BLOCK)].all()]
    cand.sort(key=lambda b: (-float(scores[b]), -b))
    for b in cand[:extra]:
        keep[b * BLOCK: min(n, (b + 1) * BLOCK)] = True
    return keep


def recovery(w, keep):
    return float(w[:, keep].sum(dim=1).mean())


def main():
    torch.manual_seed(0)
    np.random.seed(0)
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    manifest = json.load(open(os.path.join(TRACES, "manifest.json")))
    train, held = [], []
    for info in manifest["traces"]:
        name = info["file"].replace(".safetensors", "")
        t = load_file(os.path.join(TRACES, info["file"]))
        for layer in info["layers"]:
            for rows in rows_of(t, layer, manifest):
                (held if name in HELD_OUT else train).append((name, layer, rows))
        print(f"loaded {name} layers {info['layers']}", file=sys.stderr)
    examples = []
    for _, _, rows in train:
        for i in range(1, len(rows)):
            masses = rows[i][1].mean(dim=0)
            examples.append((history(rows, i), masses / masses.sum()))
    print(f"{len(examples)} training examples from {len(train)} (trace, layer, head) series; held out: {sorted(HELD_OUT)}")
    model = Predictor()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    order = np.arange(len(examples))
    for epoch in range(30):
        np.random.shuffle(order)
        total = 0.0
        for idx in order:
            x, target = examples[idx]
            logp = torch.log_softmax(model(x[None])[0], dim=0)
            loss = -(target * logp).sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += float(loss.detach())
        if epoch % 5 == 4:
            print(f"epoch {epoch + 1}: mean train loss {total / len(examples):.4f}")
    model.eval()
    print()
    print("held-out recovery (decode steps; sink=64, local=64, block=16):")
    print("| trace | layer | budget | predictor | last row |")
    print("|---|---|---|---|---|")
    summary = {}
    with torch.no_grad():
        for budget in (512, 1024, 2048):
            for name in sorted(HELD_OUT):
                series = [(l, r) for (nm, l, r) in held if nm == name]
                rec_p, rec_l = [], []
                for _, rows in series:
                    for i in range(1, len(rows)):
                        if not rows[i][3]:
                            continue
                        x = history(rows, i)
                        n = rows[i][2].shape[1]
                        pred = model(x[None])[0]
                        rec_p.append(recovery(rows[i][2], select(pred, n, budget)))
                        rec_l.append(recovery(rows[i][2], select(x[-1], n, budget)))
                print(f"| {name} | {series[0][0]} | {budget} | {np.mean(rec_p):.3f} | {np.mean(rec_l):.3f} |")
                summary[(name, budget)] = np.mean(rec_p)
    # A check vector for the Rust implementation (tests in src/policy/predictor.rs): a history of 40 rows
    # of 37 blocks (the most recent rows longer), and the model's output for 39 blocks.
    g = torch.Generator().manual_seed(1)
    rows = [torch.rand(30 + j // 4, generator=g) ** 8 for j in range(40)]
    x = torch.zeros(H, 39)
    for j, r in enumerate(rows):
        x[H - 40 + j, : r.shape[0]] = feature(r)
    with torch.no_grad():
        check_out = model(x[None])[0]
    check_in = torch.zeros(40, 39)
    for j, r in enumerate(rows):
        check_in[j, : r.shape[0]] = r
    check_len = torch.tensor([float(r.shape[0]) for r in rows])
    sd = {
        "check.rows": check_in.contiguous(),
        "check.row_len": check_len.contiguous(),
        "check.out": check_out.contiguous(),
        "conv1.weight": model.conv1.weight.detach().contiguous(),
        "conv1.bias": model.conv1.bias.detach().contiguous(),
        "conv2.weight": model.conv2.weight.detach().contiguous(),
        "conv2.bias": model.conv2.bias.detach().contiguous(),
        "conv3.weight": model.conv3.weight.detach().contiguous(),
        "conv3.bias": model.conv3.bias.detach().contiguous(),
        "temporal.weight": model.temporal.detach().contiguous(),
        "temporal.bias": model.temporal_bias.detach().contiguous(),
    }
    meta = {"history": str(H), "block": str(BLOCK), "channels": str(C), "held_out": ",".join(sorted(HELD_OUT)),
            "held_out_recovery": json.dumps({f"{k[0]}@{k[1]}": round(float(v), 4) for k, v in summary.items()})}
    save_file(sd, OUT, metadata=meta)
    print(f"\nwrote {OUT} ({os.path.getsize(OUT)} bytes)")


if __name__ == "__main__":
    main()
