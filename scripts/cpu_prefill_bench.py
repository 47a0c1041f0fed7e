#!/usr/bin/env python3
"""Side-by-side CPU prefill: kvsparse's forward against vLLM's own CPU attention op on one prompt chunk.

One sequence, a chunk of `chunk` query tokens at positions `prefix ..` over the same paged K/V (the chunks
vLLM's scheduler makes: 4,096 tokens at a time, so a 7,168-token prompt is 4096@0 then 3072@4096), causal,
SmolLM2's shape (9/3 heads x 64) by default. Each side reads its own layout (kvsparse: head-major blocks, K
and V as the plugin reads them; vLLM: written by its own `cpu_attn_reshape_and_cache`). The sides
alternate, their order flipping every repetition; reported: the minimum CPU time of the process per call
over the repetitions (on a shared machine other processes only ever add to it, so the minimum is the
steadiest figure), GFLOP per CPU-second (4 * head_dim per visible (query head, key) pair), and the ratio.

Usage (repo root; .venv from scripts/setup-python.sh):
  PYTHONPATH=python_shim KVSPARSE_LIB=target/release/libkvsparse.so \\
    .venv/bin/python scripts/cpu_prefill_bench.py [--points 4096@0,3072@4096,1024@4096] [--threads 1,2]
    [--reps 9] [--dtype f32]
"""
import argparse
import statistics
import time

import torch

import cpu_attn_bench as side


def point(chunk, prefix, threads, reps, dtn, shape):
    import vllm._custom_ops as ops

    hq, hk, d = side.SHAPES[shape]
    dt = side.DTYPES[dtn]
    bs, ctx = 128, prefix + chunk
    torch.set_num_threads(threads)
    kvs = side.Kvs("dense", "", "hnc", hq, hk, d, bs, dt, threads, 1)
    bt, ours, theirs = side.fill_caches([kvs], ["hnc"], hk, d, bs, dt, 1, ctx, 1, 0)
    q = torch.randn(chunk, hq, d, generator=torch.Generator().manual_seed(1)).to(dt)
    sl = torch.tensor([ctx], dtype=torch.int32)
    qsl = torch.tensor([0, chunk], dtype=torch.int32)
    out = torch.full((chunk, hq, d), float("nan"), dtype=dt)
    kc, vc = ours["hnc"][0]
    kvs.prepare(0, q, kc, vc, bt, sl, qsl, torch.tensor([1]), out)
    kvs.args[0][0].max_query_len = chunk
    vout = torch.full((chunk, hq, d), float("nan"), dtype=dt)
    md = side.vllm_metadata(1, hq, hk, d, dt, sl, qsl)
    vkc, vvc = theirs[0]

    def vllm_call():
        ops.cpu_attention_with_kv_cache(
            query=q, key_cache=vkc, value_cache=vvc, output=vout, query_start_loc=qsl, seq_lens=sl, scale=d ** -0.5,
            causal=True, alibi_slopes=None, sliding_window=-1, block_table=bt, softcap=0.0, scheduler_metadata=md,
            s_aux=None)

    sides = [("vllm", vllm_call), ("kvsparse", lambda: kvs.call(0))]
    for _, f in sides:
        f()
    err = ((out.double() - vout.double()).norm(dim=-1) / vout.double().norm(dim=-1)).max().item()
    if not err < (1e-4 if dt == torch.float32 else 2e-2):
        raise SystemExit(f"kvsparse and vLLM disagree at {chunk}@{prefix}: max row rel err {err:.2e}")
    cpu = {n: [] for n, _ in sides}
    wall = {n: [] for n, _ in sides}
    for r in range(reps):
        for n, f in (sides if r % 2 == 0 else sides[::-1]):
            c0, t0 = side.cpu_seconds(), time.perf_counter()
            f()
            wall[n].append(time.perf_counter() - t0)
            cpu[n].append(side.cpu_seconds() - c0)
    gflop = 4 * d * hq * (chunk * prefix + chunk * (chunk + 1) / 2) / 1e9
    v, k = min(cpu["vllm"]), min(cpu["kvsparse"])
    print(f"| {shape} {dtn} | {chunk}@{prefix} | {threads} | {v * 1e3:.1f} ({gflop / v:.0f}) | {k * 1e3:.1f} ({gflop / k:.0f}) | "
          f"**{k / v:.3f}** | {statistics.median(wall['vllm']) * 1e3:.1f} / {statistics.median(wall['kvsparse']) * 1e3:.1f} | "
          f"{err:.1e} |", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--points", default="4096@0,3072@4096,1024@4096", help="chunk@prefix, comma-separated")
    ap.add_argument("--threads", type=side.ints, default=[1, 2])
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--dtype", default="f32", choices=sorted(side.DTYPES))
    ap.add_argument("--shape", default="smol", choices=sorted(side.SHAPES))
    a = ap.parse_args()
    print("| shape | chunk@prefix | threads | vLLM CPU ms per call, min (GFLOP per CPU-s) | kvsparse | kvsparse / vLLM "
          "| wall ms, median (vLLM / kvsparse) | max row rel diff |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for threads in a.threads:
        for p in a.points.split(","):
            chunk, prefix = (int(x) for x in p.split("@"))
            point(chunk, prefix, threads, a.reps, a.dtype, a.shape)


if __name__ == "__main__":
    main()
