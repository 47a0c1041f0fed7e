"""Peer paged-decode kernels over the same grid and cache layout as `kvsparse bench --device cuda`: block 16,
random block permutations (blocks scattered as in a long-running server), inputs rotated so at least 4x L2 is
touched, CUDA-event timing (median of 15 groups of 10 calls, cuda_timing.py). One query token per sequence.

  --impl fa3         vLLM's FlashAttention-3 (vllm.vllm_flash_attn.flash_attn_varlen_func with block_table and
                     seqused_k, as vLLM 0.26's FLASH_ATTN backend calls it; needs vLLM's wheel on PYTHONPATH).
                     FP8: as vLLM passes it, the query quantized to FP8 too, with q/k/v descales.
  --impl flashinfer  FlashInfer's BatchDecodeWithPagedKVCacheWrapper (plan once per point, then run), bf16
                     queries; FP8: kv_data_type float8_e4m3fn with k_scale / v_scale. --layout hnd stores the
                     cache head-major in each block (what vLLM's FLASHINFER backend allocates), nhd as vLLM's
                     FLASH_ATTN; --tensor-cores runs its tensor-core decode (the prefill kernel, backend fa2;
                     vLLM picks it when the GQA group is > 4).
  --cache-dtype bf16|fp8   the K/V cache (fp8 = E4M3, scales 1/16 as the kvsparse FP8 bench sets them).

Prints one line per point with the effective read bandwidth (cache bytes read / time) and writes a CSV
(impl,cache,batch,ctx,hq,hkv,us,gbs). A point a kernel refuses prints its error instead of a time."""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from cuda_timing import time_ms  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--csv", required=True)
ap.add_argument("--impl", choices=["fa3", "flashinfer"], default="fa3")
ap.add_argument("--cache-dtype", choices=["bf16", "fp8"], default="bf16")
ap.add_argument("--batch", default="1,8,32")
ap.add_argument("--ctx", default="8192,32768,131072")
ap.add_argument("--heads", default="32/8")
ap.add_argument("--max-kv-gib", type=float, default=40.0)
ap.add_argument("--layout", choices=["nhd", "hnd"], default="nhd", help="flashinfer: cache layout inside a block")
ap.add_argument("--tensor-cores", action="store_true", help="flashinfer: use_tensor_cores=True (backend fa2)")
ap.add_argument("--max-seqlen-k", type=int, default=0, help="fa3: max_seqlen_k passed (0: the batch's own length)")
args = ap.parse_args()
ints = lambda s: [int(x) for x in s.split(",") if x]
dev = torch.device("cuda")
D, BS, L2 = 128, 16, 50 << 20
FP8 = args.cache_dtype == "fp8"
ELEM = 1 if FP8 else 2
K_SCALE = V_SCALE = 1.0 / 16
gen = torch.Generator(device="cpu").manual_seed(0)


def cache(nblocks, hkv):
    shape = (nblocks, hkv, BS, D) if args.layout == "hnd" else (nblocks, BS, hkv, D)
    x = torch.randn(*shape, dtype=torch.bfloat16, device=dev)
    return x.to(torch.float8_e4m3fn) if FP8 else x


def fa3_point(b, L, hq, hkv, kc, vc, tables, q, out):
    from vllm.vllm_flash_attn import flash_attn_varlen_func

    cu_q = torch.arange(b + 1, dtype=torch.int32, device=dev)
    seqused = torch.full((b,), L, dtype=torch.int32, device=dev)
    extra = {}
    if FP8:
        ones = torch.ones(b, hkv, dtype=torch.float32, device=dev)
        extra = dict(q_descale=ones, k_descale=ones * K_SCALE, v_descale=ones * V_SCALE)
        q = q.to(torch.float8_e4m3fn)
    state = {"r": 0}

    def call():
        r = state["r"]; state["r"] = (r + 1) % len(tables)
        flash_attn_varlen_func(q=q[r], k=kc, v=vc, out=out, cu_seqlens_q=cu_q, max_seqlen_q=1, seqused_k=seqused,
                               max_seqlen_k=args.max_seqlen_k or L, softmax_scale=D ** -0.5, causal=True,
                               block_table=tables[r], fa_version=3, **extra)
    return call


_WS = {}


def flashinfer_point(b, L, hq, hkv, kc, vc, tables, q, out):
    import flashinfer

    if "ws" not in _WS:  # one workspace for every point (setdefault would allocate 256 MiB per call)
        _WS["ws"] = torch.zeros(256 << 20, dtype=torch.uint8, device=dev)
    ws = _WS["ws"]
    bps = L // BS
    indptr = torch.arange(b + 1, dtype=torch.int32, device=dev) * bps
    last = torch.full((b,), BS, dtype=torch.int32, device=dev)
    wrappers = []
    tc = dict(use_tensor_cores=True, backend="fa2") if args.tensor_cores else {}
    for t in tables:  # one plan per rotation (FlashInfer's plan is host work done once per batch shape)
        w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, args.layout.upper(), **tc)
        w.plan(indptr, t.reshape(-1).contiguous(), last, hq, hkv, D, BS, pos_encoding_mode="NONE",
               q_data_type=torch.bfloat16, kv_data_type=kc.dtype, sm_scale=D ** -0.5)
        wrappers.append(w)
    kw = dict(k_scale=K_SCALE, v_scale=V_SCALE) if FP8 else {}
    state = {"r": 0}

    def call():
        r = state["r"]; state["r"] = (r + 1) % len(tables)
        wrappers[r].run(q[r], (kc, vc), out=out, **kw)
    return call


rows = []
if args.impl == "fa3" and (args.layout != "nhd" or args.tensor_cores):
    sys.exit("--layout hnd and --tensor-cores are FlashInfer's options (FA3 reads vLLM's NHD cache)")
tag = args.impl + (f" {args.layout.upper()}" if args.impl == "flashinfer" else "") + (" tensor cores" if args.tensor_cores else "")
print(f"{'batch':>5} {'ctx':>7} {'heads':>6} {'us':>9} {'GB/s':>8}   {tag}, {args.cache_dtype} cache, block {BS}")
for hq, hkv in [tuple(int(y) for y in h.split("/")) for h in args.heads.split(",")]:
    for b in ints(args.batch):
        for L in ints(args.ctx):
            kv_bytes = b * L * hkv * D * ELEM * 2
            rot = max(1, -(-4 * L2 // kv_bytes))
            if kv_bytes * rot > args.max_kv_gib * (1 << 30):
                rot = 1
            if kv_bytes > args.max_kv_gib * (1 << 30):
                continue
            bps = L // BS
            nblocks = b * bps * rot
            kc, vc = cache(nblocks, hkv), cache(nblocks, hkv)
            tables = []
            for r in range(rot):
                ids = torch.randperm(b * bps, generator=gen) + r * b * bps
                tables.append(ids.view(b, bps).to(torch.int32).to(dev))
            q = torch.randn(rot, b, hq, D, dtype=torch.bfloat16, device=dev)
            out = torch.empty(b, hq, D, dtype=torch.bfloat16, device=dev)
            make = fa3_point if args.impl == "fa3" else flashinfer_point
            try:
                us = time_ms(make(b, L, hq, hkv, kc, vc, tables, q, out)) * 1e3
            except Exception as e:  # a kernel that refuses the point says why; the others still run
                print(f"{b:>5} {L:>7} {hq:>3}/{hkv:<2} refused: {str(e).strip().splitlines()[-1][:150]}", flush=True)
                continue
            gbs = kv_bytes / us / 1e3
            print(f"{b:>5} {L:>7} {hq:>3}/{hkv:<2} {us:>9.1f} {gbs:>8.0f}", flush=True)
            rows.append((tag, args.cache_dtype, b, L, hq, hkv, us, gbs))
            del kc, vc, tables, q, out
            torch.cuda.empty_cache()
with open(args.csv, "w") as f:
    f.write("impl,cache,batch,ctx,hq,hkv,us,gbs\n")
    for r in rows:
        f.write(",".join(f"{x:.2f}" if isinstance(x, float) else str(x) for x in r) + "\n")
