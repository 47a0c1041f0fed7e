"""FlashInfer's paged decode (`BatchDecodeWithPagedKVCacheWrapper`, NHD layout, JIT-compiled on first use
for each dtype / head size / window / soft-cap variant). It serves decode rows only (`rows = "decode"`: the
runner passes each case's decode sequences). The case's caches are passed as they are (strided views of one
storage; FlashInfer reads K/V strides), the block table becomes FlashInfer's CSR page list (indptr, indices,
last_page_len) of the pages each sequence uses, so stale or -1 columns never reach it.

Conventions translated, not judged: `window_left = window - 1` (FlashInfer's left bound is inclusive and
excludes the query itself), and FlashInfer's LSE is base 2 (`max + log2(sum(exp2(...)))`), so it is
multiplied by ln 2."""
import math

import torch

from ..runner import Unsupported

_WORKSPACE = {}


def _pages(block_table, seq_lens, bs):
    lens = seq_lens.long()
    used = (lens + bs - 1) // bs
    indptr = torch.zeros(len(lens) + 1, dtype=torch.int32, device=lens.device)
    indptr[1:] = torch.cumsum(used, 0)
    cols = torch.arange(block_table.shape[1], device=lens.device)
    indices = block_table[cols[None, :] < used[:, None]].int()  # row-major: each sequence's pages in order
    last = (lens - (used - 1) * bs).int()
    return indptr, indices, last


def flashinfer_decode(q, k_cache, v_cache, block_table, seq_lens, query_start_loc, scale, window, softcap):
    if q.device.type != "cuda":
        raise Unsupported(f"device {q.device}: FlashInfer runs on CUDA")
    if q.dtype not in (torch.float16, torch.bfloat16):
        raise Unsupported(f"dtype {q.dtype}: FlashInfer's decode kernels take fp16/bf16 queries")
    import flashinfer

    nb, bs, hk, d = k_cache.shape
    ws = _WORKSPACE.get(q.device)
    if ws is None:
        ws = _WORKSPACE[q.device] = torch.zeros(128 * 1024 * 1024, dtype=torch.uint8, device=q.device)
    w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD")
    indptr, indices, last = _pages(block_table, seq_lens, bs)
    w.plan(indptr, indices, last, q.shape[1], hk, d, bs, pos_encoding_mode="NONE",
           window_left=window - 1 if window > 0 else -1, logits_soft_cap=softcap if softcap > 0 else None,
           q_data_type=q.dtype, kv_data_type=k_cache.dtype, sm_scale=scale)
    try:
        out, lse = w.run(q, (k_cache, v_cache), return_lse=True)
    except RuntimeError as e:
        # FlashInfer refuses some shapes only at run time (0.7.2: its split-KV merge,
        # VariableLengthMergeStates, says "Unsupported head_dim: 80"); that is a limit it states, not a wrong result.
        if "Unsupported head_dim" in str(e):
            raise Unsupported(f"FlashInfer: {str(e).strip().splitlines()[-1][:160]}") from None
        raise
    return out, lse.float() * math.log(2.0)


flashinfer_decode.rows = "decode"


def _versions():
    import flashinfer

    v = {"flashinfer": flashinfer.__version__, "api": "BatchDecodeWithPagedKVCacheWrapper (NHD, backend auto)"}
    try:
        import tvm_ffi

        v["apache-tvm-ffi"] = getattr(tvm_ffi, "__version__", "?")
    except ImportError:
        pass
    return v


flashinfer_decode.versions = _versions
