"""Gathering paged attention in float64 with torch, on the tensors' device: the suite's control target
(it must pass every case, which shows the cases were read right on that device) and the variants the
diagnosis tries (another window convention, a top-left causal mask)."""
import torch


def gather(cache, block_table, s, n):
    """Rows 0..n-1 of sequence s from a paged cache view `[blocks, block_size, heads, dim]`."""
    bs = cache.shape[1]
    pos = torch.arange(n, device=cache.device)
    blocks = block_table[s].long()[pos // bs]
    return cache[blocks, pos % bs]  # [n, heads, dim]


def attention(q, k_cache, v_cache, block_table, seq_lens, query_start_loc, scale, window, softcap,
              align="bottom", dtype=torch.float64):
    """Causal paged attention; `align="top"` puts query row i of every sequence at position i (the mask
    `is_causal=True` gives when queries and keys differ in length) instead of at seq_len - q_len + i."""
    t, hq, d = q.shape
    hk = k_cache.shape[2]
    g = hq // hk
    out = torch.zeros(t, hq, d, dtype=dtype, device=q.device)
    lse = torch.zeros(t, hq, dtype=dtype, device=q.device)
    qsl, lens = query_start_loc.tolist(), seq_lens.tolist()
    for s in range(len(lens)):
        a, b, n = qsl[s], qsl[s + 1], lens[s]
        if b == a:
            continue
        k = gather(k_cache, block_table, s, n).to(dtype)
        v = gather(v_cache, block_table, s, n).to(dtype)
        qs = q[a:b].to(dtype).reshape(b - a, hk, g, d)
        logits = torch.einsum("tkgd,nkd->kgtn", qs, k) * scale
        if softcap > 0:
            logits = softcap * torch.tanh(logits / softcap)
        kpos = torch.arange(n, device=q.device)
        qpos = torch.arange(b - a, device=q.device) + (n - (b - a) if align == "bottom" else 0)
        allowed = kpos[None, :] <= qpos[:, None]
        if window > 0:
            allowed &= kpos[None, :] > qpos[:, None] - window
        logits = logits.masked_fill(~allowed, float("-inf"))
        l = torch.logsumexp(logits, dim=-1)  # [hk, g, t]
        w = torch.exp(logits - l[..., None])
        out[a:b] = torch.einsum("kgtn,nkd->tkgd", w, v).reshape(b - a, hq, d)
        lse[a:b] = l.permute(2, 0, 1).reshape(b - a, hq)
    return out, lse


def reference(q, k_cache, v_cache, block_table, seq_lens, query_start_loc, scale, window, softcap):
    """The control adapter: float64 gathering attention (returns float64 out and LSE)."""
    return attention(q, k_cache, v_cache, block_table, seq_lens, query_start_loc, scale, window, softcap)


reference.fp8_cache = torch.float32  # FP8 caches dequantized exactly, as the reference output was computed
