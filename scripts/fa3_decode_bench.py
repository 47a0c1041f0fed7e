"""vLLM's FlashAttention-3 (vllm.vllm_flash_attn, what vLLM's FLASH_ATTN backend runs on Hopper) on a paged
bf16 KV cache, called as vLLM 0.26 calls it for a decode batch (flash_attn_varlen_func with block_table,
seqused_k, one query token per sequence), over the same grid and cache layout as
`kvsparse bench --device cuda`: block 16, random block permutations (blocks scattered as in a long-running
server), inputs rotated so at least 4x L2 is touched, CUDA-event timing (median of 15 groups of 10 calls).
Prints one line per point with the effective read bandwidth and writes a CSV (batch,ctx,hq,hkv,us,gbs).
Needs vLLM's wheel on PYTHONPATH (scripts/vllm-gpu-run.sh installs it into /tmp/site)."""
import argparse, os, sys
import torch
from vllm.vllm_flash_attn import flash_attn_varlen_func

sys.path.insert(0, os.path.dirname(__file__))
from cuda_timing import time_ms  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--csv", required=True)
ap.add_argument("--batch", default="1,8,32")
ap.add_argument("--ctx", default="8192,32768,131072")
ap.add_argument("--heads", default="32/8")
ap.add_argument("--max-kv-gib", type=float, default=40.0)
ap.add_argument("--max-seqlen-k", type=int, default=0, help="max_seqlen_k passed (0: the batch's own length)")
args = ap.parse_args()
ints = lambda s: [int(x) for x in s.split(",") if x]
dev = torch.device("cuda")
D, BS, L2 = 128, 16, 50 << 20
gen = torch.Generator(device="cpu").manual_seed(0)


rows = []
print(f"{'batch':>5} {'ctx':>7} {'heads':>6} {'us':>9} {'GB/s':>8}   vllm_flash_attn FA3, bf16, block {BS}")
for hq, hkv in [tuple(int(y) for y in h.split("/")) for h in args.heads.split(",")]:
    for b in ints(args.batch):
        for L in ints(args.ctx):
            kv_bytes = b * L * hkv * D * 2 * 2
            rot = max(1, -(-4 * L2 // kv_bytes))
            if kv_bytes * rot > args.max_kv_gib * (1 << 30):
                rot = 1
            if kv_bytes > args.max_kv_gib * (1 << 30):
                continue
            bps = L // BS
            nblocks = b * bps * rot
            kc = torch.randn(nblocks, BS, hkv, D, dtype=torch.bfloat16, device=dev)
            vc = torch.randn(nblocks, BS, hkv, D, dtype=torch.bfloat16, device=dev)
            tables = []
            for r in range(rot):
                ids = torch.randperm(b * bps, generator=gen) + r * b * bps
                tables.append(ids.view(b, bps).to(torch.int32).to(dev))
            q = torch.randn(rot, b, hq, D, dtype=torch.bfloat16, device=dev)
            out = torch.empty(b, hq, D, dtype=torch.bfloat16, device=dev)
            cu_q = torch.arange(b + 1, dtype=torch.int32, device=dev)
            seqused = torch.full((b,), L, dtype=torch.int32, device=dev)
            state = {"r": 0}

            def call():
                r = state["r"]; state["r"] = (r + 1) % rot
                flash_attn_varlen_func(q=q[r], k=kc, v=vc, out=out, cu_seqlens_q=cu_q, max_seqlen_q=1,
                                       seqused_k=seqused, max_seqlen_k=args.max_seqlen_k or L,
                                       softmax_scale=D ** -0.5, causal=True, block_table=tables[r], fa_version=3)
            us = time_ms(call) * 1e3
            gbs = kv_bytes / us / 1e3
            print(f"{b:>5} {L:>7} {hq:>3}/{hkv:<2} {us:>9.1f} {gbs:>8.0f}", flush=True)
            rows.append((b, L, hq, hkv, us, gbs))
            del kc, vc, tables, q, out
            torch.cuda.empty_cache()
with open(args.csv, "w") as f:
    f.write("batch,ctx,hq,hkv,us,gbs\n")
    for r in rows:
        f.write(",".join(f"{x:.2f}" if isinstance(x, float) else str(x) for x in r) + "\n")
