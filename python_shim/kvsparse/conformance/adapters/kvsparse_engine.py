"""kvsparse itself through its Python binding (needs the cffi binding and libkvsparse): a dense engine per
case, output and LSE; FP8 caches natively (the engine's FP8 cache with the case's scales). KVS_ERR_UNSUPPORTED
becomes unsupported."""
import torch

from ..runner import Unsupported


_FP8 = {torch.float8_e4m3fn: "fp8_e4m3", torch.float8_e5m2: "fp8_e5m2"}


def kvsparse_engine(q, k_cache, v_cache, block_table, seq_lens, query_start_loc, scale, window, softcap,
                    k_scale=None, v_scale=None):
    from ... import engine as kvs

    t, hq, d = q.shape
    nb, bs, hk, _ = k_cache.shape
    try:
        e = kvs.Engine(num_layers=1, num_q_heads=hq, num_kv_heads=hk, head_dim=d, block_size=bs, dtype=q.dtype,
                       device=str(q.device), cache_dtype=_FP8.get(k_cache.dtype, "auto"))
        if k_cache.dtype in _FP8:
            e.set_kv_scales(0, k_scale, v_scale)
    except (kvs.KvsError, kvs.KvsUnsupported) as ex:
        if ex.status == "KVS_ERR_UNSUPPORTED":
            raise Unsupported(ex.message) from None
        raise
    out = torch.empty_like(q)
    lse = torch.empty(t, hq, dtype=torch.float32, device=q.device)
    lens = seq_lens.tolist()
    qsl = query_start_loc.tolist()
    e.forward(0, q, k_cache, v_cache, block_table, seq_lens, query_start_loc, out, lse=lse, scale=scale,
              sliding_window=window, softcap=softcap, max_query_len=max(b - a for a, b in zip(qsl, qsl[1:])),
              max_seq_len=max(lens))
    return out, lse


def _versions():
    from ... import abi_version

    return {"kvsparse_abi": abi_version()}


kvsparse_engine.versions = _versions
kvsparse_engine.fp8_cache = "native"
