"""PyTorch SDPA causal prefill (flash and cuDNN backends) at the points of `kvsparse bench --device cuda
--prefill`: B sequences of Q new tokens after a cached prefix of P (bottom-right causal mask through
torch.nn.attention.bias.causal_lower_right when P > 0), heads 32/8, head 128, bf16, contiguous
[B, H, N, D] tensors (K/V repeated to the query heads, outside the timing). CUDA events (cuda_timing.py), median of 10
single calls after 3 warm-ups; TFLOP/s of the causal FLOPs (the same count as the kvsparse bench)."""
import argparse, os, sys
import torch
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel, SDPBackend
from torch.nn.attention.bias import causal_lower_right

sys.path.insert(0, os.path.dirname(__file__))
from cuda_timing import time_ms  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--points", default="1x4096,1x32768,8x4096,1x2048+30720")
ap.add_argument("--heads", default="32/8")
args = ap.parse_args()
dev = torch.device("cuda")
D = 128
hq, hk = (int(x) for x in args.heads.split("/"))


print(f"{'point':<14} {'backend':<8} {'ms':>9} {'TFLOP/s':>9}", flush=True)
for pt in args.points.split(","):
    b, rest = pt.split("x")
    q, p = (rest.split("+") + ["0"])[:2]
    B, Q, P = int(b), int(q), int(p)
    L = P + Q
    keys = (L * (L + 1) - P * (P + 1)) / 2
    flops = 4 * D * hq * keys * B
    qt = torch.randn(B, hq, Q, D, device=dev, dtype=torch.bfloat16)
    kt = torch.randn(B, hk, L, D, device=dev, dtype=torch.bfloat16).repeat_interleave(hq // hk, dim=1).contiguous()
    vt = torch.randn(B, hk, L, D, device=dev, dtype=torch.bfloat16).repeat_interleave(hq // hk, dim=1).contiguous()
    for name, be in [("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)]:
        try:
            with sdpa_kernel([be]):
                if P == 0:
                    fn = lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)
                else:
                    mask = causal_lower_right(Q, L)
                    fn = lambda: F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask)
                ms = time_ms(fn, groups=10, per=1)  # median of 10 single calls
            print(f"{pt:<14} {name:<8} {ms:>9.3f} {flops / (ms * 1e-3) / 1e12:>9.1f}", flush=True)
        except Exception as ex:  # a backend that does not take this shape says so and the run goes on
            print(f"{pt:<14} {name:<8} unavailable: {str(ex).splitlines()[0][:120]}", flush=True)
    del qt, kt, vt
    torch.cuda.empty_cache()
