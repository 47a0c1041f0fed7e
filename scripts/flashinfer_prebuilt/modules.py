"""The FlashInfer 0.7.2.post1 modules scripts/peer_quest_bench.py runs (top-k; bf16 CUDA-core paged decode, head
128, no RoPE / window / soft-cap), built ahead of time with FlashInfer's own build (its flags, its names), so that
a GPU machine without time to JIT-compile (the top-k module takes many minutes) loads them prebuilt. Run with
the environment of README.md; the .so files land in $FLASHINFER_WORKSPACE_BASE/.cache/flashinfer/<ver>/90a/."""
import time

import torch
from flashinfer.jit.attention.modules import gen_batch_decode_module
from flashinfer.jit.core import build_jit_specs
from flashinfer.jit.topk import gen_topk_module


def specs():
    return [gen_topk_module(), gen_batch_decode_module(torch.bfloat16, torch.bfloat16, torch.bfloat16, torch.int32, 128, 128, 0, False, False)]


if __name__ == "__main__":
    t = time.time()
    build_jit_specs(specs(), verbose=True, skip_prebuilt=False)
    print(f"built {[s.name[:40] for s in specs()]} in {time.time() - t:.0f} s", flush=True)
