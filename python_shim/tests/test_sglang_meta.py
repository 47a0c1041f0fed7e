"""SGLang req_to_token -> kvsparse block table: attention through the translation equals the reference."""
import pytest
import torch

from kvsparse import Engine
from kvsparse.sglang_meta import translate
from test_binding import _reference


def test_translated_batch_attends_like_reference():
    torch.manual_seed(1)
    H, KH, D, P, pages = 9, 3, 64, 16, 20
    eng = Engine(num_layers=1, num_q_heads=H, num_kv_heads=KH, head_dim=D, block_size=P, dtype=torch.float32)
    kc = torch.zeros(pages, P, KH, D)
    vc = torch.zeros(pages, P, KH, D)
    req_to_token = torch.zeros(8, 128, dtype=torch.int64)
    pool = torch.tensor([5, 2])
    lens = [40, 7]
    page_lists = [[11, 3, 17], [8]]
    ks, vs = [], []
    for s, (n, pg) in enumerate(zip(lens, page_lists)):
        slots = torch.tensor([pg[p // P] * P + p % P for p in range(n)])
        req_to_token[pool[s], :n] = slots
        ks.append(torch.randn(n, KH, D)); vs.append(torch.randn(n, KH, D))
        eng.cache_write(0, ks[s], vs[s], kc, vc, slots)
    ext = torch.tensor([40, 1])  # one prefill (extend) row block and one decode row
    m = translate(pool, torch.tensor(lens), ext, req_to_token, P)
    assert m["block_table"].tolist() == [[11, 3, 17], [8, 0, 0]]
    q = torch.randn(41, H, D)
    out = torch.empty_like(q)
    eng.forward(0, q, kc, vc, m["block_table"], m["seq_lens"], m["query_start_loc"], out, scale=D ** -0.5)
    assert torch.allclose(out[:40].double(), _reference(q[:40], ks[0], vs[0], D ** -0.5), atol=1e-5)
    assert torch.allclose(out[40:].double(), _reference(q[40:], ks[1], vs[1], D ** -0.5), atol=1e-5)


def test_unaligned_table_is_rejected():
    r2t = torch.arange(64).reshape(1, 64) + 3
    with pytest.raises(ValueError, match="page-aligned"):
        translate(torch.tensor([0]), torch.tensor([20]), None, r2t, 16)
