"""The per-step module both backends share (kvsparse/step.py, seq_ids.py): descriptors built once and
re-pointed, metadata as persistent buffers, ids, and that it imports neither vLLM nor SGLang."""
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvsparse import Engine, KvsError
from kvsparse.seq_ids import EPHEMERAL_BASE, SeqIds
from kvsparse.step import IdBuffer, LayerCall, StepMeta
from test_binding import _reference

H, KH, D, BS, NB = 9, 3, 64, 16, 24


def test_shared_modules_import_neither_vllm_nor_sglang():
    code = ("import sys, kvsparse.step, kvsparse.seq_ids, kvsparse.dlpack; "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('vllm', 'sglang')]; "
            "assert not bad, bad; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def _caches(dtype=torch.float32):
    # vLLM's LBNHC cache: logical [blocks, kv_heads, block_size, 2*D], token-major; K and V strided halves.
    raw = torch.zeros(NB, BS, KH, 2 * D, dtype=dtype)
    kv = raw.permute(0, 2, 1, 3)
    kc, vc = kv.transpose(1, 2).split(D, dim=-1)
    return kv, kc, vc


def test_layer_calls_over_persistent_buffers_match_reference():
    """Two layers, a prefill step then two decode steps, driven the way both backends drive it: metadata in
    persistent buffers larger than the batch (a prefix described), query/output as padded 2-D buffers,
    key/value 2-D and 3-D, one StepMeta per step shared by the layers."""
    torch.manual_seed(0)
    eng = Engine(num_layers=2, num_q_heads=H, num_kv_heads=KH, head_dim=D, block_size=BS, dtype=torch.float32,
                 num_threads=1)
    layers = []
    for i in range(2):
        kv, kc, vc = _caches()
        c = LayerCall(eng, i, scale=D ** -0.5)
        c.set_caches(kv, kc, vc)
        layers.append(c)
    tables = [[3, 7, 1, 0], [9, 2, 5, 0]]
    table = torch.zeros(8, 6, dtype=torch.int32)  # persistent: 8 rows, 6 columns
    table[:2, :4] = torch.tensor(tables, dtype=torch.int32)
    seq_lens = torch.zeros(8, dtype=torch.int32)
    qsl = torch.zeros(9, dtype=torch.int32)
    ids = IdBuffer("cpu", 8)
    hist = [[([], []) for _ in range(2)] for _ in range(2)]  # [layer][seq] -> (k rows, v rows)
    lens = [0, 0]
    for step, new in enumerate([[37, 5], [1, 1], [1, 1]]):
        T = sum(new)
        seq_lens[:2] = torch.tensor([lens[0] + new[0], lens[1] + new[1]], dtype=torch.int32)
        qsl[1:3] = torch.cumsum(torch.tensor(new, dtype=torch.int32), 0)
        slots = torch.tensor([tables[s][p // BS] * BS + p % BS for s in range(2)
                              for p in range(lens[s], lens[s] + new[s])], dtype=torch.int64)
        meta = StepMeta(table, seq_lens, qsl, ids.put([11, 12]), num_seqs=2, num_tokens=T, max_query_len=max(new))
        for li, c in enumerate(layers):
            pad = T + 3
            q = torch.randn(pad, H * D)
            k = torch.randn(pad, KH * D) if li == 0 else torch.randn(pad, KH, D)
            v = torch.randn(pad, KH * D) if li == 0 else torch.randn(pad, KH, D)
            out = torch.full((pad, H * D), 7.0)
            c.write(k, v, slots)  # rows = the slot mapping's length
            c.attend(q, out, meta)
            assert torch.all(out[T:] == 7.0), "rows past num_tokens are not touched"
            off = 0
            for s in range(2):
                n = new[s]
                hk, hv = hist[li][s]
                hk.append(k[off:off + n].reshape(n, KH, D))
                hv.append(v[off:off + n].reshape(n, KH, D))
                ref = _reference(q[off:off + n].view(n, H, D), torch.cat(hk), torch.cat(hv), D ** -0.5)
                torch.testing.assert_close(out[off:off + n].view(n, H, D).double(), ref, atol=1e-5, rtol=1e-5)
                off += n
        lens = [lens[0] + new[0], lens[1] + new[1]]
    st = eng.stats()
    assert st["sequences_created"] == 2 and st["decode_rows"] == 2 * 2 * 2


def test_descriptor_follows_layout_changes_and_rejects_bad_rows():
    """A tensor with other strides than the last call's is described anew (not silently read with the old
    strides); asking for more rows than a tensor has is an error, not an out-of-bounds read."""
    torch.manual_seed(1)
    eng = Engine(num_layers=1, num_q_heads=H, num_kv_heads=KH, head_dim=D, block_size=BS, dtype=torch.float32,
                 num_threads=1)
    kv, kc, vc = _caches()
    c = LayerCall(eng, 0, scale=D ** -0.5)
    c.set_caches(kv, kc, vc)
    k, v = torch.randn(20, KH, D), torch.randn(20, KH, D)
    c.write(k, v, torch.arange(20, dtype=torch.int64) + 2 * BS)  # block 2
    meta = StepMeta(torch.tensor([[2, 3]], dtype=torch.int32), torch.tensor([20], dtype=torch.int32),
                    torch.tensor([0, 1], dtype=torch.int32), num_tokens=1)
    ref_q = torch.randn(1, H, D)
    ref = _reference(ref_q, k, v, D ** -0.5)
    for q in (ref_q.clone(), ref_q.transpose(1, 2).contiguous().transpose(1, 2), ref_q.reshape(1, H * D)):
        out = torch.empty(1, H, D)
        c.attend(q, out, meta)
        torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="rows asked"):
        c.attend(torch.randn(0, H, D), torch.empty(0, H, D), meta)
    with pytest.raises(ValueError, match="unit column stride"):
        c.attend(torch.randn(H * D, 2).t()[:1], torch.empty(1, H * D), meta)


def test_bad_metadata_raises_kvsparse_error_and_writes_nothing():
    eng = Engine(num_layers=1, num_q_heads=H, num_kv_heads=KH, head_dim=D, block_size=BS, dtype=torch.float32,
                 num_threads=1)
    kv, kc, vc = _caches()
    c = LayerCall(eng, 0, scale=D ** -0.5)
    c.set_caches(kv, kc, vc)
    meta = StepMeta(torch.tensor([[NB + 5]], dtype=torch.int32), torch.tensor([3], dtype=torch.int32),
                    torch.tensor([0, 1], dtype=torch.int32), num_tokens=1)
    out = torch.full((1, H, D), 3.0)
    with pytest.raises(KvsError) as e:
        c.attend(torch.randn(1, H, D), out, meta)
    assert e.value.status == "KVS_ERR_OUT_OF_RANGE" and str(e.value).startswith("kvsparse attention_forward:")
    assert torch.all(out == 3.0)


def test_id_buffer_is_one_persistent_tensor():
    b = IdBuffer("cpu", 4)
    a = b.put([5, 6, 7])
    assert a.tolist() == [5, 6, 7]
    c = b.put([9])
    assert c.tolist() == [9] and c.data_ptr() == a.data_ptr() == b.tensor.data_ptr()
    assert b.put([5, 6, 7]).tolist() == [5, 6, 7]
    with pytest.raises(ValueError, match="more than the 4"):
        b.put([1, 2, 3, 4, 5])


def test_seq_ids_stable_ephemeral_and_released_once():
    released = []
    held = {1, 2}

    def release(sid, missing_ok=False):
        released.append(sid)
        return sid in held

    t = SeqIds(release)
    a = t.ids(["r1", "r2", None])
    assert a[:2] == [1, 2] and a[2] == EPHEMERAL_BASE + 2
    assert t.ids(["r2", "r1"]) == [2, 1] and released == [EPHEMERAL_BASE + 2]  # last step's ephemeral id
    t.forget(["r1"])
    t.forget(["r2"], restarted=True)
    t.forget(["r2", "never-seen"])
    assert t.ids(["r2"]) == [3]  # a restarted request starts over with a fresh id
    life = t.lifecycle()
    assert life["r1"] == [1, 1, 0] and life["r2"] == [2, 1, 1] and life["<dummy>"][0] == 1


def test_gpu_check_script_runs_on_cpu():
    """scripts/gpu_shim_check.py (run on the GPU machine by hand) stays runnable: on the CPU it drives the same
    steps against the float64 reference (dense) and checks the policy ran sparse."""
    script = Path(__file__).resolve().parents[2] / "scripts" / "gpu_shim_check.py"
    p = subprocess.run([sys.executable, str(script), "--device", "cpu", "--layers", "3", "--seqs", "3",
                        "--heads", "8", "--kv-heads", "2", "--min-len", "300", "--max-len", "500"],
                       capture_output=True, text=True, timeout=600)
    print(p.stdout[-1500:])
    assert p.returncode == 0 and "ALL PASSED (2 rows)" in p.stdout, p.stdout[-3000:] + p.stderr[-3000:]
