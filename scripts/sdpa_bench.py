"""PyTorch SDPA decode on contiguous K/V (cuDNN and flash backends, enable_gqa=True) over the same grid as
`kvsparse bench --device cuda`, timed with CUDA events (median of 15 groups of 10 calls, inputs rotated so
that at least 4x L2 is touched), plus torch's own device-to-device copy bandwidth. Writes a CSV."""
import argparse, math, os, sys
import torch
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel, SDPBackend

sys.path.insert(0, os.path.dirname(__file__))
from cuda_timing import time_ms  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--csv", required=True)
ap.add_argument("--max-kv-gib", type=float, default=40.0)
ap.add_argument("--batch", default="1,4,16,32,64,128", help="comma-separated batch sizes")
ap.add_argument("--ctx", default="1024,4096,16384,32768,131072", help="comma-separated context lengths")
ap.add_argument("--heads", default="32/8,64/8", help="comma-separated Q/KV head pairs")
args = ap.parse_args()
ints = lambda s: [int(x) for x in s.split(",") if x]
HEADS = [tuple(int(y) for y in x.split("/")) for x in args.heads.split(",") if x]
dev = torch.device("cuda")
D = 128
L2 = 50 << 20


n = 1 << 30
a = torch.empty(n, dtype=torch.uint8, device=dev)
b = torch.empty_like(a)
copy_ms = time_ms(lambda: b.copy_(a), groups=20, per=1)
copy = 2 * n / (copy_ms * 1e-3) / 1e9
del a, b
print(f"torch device-to-device copy: {copy:.0f} GB/s", flush=True)
rows = []
for hq, hk in HEADS:
    for B in ints(args.batch):
        for L in ints(args.ctx):
            kv = B * L * hk * D * 2 * 2
            if kv > args.max_kv_gib * (1 << 30) or kv + (4 << 30) > torch.cuda.mem_get_info()[0]:
                print(f"{B:5d} {L:7d} {hq}/{hk} skipped", flush=True)
                continue
            rot = max(1, min(16, math.ceil(4 * L2 / kv)))
            qs = [torch.randn(B, hq, 1, D, device=dev, dtype=torch.bfloat16) for _ in range(rot)]
            ks = [torch.randn(B, hk, L, D, device=dev, dtype=torch.bfloat16) for _ in range(rot)]
            vs = [torch.randn(B, hk, L, D, device=dev, dtype=torch.bfloat16) for _ in range(rot)]
            res = {}
            for name, be in [("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)]:
                i = [0]

                def step():
                    r = i[0] % rot
                    i[0] += 1
                    F.scaled_dot_product_attention(qs[r], ks[r], vs[r], enable_gqa=True)

                try:
                    with sdpa_kernel([be]):
                        res[name] = time_ms(step) * 1e3
                except Exception as ex:  # backend refused this shape
                    print(f"  {name} failed at B={B} L={L}: {str(ex).splitlines()[0][:120]}", flush=True)
                    res[name] = float("nan")
            bytes_ = kv + 2 * B * hq * D * 2
            rows.append((B, L, hq, hk, res["cudnn"], res["flash"], bytes_, copy))
            gb = lambda us: bytes_ / (us * 1e-6) / 1e9
            print(f"{B:5d} {L:7d} {hq}/{hk} cudnn {res['cudnn']:9.1f} us {gb(res['cudnn']):6.0f} GB/s  flash {res['flash']:9.1f} us {gb(res['flash']):6.0f} GB/s", flush=True)
            del qs, ks, vs
            torch.cuda.empty_cache()
with open(args.csv, "w") as f:
    f.write("batch,ctx,hq,hk,cudnn_us,flash_us,bytes,torch_copy_gbps\n")
    for r in rows:
        f.write(",".join(str(x) for x in r) + "\n")
print("sdpa done", flush=True)
