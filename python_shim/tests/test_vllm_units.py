"""The vLLM backend's pieces in-process (no LLM(...) start): the metadata builder reads no metadata tensor on
the host, request ids under model runner V2's contract, what the backend declares to vLLM."""
import inspect
from types import SimpleNamespace

import numpy as np
import pytest
import torch

pytest.importorskip("vllm")

from vllm.v1.attention.backend import AttentionCGSupport, CommonAttentionMetadata  # noqa: E402

from kvsparse import Engine  # noqa: E402
from kvsparse.engine import KvsError  # noqa: E402
from kvsparse import vllm_backend, vllm_runner  # noqa: E402
from kvsparse.step import LayerCall  # noqa: E402
from conftest import NoHostRead  # noqa: E402
from test_binding import _reference  # noqa: E402

H, KH, D, BS, NB = 9, 3, 64, 16, 24


def _vllm_config(policy=None, device="cpu", graphs="NONE"):
    extra = {"kvsparse": {"policy": policy}} if policy is not None else {}
    return SimpleNamespace(
        additional_config=extra, device_config=SimpleNamespace(device=torch.device(device)),
        scheduler_config=SimpleNamespace(max_num_seqs=8, max_num_batched_tokens=64),
        compilation_config=SimpleNamespace(cudagraph_mode=SimpleNamespace(name=graphs)))


@pytest.fixture
def engine(monkeypatch):
    eng = Engine(num_layers=1, num_q_heads=H, num_kv_heads=KH, head_dim=D, block_size=BS, dtype=torch.float32,
                 num_threads=1)
    monkeypatch.setattr(vllm_backend, "_ENGINE", eng)
    return eng


def test_builder_reads_no_metadata_on_the_host_and_its_step_attends_correctly(engine):
    torch.manual_seed(0)
    b = vllm_backend.KvSparseMetadataBuilder(SimpleNamespace(block_size=BS), ["model.layers.0.self_attn.attn"],
                                            _vllm_config(), torch.device("cpu"))
    raw = torch.zeros(NB, BS, KH, 2 * D)
    kv = raw.permute(0, 2, 1, 3)
    kc, vc = vllm_backend.kv_views(kv, D)
    lens, tables = [40, 7], [[4, 9, 2, 0], [11, 0, 0, 0]]
    ks = [torch.randn(n, KH, D) for n in lens]
    vs = [torch.randn(n, KH, D) for n in lens]
    c = LayerCall(engine, 0, scale=D ** -0.5)
    c.set_caches(kv, kc, vc)
    for s, n in enumerate(lens):
        c.write(ks[s], vs[s], torch.tensor([tables[s][p // BS] * BS + p % BS for p in range(n)]))
    # vLLM's persistent buffers (more rows than requests), as tensors whose values may not be read on the host.
    qsl = torch.zeros(9, dtype=torch.int32)
    qsl[1:3] = torch.tensor([1, 2])
    seq_lens = torch.zeros(8, dtype=torch.int32)
    seq_lens[:2] = torch.tensor(lens)
    table = torch.zeros(8, 6, dtype=torch.int32)
    table[:2, :4] = torch.tensor(tables)
    m = CommonAttentionMetadata(
        query_start_loc=qsl[:3].as_subclass(NoHostRead), query_start_loc_cpu=qsl[:3].clone(),
        seq_lens=seq_lens[:2].as_subclass(NoHostRead), num_reqs=2, num_actual_tokens=2, max_query_len=1,
        max_seq_len=40, block_table_tensor=table[:2].as_subclass(NoHostRead),
        slot_mapping=torch.zeros(2, dtype=torch.int64).as_subclass(NoHostRead))
    meta = b.build(0, m)
    assert meta.max_seq_len == 40 and meta.seq_ids.shape == (2,)
    q = torch.randn(2, H, D)
    out = torch.empty(2, H * D)
    c.attend(q, out, meta.step)
    for s in range(2):
        ref = _reference(q[s:s + 1], ks[s], vs[s], D ** -0.5)
        torch.testing.assert_close(out[s].view(1, H, D).double(), ref, atol=1e-5, rtol=1e-5)
    # A capture build plans for the table's width (max_seq_len 0), so the graph stays valid as sequences grow.
    assert b.build_for_cudagraph_capture(m).max_seq_len == 0


def test_backend_declarations(engine):
    be = vllm_backend.KvSparseBackend
    assert be.get_supported_head_sizes() == [64, 80, 96, 112, 128, 192, 256]
    assert be.supports_head_size(128) and not be.supports_head_size(72)
    # vLLM accepts any cache block size a kernel size divides and addresses the cache in kernel blocks.
    assert be.supports_block_size(16) and be.supports_block_size(256)
    assert [vllm_backend.kernel_block_size(b) for b in (16, 128, 12, 512, 528)] == [16, 128, 4, 256, 16]
    # The layout vLLM resolves from our declaration: on this (CPU) vLLM head-major blocks for the engine's
    # narrow tokens (3 KV heads x 64 x 2 x 4 bytes), token-major for wide ones and on CUDA.
    from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts
    from vllm.v1.kv_cache_interface import KVCacheLayout
    assert get_supported_kv_cache_layouts((be,))[0] == KVCacheLayout.LBHNC
    assert vllm_backend.preferred_layouts(cpu=True, token_bytes=8 * 2 * 128 * 2)[0] == KVCacheLayout.LBNHC
    assert vllm_backend.preferred_layouts(cpu=False)[0] == KVCacheLayout.LBNHC
    cg = vllm_backend.KvSparseMetadataBuilder.get_cudagraph_support
    assert cg(_vllm_config(device="cuda"), None) == AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
    # The policies the library reports graph-capturable (kvs_policy_query: the stages that passed a GPU graph
    # check) join vLLM's decode graphs; stages not checked on the GPU keep attention out of them.
    for spec in ("quest(budget=256)", "quest(budget=256) > top_p(p=0.9)", "streaming(sink=4, recent=256)", "quest(budget=256) > art(tau=1e-5)"):
        assert cg(_vllm_config(spec, device="cuda"), None) == AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE, spec
    for spec in ("refresh(k=64, every=4)", "predictor(budget=64)", "speculate(over=quest(budget=64))", "snapkv(budget=256)"):
        assert cg(_vllm_config(spec, device="cuda"), None) == AttentionCGSupport.NEVER, spec
    assert cg(_vllm_config(device="cpu"), None) == AttentionCGSupport.NEVER
    assert cg(_vllm_config("quest(budget=256)", device="cpu"), None) == AttentionCGSupport.NEVER
    # Never a level that would let vLLM capture prefill rows (their launch grids follow host-known query
    # lengths) or multi-token decodes (not checked on the GPU).
    levels = {cg(_vllm_config(p, device=d), None) for p in (None, "quest(budget=8)", "top_p(p=0.9)") for d in ("cpu", "cuda")}
    assert levels <= {AttentionCGSupport.NEVER, AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE}
    assert vllm_backend.graph_capturable("") and vllm_backend.graph_capturable("   ")
    # The decision is the library's, by the parsed pipeline: options, nesting and bare stage names alike.
    assert vllm_backend.graph_capturable("quest(budget=1024); dense_layers=0")
    assert vllm_backend.graph_capturable("quest(budget=1024) > top_p(p=0.9) > art")
    assert not vllm_backend.graph_capturable("speculate(over=quest(budget=64))")
    with pytest.raises(KvsError):  # a malformed spec is the parser's error, not a guess
        vllm_backend.graph_capturable("quest(budget=")


def test_v2_runner_request_ids_follow_req_idx_slots(monkeypatch):
    """Model runner V2 (vllm/v1/worker/gpu/, vLLM's default wherever Triton is installed) cannot start on this
    CPU; its contract is exercised here: the row -> request slot map `CommonAttentionMetadata.req_idx`, the
    slot -> request id map `req_states.index_to_req_id`, finished/preempted requests in the scheduler output,
    `execute_model(..., dummy_run=True)` for dummy batches. The runner is a subclass of vLLM's real V2 class
    whose execute_model does what V2's does around metadata building."""
    from vllm.v1.worker.gpu import states
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner as V2

    assert "dummy_run" in inspect.signature(V2.execute_model).parameters
    assert "self.index_to_req_id" in inspect.getsource(states.RequestState)
    released = []
    monkeypatch.setattr(vllm_runner.TRACKER, "release_fn", lambda sid, missing_ok: released.append(sid) or True)

    class Runner(V2):
        def __init__(self):  # noqa: D107 - not V2's: only what the request-id path reads
            self.req_states = SimpleNamespace(index_to_req_id={})

        def execute_model(self, scheduler_output, intermediate_tensors=None, dummy_run=False):
            slots = self.req_states.index_to_req_id
            if not dummy_run:
                for r in scheduler_output.finished_req_ids | scheduler_output.preempted_req_ids:
                    slots.pop(next(i for i, x in slots.items() if x == r))
                for i, r in scheduler_output.new:
                    slots[i] = r
            rows = sorted(slots) if not dummy_run else [0, 1]
            n = len(rows) + 1  # one CUDA-graph padding row
            common = SimpleNamespace(num_reqs=n, req_idx=np.array(rows, dtype=np.int32))
            return vllm_runner.TRACKER.batch_ids(common)

    def out(finished=(), preempted=(), new=()):
        return SimpleNamespace(finished_req_ids=set(finished), preempted_req_ids=set(preempted),
                               scheduled_cached_reqs=None, new=list(new))

    runner = Runner()
    self = runner  # noqa: F841 - find_runner looks for the runner as `self` in its callers' frames
    assert vllm_runner.find_runner() is runner
    vllm_runner.install(runner)
    assert vllm_runner.hooked(Runner)
    a = runner.execute_model(out(new=[(0, "a"), (1, "b")]))
    assert a[2] >= vllm_runner.EPHEMERAL_BASE  # the padding row
    b = runner.execute_model(out())
    assert b[:2] == a[:2], "ids stay with their requests from step to step"
    d = runner.execute_model(None, dummy_run=True)
    assert all(x >= vllm_runner.EPHEMERAL_BASE for x in d)
    c = runner.execute_model(out(finished=["a"], new=[(0, "c")]))  # "c" takes "a"'s slot
    assert a[0] in released and c[0] not in (a[0], a[1]) and c[1] == a[1]
    e = runner.execute_model(out(preempted=["b"], new=[(1, "b")]))  # V2 re-adds a resumed request as new
    assert a[1] in released and e[1] != a[1] and e[0] == c[0]
    assert vllm_runner.TRACKER.lifecycle()["b"] == [2, 1, 1]  # assigned, released, restarts


def test_builder_never_waits_for_the_device(engine, monkeypatch):
    """The periodic stats line reads the engine's counters, which synchronizes a CUDA device: off by default on
    CUDA, on request only, and never in a CUDA-graph capture build. (Builds read no metadata on the host:
    test_builder_reads_no_metadata_on_the_host_and_its_step_attends_correctly.)"""
    monkeypatch.delenv("KVSPARSE_LOG_EVERY", raising=False)
    assert vllm_backend.log_every(torch.device("cuda", 0)) == 0
    assert vllm_backend.log_every(torch.device("cpu")) == 64
    monkeypatch.setenv("KVSPARSE_LOG_EVERY", "8")
    assert vllm_backend.log_every(torch.device("cuda", 0)) == 8
    monkeypatch.setenv("KVSPARSE_LOG_EVERY", "1")
    logged = []
    monkeypatch.setattr(vllm_backend, "log_stats", lambda e: logged.append(e))
    b = vllm_backend.KvSparseMetadataBuilder(SimpleNamespace(block_size=BS), ["model.layers.0.self_attn.attn"],
                                            _vllm_config(), torch.device("cpu"))
    qsl = torch.tensor([0, 1], dtype=torch.int32)
    m = CommonAttentionMetadata(
        query_start_loc=qsl.as_subclass(NoHostRead), query_start_loc_cpu=qsl.clone(),
        seq_lens=torch.tensor([5], dtype=torch.int32).as_subclass(NoHostRead), num_reqs=1, num_actual_tokens=1,
        max_query_len=1, max_seq_len=5, block_table_tensor=torch.zeros(1, 2, dtype=torch.int32).as_subclass(NoHostRead),
        slot_mapping=torch.zeros(1, dtype=torch.int64).as_subclass(NoHostRead))
    for _ in range(3):
        b.build_for_cudagraph_capture(m)
    assert logged == []
    b.build(0, m)
    assert logged == [engine]


def test_kv_views_read_head_major_blocks_as_k_and_v_planes_and_token_major_rows_as_halves():
    B, KH_, N, D_ = 3, 2, 4, 5
    # Head-major (LBHNC, contiguous): each (block, head) plane of N x 2D holds K's N rows, then V's.
    hm = torch.arange(B * KH_ * N * 2 * D_, dtype=torch.float32).reshape(B, KH_, N, 2 * D_)
    k, v = vllm_backend.kv_views(hm, D_)
    assert k.shape == v.shape == (B, N, KH_, D_)
    for b in range(B):
        for h in range(KH_):
            plane = hm[b, h].flatten()
            assert torch.equal(k[b, :, h], plane[: N * D_].view(N, D_))
            assert torch.equal(v[b, :, h], plane[N * D_:].view(N, D_))
    assert k.data_ptr() == hm.data_ptr() and v.untyped_storage().data_ptr() == hm.untyped_storage().data_ptr()
    # Token-major (LBNHC): K and V are the halves of every token's row.
    tm = torch.arange(B * N * KH_ * 2 * D_, dtype=torch.float32).reshape(B, N, KH_, 2 * D_).permute(0, 2, 1, 3)
    k, v = vllm_backend.kv_views(tm, D_)
    assert torch.equal(k, tm.transpose(1, 2)[..., :D_]) and torch.equal(v, tm.transpose(1, 2)[..., D_:])
    # Writes through the views land in the cache (no copies).
    k[1, 2, 1] = -1.0
    assert (tm.transpose(1, 2)[1, 2, 1, :D_] == -1.0).all()


@pytest.mark.parametrize("spec,want", [
    ("refresh(k=64)", "refresh(k=64); max_seqs=8"),
    ("predictor(budget=64); max_seqs=3", "predictor(budget=64); max_seqs=3"),
    ("quest(budget=64)", "quest(budget=64)"),
])
def test_engine_keeps_state_for_vllms_max_num_seqs(monkeypatch, spec, want):
    """get_engine hands a stateful policy vLLM's max_num_seqs as `max_seqs` (a CUDA engine allocates every
    slot's state up front), unless the spec sets it; stateless specs go through as written."""
    monkeypatch.setattr(vllm_backend, "_ENGINE", None)
    monkeypatch.setattr(vllm_backend.TRACKER, "release_fn", vllm_backend.TRACKER.release_fn, raising=False)
    cfg = _vllm_config(policy=spec)
    cfg.model_config = SimpleNamespace(get_num_layers=lambda pc: 1, dtype=torch.float32)
    cfg.parallel_config = SimpleNamespace()
    cfg.cache_config = SimpleNamespace(block_size=BS, cache_dtype="auto")
    eng = vllm_backend.get_engine(cfg, num_q_heads=H, num_kv_heads=KH, head_dim=D)
    assert eng.policy == want
    assert eng.policy_info()["stateful"] == ("quest" not in spec)
