"""Helpers for adapters of kernels that take contiguous K/V: gather a sequence's pages through the table."""
import torch


def gather(cache, block_table, s, n):
    """Rows 0..n-1 of sequence s, `[n, kv_heads, dim]`, from a paged cache view `[blocks, block_size, ...]`."""
    bs = cache.shape[1]
    pos = torch.arange(n, device=cache.device)
    return cache[block_table[s].long()[pos // bs], pos % bs]


def causal_mask(q_len, n, window, device):
    """`[q_len, n]` bool: query row i (at position n - q_len + i) may see key j."""
    kpos = torch.arange(n, device=device)
    qpos = torch.arange(q_len, device=device) + n - q_len
    m = kpos[None, :] <= qpos[:, None]
    if window > 0:
        m &= kpos[None, :] > qpos[:, None] - window
    return m
