"""Translation of SGLang's batch description into kvsparse's paged-attention arguments.

SGLang keeps a `req_to_token[pool_idx, position] -> slot` table (slot = page * page_size + offset)
instead of a block table. For kvsparse we need, per sequence, the page of every block of positions:
`block_table[s, j] = req_to_token[req_pool_indices[s], j * page_size] // page_size`, which is exact
because SGLang allocates whole pages, so positions j*P .. j*P+P-1 share one page.
Only this translation is implemented and tested (SGLang cannot run here); the SGLang backend class
registered through its attention registry is not written yet.
"""
import torch


def translate(req_pool_indices, seq_lens, extend_seq_lens, req_to_token, page_size):
    """Returns dict(block_table, seq_lens, query_start_loc, slot_positions) for kvs_attention_forward.

    extend_seq_lens: new tokens per sequence (None = decode, one each).
    """
    n = seq_lens.shape[0]
    seq_lens = seq_lens.to(torch.int64)
    q_lens = torch.ones(n, dtype=torch.int64) if extend_seq_lens is None else extend_seq_lens.to(torch.int64)
    if bool((q_lens > seq_lens).any()):
        raise ValueError("kvsparse/sglang: an extend length exceeds its sequence length")
    qsl = torch.zeros(n + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(q_lens, 0)
    max_blocks = int(((seq_lens + page_size - 1) // page_size).max()) if n else 0
    cols = torch.arange(max_blocks) * page_size
    cols = cols.clamp(max=req_to_token.shape[1] - 1)
    rows = req_to_token[req_pool_indices.to(torch.int64)][:, cols]
    slot_check = rows % page_size
    valid = cols[None, :] < seq_lens[:, None]
    if bool((slot_check[valid] != 0).any()):
        raise ValueError("kvsparse/sglang: req_to_token is not page-aligned for the given page_size")
    block_table = torch.where(valid, rows // page_size, torch.zeros_like(rows)).to(torch.int32)
    return dict(block_table=block_table, seq_lens=seq_lens.to(torch.int32), query_start_loc=qsl)
