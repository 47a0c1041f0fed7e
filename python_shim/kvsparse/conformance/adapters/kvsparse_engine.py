"""kvsparse itself through its Python binding (needs the cffi binding and libkvsparse): a dense engine per
case, output and LSE. KVS_ERR_UNSUPPORTED becomes unsupported."""
import torch

from ..runner import Unsupported


def kvsparse_engine(q, k_cache, v_cache, block_table, seq_lens, query_start_loc, scale, window, softcap):
    from ... import engine as kvs

    t, hq, d = q.shape
    nb, bs, hk, _ = k_cache.shape
    try:
        e = kvs.Engine(num_layers=1, num_q_heads=hq, num_kv_heads=hk, head_dim=d, block_size=bs, dtype=q.dtype,
                       device=str(q.device))
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
