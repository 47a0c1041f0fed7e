"""Translation of SGLang's batch description into kvsparse's paged-attention arguments.

SGLang keeps a `req_to_token[pool_row, position] -> slot` table (slot = page * page_size + offset) instead of
a block table. kvsparse needs, per sequence, the page of every block of positions:
`block_table[s, j] = req_to_token[req_pool_indices[s], j * page_size] // page_size`, which is exact because
SGLang allocates whole pages, so positions j*P .. j*P+P-1 share one page.

`gather_block_table` does that on the tables' device with torch ops only (no value is read on the host, so
no device sync); columns past a sequence's length hold whatever `req_to_token` holds there and are never
read (kvsparse reads `ceil(seq_len / page_size)` blocks). `check_page_aligned` reads values and is for host
tensors (the CPU backend, tests).
"""
import torch


def gather_block_table(req_to_token, rows, pages, page_size, out=None):
    """`[len(rows), pages]` int32 block table of the pool rows `rows` (into `out[:len(rows), :pages]` when
    given: a persistent buffer whose other entries are left as they are)."""
    P = int(page_size)
    pages = min(int(pages), -(-req_to_token.shape[1] // P))
    starts = req_to_token[:, ::P] if P > 1 else req_to_token
    t = starts[:, :pages].index_select(0, rows)
    if P > 1:
        t = t.div(P, rounding_mode="floor")
    if out is None:
        return t.to(torch.int32)
    out[: t.shape[0], :pages].copy_(t)
    return out


def check_page_aligned(req_to_token, rows, seq_lens, page_size):
    """Host check (reads values) that every used page start in `req_to_token` is a page's first slot."""
    P = int(page_size)
    if P == 1 or rows.numel() == 0:
        return
    seq_lens = seq_lens.to(torch.int64)
    pages = int(((seq_lens + P - 1) // P).max())
    starts = req_to_token[:, ::P][:, :pages].index_select(0, rows.to(torch.int64)).to(torch.int64)
    used = torch.arange(starts.shape[1])[None, :] * P < seq_lens[:, None]
    if bool((starts[used] % P != 0).any()):
        raise ValueError("kvsparse/sglang: req_to_token is not page-aligned for the given page_size")


def translate(req_pool_indices, seq_lens, extend_seq_lens, req_to_token, page_size):
    """Host convenience: dict(block_table, seq_lens, query_start_loc) for kvs_attention_forward, checked.

    extend_seq_lens: new tokens per sequence (None = decode, one each)."""
    n = seq_lens.shape[0]
    seq_lens = seq_lens.to(torch.int64)
    q_lens = torch.ones(n, dtype=torch.int64) if extend_seq_lens is None else extend_seq_lens.to(torch.int64)
    if bool((q_lens > seq_lens).any()):
        raise ValueError("kvsparse/sglang: an extend length exceeds its sequence length")
    rows = req_pool_indices.to(torch.int64)
    check_page_aligned(req_to_token, rows, seq_lens, page_size)
    qsl = torch.zeros(n + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(q_lens, 0)
    pages = int(((seq_lens + page_size - 1) // page_size).max()) if n else 0
    table = gather_block_table(req_to_token, rows, pages, page_size)
    return dict(block_table=table, seq_lens=seq_lens.to(torch.int32), query_start_loc=qsl)
