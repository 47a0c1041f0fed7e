"""Quest as a user would assemble it from PyTorch and FlashInfer 0.7.2 (issue 34's peer column), on the grid of
`kvsparse bench --device cuda --policy 'quest(budget=L/16)'`: head 128, bf16, block = page = 16, random block
permutations, inputs rotated over at least 4x the L2, CUDA-event timing (cuda_timing.py, as our bench times).

One decode step per (sequence, KV head):
  scores   Quest's upper bound of each page's logits, from per-page key bounds (channel-wise min / max of its 16
           keys, bf16, kept per block and gathered through the block table each step): per query head
           q+ . max + q- . min (two batched matmuls), then the max over the GQA group, as kvsparse's Quest scores
           a KV head. The newest page is always kept (score +inf).
  top_k    flashinfer.top_k_page_table_transform: the k = budget / 16 best pages of each row, mapped through a
           per-(sequence, KV head) page table to page ids of the cache viewed one KV head per page (below).
           flashinfer.top_k alone on the same scores is timed too (the issue's 8 x 8,192 row shape at 1 x 128K).
  attend   FlashInfer's BatchDecodeWithPagedKVCacheWrapper over the selected pages: the HND cache
           [blocks, kv_heads, 16, 128] viewed as [blocks * kv_heads, 16, 1, 128], so each (sequence, KV head) is
           one request of GQA-group query heads over its own pages (CUDA-graph-style fixed index buffer, written
           by the top-k each step).
Also FlashInfer's dense decode over every page (same HND cache) as the dense baseline. Before timing, a small
point checks the assembled step against a float32 reference over the same pages (the selected sets against
torch.topk's, ties aside), so the peer is a correct Quest.

`--graph` times every stage and the step as CUDA-graph replays (one graph per input rotation), as serving engines
run decode; without it, eager calls (Python's launch cost included).
Prints one line per point (microseconds: scores, top_k transform, top_k alone, attend, step, dense; step x dense)
and writes a CSV. Needs torch and FlashInfer (its top-k and decode modules JIT-compile on first use: the slim
wheel of scripts/repack_flashinfer_wheel.py keeps their sources)."""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from cuda_timing import time_ms  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--csv", required=True)
ap.add_argument("--batch", default="1,8,32")
ap.add_argument("--ctx", default="32768,131072")
ap.add_argument("--heads", default="32/8")
ap.add_argument("--budget-div", type=int, default=16, help="budget = context / this (tokens)")
ap.add_argument("--max-kv-gib", type=float, default=40.0)
ap.add_argument("--graph", action="store_true", help="time each stage and the step as CUDA-graph replays (as vLLM and SGLang run decode)")
args = ap.parse_args()
ints = lambda s: [int(x) for x in s.split(",") if x]
dev = torch.device("cuda")
D, BS, L2 = 128, 16, 50 << 20
gen = torch.Generator(device="cpu").manual_seed(0)
_WS = {}


def workspace():
    if "ws" not in _WS:
        _WS["ws"] = torch.zeros(256 << 20, dtype=torch.uint8, device=dev)
    return _WS["ws"]


class Point:
    """Caches, bounds, block tables (one per rotation) and the FlashInfer wrappers of one grid point."""

    def __init__(self, b, L, hq, hkv, rot):
        import flashinfer

        self.b, self.L, self.hq, self.hkv, self.rot = b, L, hq, hkv, rot
        self.g = hq // hkv
        self.P = L // BS
        self.k = max(1, L // args.budget_div // BS)
        nblocks = b * self.P * rot
        self.kc = torch.randn(nblocks, hkv, BS, D, dtype=torch.bfloat16, device=dev)
        self.vc = torch.randn(nblocks, hkv, BS, D, dtype=torch.bfloat16, device=dev)
        # Per-block key bounds [blocks, hkv, D] (kept by the cache write in a real engine: not timed here).
        self.kmin = self.kc.amin(dim=2)
        self.kmax = self.kc.amax(dim=2)
        self.tables, self.head_tables = [], []
        for r in range(rot):
            ids = (torch.randperm(b * self.P, generator=gen) + r * b * self.P).view(b, self.P).to(torch.int32).to(dev)
            self.tables.append(ids)
            # Page ids of the per-head view: block * hkv + head, one row per (sequence, KV head).
            self.head_tables.append((ids[:, None, :] * hkv + torch.arange(hkv, dtype=torch.int32, device=dev)[None, :, None]).reshape(b * hkv, self.P).contiguous())
        self.q = torch.randn(rot, b, hq, D, dtype=torch.bfloat16, device=dev)
        self.out = torch.empty(b * hkv, self.g, D, dtype=torch.bfloat16, device=dev)
        self.dense_out = torch.empty(b, hq, D, dtype=torch.bfloat16, device=dev)
        self.lengths = torch.full((b * hkv,), self.P, dtype=torch.int32, device=dev)
        self.scores = torch.empty(b * hkv, self.P, dtype=torch.float32, device=dev)
        self.sel = torch.empty(b * hkv, self.k, dtype=torch.int32, device=dev)
        # Sparse decode: b * hkv requests of k pages each, one KV head, g query heads; fixed buffers.
        rows = b * hkv
        self.indptr = torch.arange(rows + 1, dtype=torch.int32, device=dev) * self.k
        self.last = torch.full((rows,), BS, dtype=torch.int32, device=dev)
        self.sparse = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            workspace(), "NHD", use_cuda_graph=True, paged_kv_indptr_buffer=self.indptr.clone(),
            paged_kv_indices_buffer=self.sel.view(-1), paged_kv_last_page_len_buffer=self.last.clone())
        self.sparse.plan(self.indptr, self.sel.view(-1), self.last, self.g, 1, D, BS, pos_encoding_mode="NONE",
                         q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16, sm_scale=D ** -0.5)
        self.kflat = self.kc.view(nblocks * hkv, BS, 1, D)
        self.vflat = self.vc.view(nblocks * hkv, BS, 1, D)
        # Dense baseline: FlashInfer's decode over every page, HND (one plan per rotation).
        dindptr = torch.arange(b + 1, dtype=torch.int32, device=dev) * self.P
        dlast = torch.full((b,), BS, dtype=torch.int32, device=dev)
        self.dense = []
        for t in self.tables:
            w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace(), "HND")
            w.plan(dindptr, t.reshape(-1).contiguous(), dlast, hq, hkv, D, BS, pos_encoding_mode="NONE",
                   q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16, sm_scale=D ** -0.5)
            self.dense.append(w)

    def score(self, r):
        t = self.tables[r].long()
        lo, hi = self.kmin[t], self.kmax[t]  # [b, P, hkv, D]
        q = self.q[r].view(self.b, self.hkv, self.g, D)
        s = torch.matmul(q.clamp(min=0), hi.permute(0, 2, 3, 1)) + torch.matmul(q.clamp(max=0), lo.permute(0, 2, 3, 1))  # [b, hkv, g, P]
        s = s.amax(dim=2).reshape(self.b * self.hkv, self.P).float()
        s[:, -1] = float("inf")  # the newest page
        self.scores.copy_(s)

    def select(self, r):
        import flashinfer

        self.sel.copy_(flashinfer.top_k_page_table_transform(self.scores, self.head_tables[r], self.lengths, self.k))

    def topk_alone(self):
        import flashinfer

        return flashinfer.top_k(self.scores, self.k)

    def attend(self, r):
        self.sparse.run(self.q[r].view(self.b * self.hkv, self.g, D), (self.kflat, self.vflat), out=self.out)


def graphed(fn):
    """`fn` captured in a CUDA graph (after a warm-up on a side stream, as torch's docs ask), as its replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


def rotating(fns):
    """Calls fns[0], fns[1], ... in turn (one per rotation of the inputs)."""
    state = [0]

    def call():
        fns[state[0]]()
        state[0] = (state[0] + 1) % len(fns)
    return call


def check():
    """The assembled step against float32 over the same pages, and its sets against torch.topk's."""
    p = Point(2, 4096, 32, 8, 1)
    p.score(0)
    p.select(0)
    p.attend(0)
    torch.cuda.synchronize()
    ref_idx = torch.topk(p.scores, p.k, dim=1).indices
    ref_pages = torch.gather(p.head_tables[0], 1, ref_idx)
    a, b = p.sel.sort(dim=1).values, ref_pages.sort(dim=1).values
    kth = torch.topk(p.scores, p.k, dim=1).values[:, -1:]
    ties = (p.scores == kth).sum(dim=1) > 1
    assert bool(((a == b).all(dim=1) | ties).all()), "FlashInfer's top-k pages differ from torch.topk's"
    # float32 attention of each (sequence, KV head) over its selected pages
    kf, vf = p.kflat.float()[:, :, 0], p.vflat.float()[:, :, 0]  # [pages, 16, D]
    q = p.q[0].float().view(p.b * p.hkv, p.g, D)
    worst = 0.0
    for row in range(p.b * p.hkv):
        keys = kf[p.sel[row].long()].reshape(-1, D)
        vals = vf[p.sel[row].long()].reshape(-1, D)
        w = torch.softmax(q[row] @ keys.T * D ** -0.5, dim=-1)
        ref = w @ vals
        worst = max(worst, float((p.out[row].float() - ref).abs().max() / ref.abs().max()))
    assert worst < 2e-2, f"assembled Quest differs from float32 over its pages: {worst}"
    print(f"check: top-k sets equal torch.topk's (ties aside), attend within {worst:.2e} of float32", flush=True)


check()
rows = []
print(f"{'batch':>5} {'ctx':>7} {'heads':>6} {'pages':>6} {'k':>5} {'scores':>8} {'topk_pt':>8} {'topk':>8} {'attend':>8} {'step':>8} {'dense':>8} {'x dense':>8}")
for hq, hkv in [tuple(int(y) for y in h.split("/")) for h in args.heads.split(",")]:
    for b in ints(args.batch):
        for L in ints(args.ctx):
            kv_bytes = b * L * hkv * D * 2 * 2
            rot = max(1, -(-4 * L2 // kv_bytes))
            if kv_bytes * rot > args.max_kv_gib * (1 << 30):
                rot = 1
            if kv_bytes > args.max_kv_gib * (1 << 30):
                continue
            try:
                p = Point(b, L, hq, hkv, rot)
                t = {}
                wrap = graphed if args.graph else (lambda fn: fn)
                t["scores"] = time_ms(wrap(lambda: p.score(0))) * 1e3
                t["topk_pt"] = time_ms(wrap(lambda: p.select(0))) * 1e3
                t["topk"] = time_ms(wrap(p.topk_alone)) * 1e3
                t["attend"] = time_ms(wrap(lambda: p.attend(0))) * 1e3
                # The step and the dense baseline rotate over the inputs (one graph per rotation).
                steps = [wrap(lambda r=r: (p.score(r), p.select(r), p.attend(r))) for r in range(p.rot)]
                t["step"] = time_ms(rotating(steps)) * 1e3
                t["dense"] = time_ms(rotating([wrap(lambda r=r: p.dense[r].run(p.q[r], (p.kc, p.vc), out=p.dense_out)) for r in range(p.rot)])) * 1e3
            except Exception as e:  # a kernel that refuses the point says why; the others still run
                print(f"{b:>5} {L:>7} {hq:>3}/{hkv:<2} refused: {str(e).strip().splitlines()[-1][:150]}", flush=True)
                continue
            print(f"{b:>5} {L:>7} {hq:>3}/{hkv:<2} {p.P:>6} {p.k:>5} {t['scores']:>8.1f} {t['topk_pt']:>8.1f} {t['topk']:>8.1f} "
                  f"{t['attend']:>8.1f} {t['step']:>8.1f} {t['dense']:>8.1f} {t['dense'] / t['step']:>8.2f}", flush=True)
            rows.append((b, L, hq, hkv, p.P, p.k, t["scores"], t["topk_pt"], t["topk"], t["attend"], t["step"], t["dense"]))
            del p
            torch.cuda.empty_cache()
with open(args.csv, "w") as f:
    f.write("batch,ctx,hq,hkv,pages,k,scores_us,topk_transform_us,topk_us,attend_us,step_us,dense_us\n")
    for r in rows:
        f.write(",".join(f"{x:.2f}" if isinstance(x, float) else str(x) for x in r) + "\n")
