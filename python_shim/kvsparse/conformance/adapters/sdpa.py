"""PyTorch's scaled_dot_product_attention, given each sequence's pages gathered into contiguous K/V and
an explicit bottom-right causal (and window) mask. The public API returns no LSE, so only the output is
checked; it has no logit soft-cap, so soft-capped cases are unsupported."""
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from ..runner import Unsupported
from .pages import causal_mask, gather


def _make(backend=None):
    def sdpa(q, k_cache, v_cache, block_table, seq_lens, query_start_loc, scale, window, softcap):
        if softcap > 0:
            raise Unsupported("logit soft-cap: scaled_dot_product_attention has none")
        out = torch.empty_like(q)
        hq, hk = q.shape[1], k_cache.shape[2]
        qsl, lens = query_start_loc.tolist(), seq_lens.tolist()
        for s in range(len(lens)):
            a, b, n = qsl[s], qsl[s + 1], lens[s]
            k = gather(k_cache, block_table, s, n).transpose(0, 1).repeat_interleave(hq // hk, 0)  # [hq, n, d]
            v = gather(v_cache, block_table, s, n).transpose(0, 1).repeat_interleave(hq // hk, 0)
            qs = q[a:b].transpose(0, 1)  # [hq, q_len, d]
            mask = causal_mask(b - a, n, window, q.device)
            if backend is None:
                o = F.scaled_dot_product_attention(qs[None], k[None], v[None], attn_mask=mask, scale=scale)
            else:
                with sdpa_kernel([backend]):
                    o = F.scaled_dot_product_attention(qs[None], k[None], v[None], attn_mask=mask, scale=scale)
            out[a:b] = o[0].transpose(0, 1)
        return out, None

    sdpa.versions = lambda: {"torch": torch.__version__, "sdpa_backend": "auto" if backend is None else backend.name}
    return sdpa


sdpa = _make()
sdpa_math = _make(SDPBackend.MATH)
sdpa_efficient = _make(SDPBackend.EFFICIENT_ATTENTION)
