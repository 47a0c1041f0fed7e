"""The SGLang backend (kvsparse/sglang_backend.py).

Two levels:
* always: the backend driven with SGLang's data layout (req_to_token pool with generations, per-layer
  [rows, kv_heads, head_dim] K/V buffers, forward-batch fields) mirrored by small stand-ins: a prefill,
  a chunked prefill with a cached prefix, decode steps and a freed/reused pool row; outputs against a
  float64 reference, state lifecycle counted, a sparse policy's stats.
* with SGLang importable (scripts/python-tests.sh installs sglang==0.5.23 --no-deps and the few modules
  its attention code imports into .cache/sglang-py and runs this file again with it on PYTHONPATH):
  `register()` against SGLang's own registry, SGLang's own ReqToTokenPool / MHATokenToKVPool /
  RadixAttention / ForwardBatch on CPU, and outputs compared with SGLang's TorchNativeAttnBackend.
"""
import importlib.util
import os
from types import SimpleNamespace

import pytest
import torch

from kvsparse._ffi import ffi
from kvsparse.sglang_backend import KvSparseSGLangBackend
from conftest import NoHostRead
from test_binding import _reference

H, KH, D, P = 9, 3, 64, 16


class _Mode:
    def __init__(self, name):
        self.name = name

    def is_idle(self):
        return self.name == "IDLE"

    def is_decode(self):
        return self.name == "DECODE"

    def is_extend(self):
        return self.name == "EXTEND"

    def is_mixed(self):
        return self.name == "MIXED"


class _ReqPool:
    """SGLang's ReqToTokenPool contract: req_to_token [rows, ctx] int32, req_generation, free_rows."""

    def __init__(self, rows, ctx):
        self.req_to_token = torch.zeros(rows + 1, ctx, dtype=torch.int32)
        self.req_generation = torch.zeros(rows + 1, dtype=torch.int64)
        self.free_slots = list(range(1, rows + 1))

    def alloc_row(self):
        r = self.free_slots.pop()
        self.req_generation[r] += 1
        return r

    def free_rows(self, indices):
        self.free_slots.extend(indices)


class _KVPool:
    """SGLang's MHATokenToKVPool contract: per layer K and V buffers [size + page, kv_heads, head_dim]."""

    def __init__(self, pages, layers, dtype):
        self.dtype = self.store_dtype = dtype
        self.k = [torch.zeros((pages + 1) * P, KH, D, dtype=dtype) for _ in range(layers)]
        self.v = [torch.zeros((pages + 1) * P, KH, D, dtype=dtype) for _ in range(layers)]

    def get_key_buffer(self, i):
        return self.k[i]

    def get_value_buffer(self, i):
        return self.v[i]


def _runner(layers=3, pages=64, dtype=torch.float32):
    mc = SimpleNamespace(num_attention_heads=H, num_hidden_layers=layers, head_dim=D,
                         get_num_kv_heads=lambda tp: KH)
    return SimpleNamespace(device="cpu", req_to_token_pool=_ReqPool(8, 1024), page_size=P, tp_size=1,
                           token_to_kv_pool=_KVPool(pages, layers, dtype), model_config=mc)


def _layer(i):
    return SimpleNamespace(layer_id=i, tp_q_head_num=H, tp_k_head_num=KH, qk_head_dim=D, v_head_dim=D,
                           scaling=D ** -0.5, logit_cap=0.0, sliding_window_size=-1, is_cross_attention=False,
                           attn_type=None)


class _Sim:
    """A tiny SGLang scheduler: page allocation, req_to_token, forward batches; keeps every K/V for the
    reference."""

    def __init__(self, runner):
        self.r = runner
        self.free_pages = list(range(1, runner.token_to_kv_pool.k[0].shape[0] // P))[::-1]
        self.reqs = {}  # rid -> dict(row, pages, len, k[layers], v[layers])

    def _slots(self, req, n_new):
        out = []
        for pos in range(req["len"], req["len"] + n_new):
            if pos % P == 0:
                req["pages"].append(self.free_pages.pop())
            slot = req["pages"][pos // P] * P + pos % P
            self.r.req_to_token_pool.req_to_token[req["row"], pos] = slot
            out.append(slot)
        return out

    def batch(self, new_tokens, mode):
        """new_tokens: {rid: n}. Returns (forward batch, per-layer k, v for the new rows)."""
        rows, seq_lens, ext, loc = [], [], [], []
        for rid, n in new_tokens.items():
            if rid not in self.reqs:
                self.reqs[rid] = dict(row=self.r.req_to_token_pool.alloc_row(), pages=[], len=0, k=None, v=None)
            req = self.reqs[rid]
            loc += self._slots(req, n)
            req["len"] += n
            rows.append(req["row"]); seq_lens.append(req["len"]); ext.append(n)
        # SGLang's ForwardBatch: device tensors and their host mirrors (seq_lens_cpu, extend_seq_lens_cpu).
        fb = SimpleNamespace(forward_mode=_Mode(mode), req_pool_indices=torch.tensor(rows),
                             seq_lens=torch.tensor(seq_lens), extend_seq_lens=torch.tensor(ext),
                             out_cache_loc=torch.tensor(loc), rids=list(new_tokens),
                             seq_lens_cpu=torch.tensor(seq_lens), extend_seq_lens_cpu=list(ext))
        return fb

    def finish(self, rid):
        req = self.reqs.pop(rid)
        self.free_pages += req["pages"]
        self.r.req_to_token_pool.free_rows([req["row"]])


def _run_layer(be, sim, fb, layer, new_tokens, dtype):
    T = sum(new_tokens.values())
    q = torch.randn(T, H * D, dtype=dtype)
    k = torch.randn(T, KH * D, dtype=dtype)
    v = torch.randn(T, KH * D, dtype=dtype)
    o = be.forward(q, k.view(T, KH, D), v.view(T, KH, D), layer, fb)  # RadixAttention's shapes
    off = 0
    for rid, n in new_tokens.items():
        req = sim.reqs[rid]
        kk, vv = k[off:off + n].view(n, KH, D), v[off:off + n].view(n, KH, D)
        hist = req.setdefault("hist", {})
        pk, pv = hist.get(layer.layer_id, (kk[:0], vv[:0]))
        hist[layer.layer_id] = (torch.cat([pk, kk]), torch.cat([pv, vv]))
        ref = _reference(q[off:off + n].view(n, H, D), *hist[layer.layer_id], layer.scaling)
        torch.testing.assert_close(o[off:off + n].view(n, H, D).double(), ref, atol=1e-5, rtol=1e-5)
        off += n
    return o


def test_extend_chunked_decode_and_row_reuse_match_reference():
    torch.manual_seed(3)
    r = _runner()
    be = KvSparseSGLangBackend(r, policy="", num_threads=1)
    sim = _Sim(r)
    layers = [_layer(i) for i in range(3)]
    steps = [({"a": 37, "b": 5}, "EXTEND"),  # two prefills
             ({"a": 1, "b": 1}, "DECODE"),
             ({"c": 20}, "EXTEND"),  # chunked prefill: first chunk ...
             ({"a": 1, "b": 1, "c": 30}, "MIXED"),  # ... second chunk with a 20-token prefix, decode rows mixed in
             ({"a": 1, "b": 1, "c": 1}, "DECODE")]
    for new, mode in steps:
        fb = sim.batch(new, mode)
        be.init_forward_metadata(fb)
        for L in layers:
            _run_layer(be, sim, fb, L, new, torch.float32)
    st = be.engine.stats()
    assert (st["sequences_created"], st["live_sequences"]) == (3, 3)
    # "b" finishes: SGLang frees its pool row -> its state goes at once; "d" gets the same row next.
    row_b = sim.reqs["b"]["row"]
    sim.finish("b")
    assert be.engine.stats()["sequences_released"] == 1
    fb = sim.batch({"d": 17, "a": 1}, "MIXED")
    assert sim.reqs["d"]["row"] == row_b
    be.init_forward_metadata(fb)
    for L in layers:
        _run_layer(be, sim, fb, L, {"d": 17, "a": 1}, torch.float32)
    for rid in list(sim.reqs):
        sim.finish(rid)
    st = be.engine.stats()
    print(f"sglang stand-in lifecycle: created {st['sequences_created']} released {st['sequences_released']} "
          f"live {st['live_sequences']}")
    assert (st["sequences_created"], st["sequences_released"], st["live_sequences"]) == (4, 4, 0)
    assert be.released_rows == 4


def test_pool_without_free_rows_is_refused():
    """Without free_rows the backend could not see requests end (their state would outlive them)."""
    r = _runner()
    pool = r.req_to_token_pool
    r.req_to_token_pool = SimpleNamespace(req_to_token=pool.req_to_token, req_generation=pool.req_generation)
    with pytest.raises(NotImplementedError, match="no free_rows"):
        KvSparseSGLangBackend(r, policy="", num_threads=1)


def _no_host_reads(fb):
    """The batch as on a GPU: device tensors whose values the backend may not read (host mirrors stay)."""
    for f in ("req_pool_indices", "seq_lens", "extend_seq_lens", "out_cache_loc"):
        setattr(fb, f, getattr(fb, f).as_subclass(NoHostRead))
    return fb


@pytest.mark.parametrize("graphs", [False, True])
def test_metadata_reads_no_device_tensor_and_graph_buffers_stay_put(graphs):
    """The metadata and forward path never read a batch tensor's values on the host (on a GPU that would be a
    sync per step), with SGLang's host mirrors giving lengths. With CUDA-graph state, decode batches reuse
    the persistent buffers in place (a captured graph reads their addresses) and write each layer's output
    into the layer's persistent buffer; the capture-time metadata plans for the table's whole width."""
    torch.manual_seed(6)
    r = _runner(layers=2)
    be = KvSparseSGLangBackend(r, policy="", num_threads=1)
    be.host_checks = False  # as on a GPU: no value checks of device tensors
    if graphs:
        be.init_cuda_graph_state(max_bs=4, max_num_tokens=4)
    sim = _Sim(r)
    layers = [_layer(0), _layer(1)]
    ptrs = set()
    for new, mode in [({"a": 33, "b": 17}, "EXTEND"), ({"a": 1, "b": 1}, "DECODE"),
                      ({"c": 9, "a": 1}, "MIXED"), ({"a": 1, "b": 1, "c": 1}, "DECODE"),
                      ({"a": 1, "b": 1, "c": 1}, "DECODE")]:
        fb = _no_host_reads(sim.batch(new, mode))
        be.init_forward_metadata(fb)
        if mode == "DECODE":
            ptrs.add(int(ffi.cast("uintptr_t", be.forward_metadata.block_table.data)))
        for L in layers:
            o = _run_layer(be, sim, fb, L, new, torch.float32)
            if graphs and mode == "DECODE":
                assert o.data_ptr() == be._graph["out"][L.layer_id].data_ptr()
    if graphs:
        assert ptrs == {be._graph["table"].data_ptr()}
        fb = _no_host_reads(sim.batch({"a": 1, "b": 1}, "DECODE"))
        be.init_forward_metadata_out_graph(fb, in_capture=True)
        assert be.forward_metadata.max_seq_len == 0 and be.forward_metadata.num_tokens == 2


def test_sparse_policy_visits_fewer_blocks_than_dense():
    torch.manual_seed(4)
    r = _runner(layers=1, pages=80)
    be = KvSparseSGLangBackend(r, policy="quest(budget=64); dense_layers=0", num_threads=1)
    sim = _Sim(r)
    L = _layer(0)
    fb = sim.batch({"a": 600, "b": 300}, "EXTEND"); be.init_forward_metadata(fb)
    be.forward(torch.randn(900, H * D), torch.randn(900, KH * D), torch.randn(900, KH * D), L, fb)
    fb = sim.batch({"a": 1, "b": 1}, "DECODE"); be.init_forward_metadata(fb)
    o = be.forward(torch.randn(2, H * D), torch.randn(2, KH * D), torch.randn(2, KH * D), L, fb)
    assert torch.isfinite(o).all()
    st = be.engine.stats()
    print(f"quest(budget=64) via the SGLang backend: visited/eligible {st['blocks_visited']}/{st['blocks_eligible']}")
    assert st["policy_rows"] == 2 * KH and 0 < st["blocks_visited"] < st["blocks_eligible"]


def test_quantized_kv_pool_is_refused_at_creation():
    r = _runner()
    r.token_to_kv_pool.dtype = torch.float8_e4m3fn
    r.token_to_kv_pool.store_dtype = torch.uint8
    with pytest.raises(ValueError, match="KVS_ERR_UNSUPPORTED"):
        KvSparseSGLangBackend(r)


# ---- with SGLang's own classes ----------------------------------------------------------------------

def _sglang():
    # KVS_REQUIRE_SGLANG=1 (set by scripts/python-tests.sh for its SGLang run) turns the skip into a failure.
    miss = pytest.fail if os.environ.get("KVS_REQUIRE_SGLANG") == "1" else pytest.skip
    if importlib.util.find_spec("sglang") is None:
        miss("sglang not importable (scripts/python-tests.sh runs this again with .cache/sglang-py)")
    try:
        from sglang.srt.layers.attention import attention_registry
    except Exception as e:  # noqa: BLE001
        miss(f"sglang's attention registry does not import here: {e!r}")
    return attention_registry


def test_real_sglang_registry_pools_and_torch_native_reference():
    reg = _sglang()
    from sglang.srt.arg_groups.choices import ATTENTION_BACKEND_CHOICES
    from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

    from kvsparse import sglang_backend

    # Registration the way SGLang's plugin loader does it (entry point group sglang.srt.plugins).
    from importlib.metadata import entry_points
    eps = [e for e in entry_points(group="sglang.srt.plugins") if e.name == "kvsparse"]
    assert eps and eps[0].value == "kvsparse.sglang_backend:register"
    eps[0].load()()
    assert "kvsparse" in ATTENTION_BACKEND_CHOICES
    assert reg.ATTENTION_BACKENDS["kvsparse"] is sglang_backend.create_kvsparse_backend

    torch.manual_seed(5)
    layers_n, rows, ctx = 2, 8, 512
    req_pool = ReqToTokenPool(size=rows, max_context_len=ctx, device="cpu", enable_memory_saver=False)

    def kv_pool():
        return MHATokenToKVPool(size=1024, page_size=P, dtype=torch.float32, head_num=KH, head_dim=D,
                                layer_num=layers_n, device="cpu", enable_memory_saver=False)

    mc = SimpleNamespace(num_attention_heads=H, num_hidden_layers=layers_n, head_dim=D,
                         get_num_kv_heads=lambda tp: KH)
    runner = SimpleNamespace(device="cpu", req_to_token_pool=req_pool, token_to_kv_pool=kv_pool(),
                             page_size=P, tp_size=1, model_config=mc)
    ref_runner = SimpleNamespace(device="cpu", req_to_token_pool=req_pool, token_to_kv_pool=kv_pool())
    be = reg.ATTENTION_BACKENDS["kvsparse"](runner)
    assert isinstance(be, AttentionBackend)
    ref = TorchNativeAttnBackend(ref_runner)
    layers = [RadixAttention(H, D, D ** -0.5, KH, layer_id=i) for i in range(layers_n)]

    free_pages = list(range(1, 1024 // P))[::-1]
    reqs = {}

    def batch(new, mode):
        rws, lens, ext, pre, loc = [], [], [], [], []
        for rid, n in new.items():
            if rid not in reqs:
                reqs[rid] = dict(row=req_pool.alloc_rows(1)[0], pages=[], len=0)
            q = reqs[rid]
            for pos in range(q["len"], q["len"] + n):
                if pos % P == 0:
                    q["pages"].append(free_pages.pop())
                s = q["pages"][pos // P] * P + pos % P
                req_pool.req_to_token[q["row"], pos] = s
                loc.append(s)
            pre.append(q["len"]); q["len"] += n
            rws.append(q["row"]); lens.append(q["len"]); ext.append(n)
        T = sum(ext)
        fb = ForwardBatch(forward_mode=mode, batch_size=len(rws), input_ids=torch.zeros(T, dtype=torch.long),
                          req_pool_indices=torch.tensor(rws), seq_lens=torch.tensor(lens),
                          out_cache_loc=torch.tensor(loc), seq_lens_sum=sum(lens), rids=list(new))
        fb.seq_lens_cpu = fb.seq_lens.clone()
        if mode != ForwardMode.DECODE:
            fb.extend_seq_lens = torch.tensor(ext, dtype=torch.int32)
            fb.extend_prefix_lens = torch.tensor(pre, dtype=torch.int32)
            fb.extend_seq_lens_cpu, fb.extend_prefix_lens_cpu = ext, pre
        return fb, T

    worst = 0.0
    for new, mode in [({"a": 70, "b": 9}, ForwardMode.EXTEND), ({"a": 1, "b": 1}, ForwardMode.DECODE),
                      ({"c": 33}, ForwardMode.EXTEND), ({"c": 40, "a": 1}, ForwardMode.EXTEND),
                      ({"a": 1, "b": 1, "c": 1}, ForwardMode.DECODE)]:
        fb, T = batch(new, mode)
        be.init_forward_metadata(fb)
        ref.init_forward_metadata(fb)
        for L in layers:
            # as RadixAttention.forward hands them to the backend: q [T, H*D], k/v [T, KH, D]
            q, k, v = torch.randn(T, H * D), torch.randn(T, KH, D), torch.randn(T, KH, D)
            o = be.forward(q, k, v, L, fb)
            o_ref = ref.forward(q, k, v, L, fb)
            worst = max(worst, float((o - o_ref).abs().max()))
            torch.testing.assert_close(o, o_ref, atol=1e-5, rtol=1e-5)
            # kvs_cache_write put K/V where SGLang's set_kv_buffer put them.
            torch.testing.assert_close(runner.token_to_kv_pool.get_key_buffer(L.layer_id),
                                       ref_runner.token_to_kv_pool.get_key_buffer(L.layer_id))
    print(f"kvsparse vs SGLang torch_native: max |diff| {worst:.2e}")
    st = be.engine.stats()
    assert (st["sequences_created"], st["live_sequences"]) == (3, 3)
    req_pool.free_rows([reqs["b"]["row"]])  # what SGLang's ReqToTokenPool.free(req) does when b finishes
    assert be.engine.stats()["sequences_released"] == 1
