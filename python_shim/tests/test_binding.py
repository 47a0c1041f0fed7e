"""The cffi binding: header parsing, engine errors, and attention on small tensors vs torch."""
import math

import pytest
import torch

import kvsparse
from kvsparse import Engine, KvsError
from kvsparse._ffi import HEADER_PATH, ffi


def test_abi_version_matches_header():
    text = HEADER_PATH.read_text()
    assert f"#define KVS_ABI_VERSION {kvsparse.abi_version()}" in text


def test_policy_info_is_the_librarys_reading_of_the_spec():
    """kvs_policy_query / kvs_engine_policy: stages, dense layers, state and graph capture as the library
    parses them (the shim decides nothing about a spec by itself)."""
    from kvsparse.engine import policy_info
    assert policy_info("") == {"num_stages": 0, "dense_layers": 2, "stateful": False, "graph_capturable": True}
    q = policy_info("quest(budget=256) > top_p(p=0.9) > art; dense_layers=1")
    assert q == {"num_stages": 3, "dense_layers": 1, "stateful": False, "graph_capturable": True}
    for spec in ("snapkv(budget=64)", "speculate(over=quest(budget=64))", "refresh(k=64)", "predictor(budget=64)"):
        info = policy_info(spec)
        assert info["stateful"] and not info["graph_capturable"], spec
    with pytest.raises(KvsError, match="policy_query"):
        policy_info("quest(budget=")
    e = Engine(num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=16, policy="streaming(sink=4, recent=64)")
    assert e.policy_info() == policy_info("streaming(sink=4, recent=64)")


def test_with_max_seqs_sizes_only_stateful_policies_the_spec_leaves_open():
    """Serving plugins pass their concurrency: stateful policies get `max_seqs`, others and specs that set
    it stay as written, and what comes out is still a spec the library accepts."""
    from kvsparse.engine import with_max_seqs, policy_info
    assert with_max_seqs("", 8) == ""
    assert with_max_seqs("quest(budget=256) > top_p(p=0.9)", 8) == "quest(budget=256) > top_p(p=0.9)"
    assert with_max_seqs("refresh(k=64)", 8) == "refresh(k=64); max_seqs=8"
    assert with_max_seqs("predictor(budget=64); dense_layers=1", 3) == "predictor(budget=64); dense_layers=1; max_seqs=3"
    assert with_max_seqs("snapkv(budget=64); max_seqs=5", 8) == "snapkv(budget=64); max_seqs=5"
    assert with_max_seqs("refresh(k=64)", 0) == "refresh(k=64); max_seqs=1"
    assert with_max_seqs("refresh(k=64)", None) == "refresh(k=64)"
    assert with_max_seqs("refresh(k=64)", 1 << 40) == f"refresh(k=64); max_seqs={1 << 20}"
    for spec in ("refresh(k=64); max_seqs=8", "predictor(budget=64); dense_layers=1; max_seqs=3",
                 f"refresh(k=64); max_seqs={1 << 20}"):
        assert policy_info(spec)["stateful"], spec
    with pytest.raises(KvsError, match="policy_query"):
        with_max_seqs("refresh(k=", 8)


def test_struct_sizes_come_from_header():
    # Every config/args struct starts with struct_size; the layout is cffi's reading of the header.
    assert ffi.offsetof("kvs_forward_args", "struct_size") == 0
    assert ffi.sizeof("kvs_stats") == 8 + 8 * 22


@pytest.mark.parametrize("kw,status,text", [
    (dict(head_dim=65), "KVS_ERR_UNSUPPORTED", "head_dim 65"),
    (dict(policy="nosuchpolicy(k=1)"), "KVS_ERR_INVALID_ARGUMENT", "nosuchpolicy"),
    (dict(num_kv_heads=4), None, "num_kv_heads"),
])
def test_bad_config_fails_with_kvsparse_message(kw, status, text):
    cfg = dict(num_layers=2, num_q_heads=9, num_kv_heads=3, head_dim=64, block_size=16, dtype=torch.float32)
    cfg.update(kw)
    with pytest.raises(KvsError) as e:
        Engine(**cfg)
    if status:
        assert e.value.status == status
    assert text in str(e.value)


def _reference(q, k, v, scale):
    # q [t, H, D], k/v [s, KH, D]; causal with q rows at the end of the sequence
    t, H, _ = q.shape
    s, KH, _ = k.shape
    g = H // KH
    kk = k.repeat_interleave(g, dim=1).double()
    vv = v.repeat_interleave(g, dim=1).double()
    logits = torch.einsum("thd,shd->hts", q.double(), kk) * scale
    pos = torch.arange(s - t, s)[:, None]
    mask = torch.arange(s)[None, :] > pos
    logits = logits.masked_fill(mask[None], -math.inf)
    return torch.einsum("hts,shd->thd", logits.softmax(-1), vv)


@pytest.mark.parametrize("layout", ["LBNHC", "LBHNC", "LBHNC-planes"])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_cache_write_and_forward_match_reference_on_strided_vllm_cache(dtype, tol, layout):
    torch.manual_seed(0)
    H, KH, D, bs, nb = 9, 3, 64, 16, 12
    eng = Engine(num_layers=1, num_q_heads=H, num_kv_heads=KH, head_dim=D, block_size=bs, dtype=dtype)
    # vLLM's logical [blocks, kv_heads, block_size, 2*D], token-major (LBNHC) or head-major (LBHNC) in memory;
    # K and V the halves of every row, or (planes, what the vLLM plugin reads on the CPU) the halves of each
    # block's plane of one head.
    if layout == "LBNHC":
        kv_cache = torch.zeros(nb, bs, KH, 2 * D, dtype=dtype).permute(0, 2, 1, 3)
    else:
        kv_cache = torch.zeros(nb, KH, bs, 2 * D, dtype=dtype)
    if layout == "LBHNC-planes":
        planes = kv_cache.view(nb, KH, 2, bs, D)
        kc, vc = planes[:, :, 0].transpose(1, 2), planes[:, :, 1].transpose(1, 2)
    else:
        kc, vc = kv_cache.transpose(1, 2).split(D, dim=-1)
    lens, qlens = [37, 5], [37, 1]  # one prefill, one decode row
    tables = torch.tensor([[3, 7, 1, 0], [9, 2, 0, 0]], dtype=torch.int32)
    ks = [torch.randn(n, KH, D, dtype=dtype) for n in lens]
    vs = [torch.randn(n, KH, D, dtype=dtype) for n in lens]
    for s, n in enumerate(lens):
        slots = torch.tensor([int(tables[s, p // bs]) * bs + p % bs for p in range(n)], dtype=torch.int64)
        eng.cache_write(0, ks[s], vs[s], kc, vc, slots)
    q = torch.randn(sum(qlens), H, D, dtype=dtype)
    out = torch.empty_like(q)
    qsl = torch.tensor([0, qlens[0], sum(qlens)], dtype=torch.int32)
    eng.forward(0, q, kc, vc, tables, torch.tensor(lens, dtype=torch.int32), qsl, out,
                seq_ids=torch.tensor([11, 12]), scale=D ** -0.5)
    for s in range(2):
        rows = slice(int(qsl[s]), int(qsl[s + 1]))
        ref = _reference(q[rows], ks[s], vs[s], D ** -0.5)
        assert torch.allclose(out[rows].double(), ref, atol=tol, rtol=tol)
    st = eng.stats()
    assert st["sequences_created"] == 2 and st["live_sequences"] == 2
    eng.release(11)
    with pytest.raises(KvsError) as e:
        eng.release(11)
    assert e.value.status == "KVS_ERR_UNKNOWN_SEQUENCE"
    assert eng.stats()["sequences_released"] == 1


@pytest.mark.parametrize("cache_dtype,torch_fp8,fmax", [("fp8", "float8_e4m3fn", 448.0), ("fp8_e5m2", "float8_e5m2", 57344.0)])
def test_fp8_cache_quantizes_as_vllm_and_attends_the_dequantized_values(cache_dtype, torch_fp8, fmax):
    """An FP8 cache (vLLM's kv_cache_dtype="fp8"/"fp8_e5m2", allocated as uint8): cache_write stores
    x / scale rounded to nearest even and saturated (torch's own float8 conversion of the clamped value),
    and forward attends the dequantized cache (float64 reference over it). Scales must be set first."""
    torch.manual_seed(0)
    f8 = getattr(torch, torch_fp8)
    H, KH, D, bs, nb = 8, 2, 64, 16, 6
    ks_, vs_ = 0.02, 0.01
    eng = Engine(num_layers=1, num_q_heads=H, num_kv_heads=KH, head_dim=D, block_size=bs, dtype=torch.bfloat16,
                 cache_dtype=cache_dtype)
    kv_cache = torch.zeros(nb, KH, bs, 2 * D, dtype=torch.uint8)
    kc, vc = kv_cache.transpose(1, 2).split(D, dim=-1)
    n = 40
    k = (torch.randn(n, KH, D) * 4).to(torch.bfloat16)
    v = torch.randn(n, KH, D).to(torch.bfloat16)
    table = torch.tensor([[4, 0, 2, 5]], dtype=torch.int32)
    slots = torch.tensor([int(table[0, p // bs]) * bs + p % bs for p in range(n)], dtype=torch.int64)
    with pytest.raises(KvsError, match="set_kv_scales"):
        eng.cache_write(0, k, v, kc, vc, slots)
    assert int(kv_cache.count_nonzero()) == 0
    with pytest.raises(KvsError, match="INVALID_ARGUMENT"):
        eng.set_kv_scales(0, float("nan"), 1.0)
    eng.set_kv_scales(0, ks_, vs_)
    eng.cache_write(0, k, v, kc, vc, slots)

    def stored(x, s):  # vLLM's quantization: x / scale in f32, clamped to the format's range, rounded to nearest
        x = x.float()
        return (x / torch.full_like(x, s)).clamp(-fmax, fmax).to(f8)

    rows_k = torch.stack([kc[int(table[0, p // bs]), p % bs] for p in range(n)])
    rows_v = torch.stack([vc[int(table[0, p // bs]), p % bs] for p in range(n)])
    assert torch.equal(rows_k, stored(k, ks_).view(torch.uint8))
    assert torch.equal(rows_v, stored(v, vs_).view(torch.uint8))
    assert bool((stored(k, ks_).float().abs() == fmax).any()) or cache_dtype == "fp8_e5m2"  # E4M3 saturates here
    q = torch.randn(1, H, D).to(torch.bfloat16)
    out = torch.empty_like(q)
    eng.forward(0, q, kc, vc, table, torch.tensor([n], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32),
                out, scale=D ** -0.5)
    ref = _reference(q, stored(k, ks_).float() * ks_, stored(v, vs_).float() * vs_, D ** -0.5)
    assert torch.allclose(out.double(), ref, atol=2e-2, rtol=2e-2)
    # An FP8 query is refused.
    with pytest.raises(KvsError, match="INVALID_DTYPE"):
        eng.forward(0, q.float().to(f8), kc, vc, table, torch.tensor([n], dtype=torch.int32),
                    torch.tensor([0, 1], dtype=torch.int32), out, scale=D ** -0.5)
    with pytest.raises(ValueError, match="kv_cache_dtype 'int8'"):
        Engine(num_layers=1, num_q_heads=H, num_kv_heads=KH, head_dim=D, block_size=bs, cache_dtype="int8")


def test_unsupported_dtype_is_a_clear_error():
    with pytest.raises(ValueError, match="float64"):
        Engine(num_layers=1, num_q_heads=9, num_kv_heads=3, head_dim=64, block_size=16, dtype=torch.float64)


def test_check_and_the_validate_option_on_a_cpu_engine():
    e = Engine(num_layers=1, num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=16, validate="sync")
    assert e.check() is None  # a CPU engine checks everything at the call: nothing deferred
    assert e.stats()["pending_status"] == 0
    with pytest.raises(ValueError, match="validate"):
        Engine(num_layers=1, num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=16, validate="later")


class _RecordingLib:
    """Stands in for the C library in `kvsparse.engine`: records the stream each call was given."""

    def __init__(self, real):
        self._real, self.streams = real, []

    def __getattr__(self, name):
        return getattr(self._real, name)

    def _record(self, engine, args):
        self.streams.append(int(ffi.cast("uintptr_t", args.stream)))
        return 0

    kvs_cache_write = kvs_attention_forward = _record


def test_engine_calls_go_to_torchs_current_stream_unless_given_one(monkeypatch):
    """Engine.cache_write/forward on a CUDA engine enqueue on torch's current stream (inside torch.cuda.graph:
    the capture stream) when no stream is passed, and on the given one otherwise; a CPU engine passes none.
    The C calls are replaced by a recorder: this machine has no GPU, the plumbing is what is checked."""
    import kvsparse.engine as keng

    e = Engine(num_layers=1, num_q_heads=2, num_kv_heads=1, head_dim=64, block_size=16, dtype=torch.float32,
               num_threads=1)
    rec = _RecordingLib(keng.lib)
    monkeypatch.setattr(keng, "lib", rec)
    kc = torch.zeros(2, 16, 1, 64)
    kv, slots = torch.zeros(1, 1, 64), torch.zeros(1, dtype=torch.int64)
    q, out = torch.zeros(1, 2, 64), torch.zeros(1, 2, 64)
    meta = (torch.zeros(1, 2, dtype=torch.int32), torch.ones(1, dtype=torch.int32),
            torch.tensor([0, 1], dtype=torch.int32))

    def calls(**kw):
        e.cache_write(0, kv, kv, kc, kc, slots, **kw)
        e.forward(0, q, kc, kc, *meta, out, scale=0.125, **kw)

    calls()
    calls(stream=0x1234)
    asked = []
    monkeypatch.setattr(keng, "raw_stream", lambda dev: asked.append(dev) or 0xC0FFEE)
    monkeypatch.setattr(e, "device", torch.device("cuda", 0))
    calls()
    calls(stream=0x1234)
    assert rec.streams == [0, 0, 0x1234, 0x1234, 0xC0FFEE, 0xC0FFEE, 0x1234, 0x1234]
    assert asked == [torch.device("cuda", 0)] * 2
    # Without the stand-in the real raw_stream gives 0 (no stream) for the CPU.
    from kvsparse.streams import raw_stream
    assert raw_stream(torch.device("cpu")) == 0


def _thread_names():
    import os

    names = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names[tid] = f.read().strip()
        except OSError:
            pass  # the thread exited meanwhile
    return names


@pytest.mark.parametrize("policy", ["", "quest(budget=2048); dense_layers=0"])
def test_cpu_engine_runs_on_torchs_openmp_team_and_starts_no_spinning_threads(policy):
    # Inside PyTorch the CPU engine's decode pool runs on PyTorch's OpenMP team (whose threads spin between
    # the GEMMs) instead of its own workers, also when another OpenMP runtime is mapped (vLLM's process maps
    # sentencepiece's bundled libgomp): either mistake starts threads that compete for the same cores.
    import os
    import re
    import time

    try:
        import sentencepiece  # noqa: F401  (its libgomp, where installed)
    except ImportError:
        pass
    if torch.get_num_threads() < 2 or not os.path.isdir("/proc/self/task"):
        pytest.skip("needs PyTorch with 2+ OpenMP threads and /proc")
    torch.manual_seed(0)
    a = torch.randn(512, 512)
    (a @ a).sum().item()  # PyTorch's OpenMP team is up
    torch.ones(1 << 22).sum().item()
    H, KH, D, bs, ctx = 9, 3, 64, 128, 8192  # 12 MB of f32 K/V: large enough for the pool (> 2 MB)
    nb = ctx // bs
    kc = torch.zeros(nb, bs, KH, D)
    vc = torch.zeros(nb, bs, KH, D)
    before = _thread_names()
    eng = Engine(num_layers=1, num_q_heads=H, num_kv_heads=KH, head_dim=D, block_size=bs, dtype=torch.float32,
                 num_threads=2, policy=policy)
    q = torch.randn(1, H, D)
    out = torch.empty_like(q)
    table = torch.randperm(nb).to(torch.int32).reshape(1, -1)
    slots = (table[0].long()[:, None] * bs + torch.arange(bs)).reshape(-1)
    eng.cache_write(0, torch.randn(ctx, KH, D), torch.randn(ctx, KH, D), kc, vc, slots)  # (Quest's page bounds too)

    def busy_ticks():  # CPU time (clock ticks) of the engine's own threads
        ticks = 0
        for tid in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{tid}/comm") as f:
                    if not f.read().startswith("kvsparse"):
                        continue
                with open(f"/proc/self/task/{tid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                ticks += int(fields[11]) + int(fields[12])
            except OSError:
                pass
        return ticks

    time.sleep(0.2)  # the engine's threads have named themselves
    ticks0 = busy_ticks()
    for _ in range(200):
        eng.forward(0, q, kc, vc, table, torch.tensor([ctx], dtype=torch.int32),
                    torch.tensor([0, 1], dtype=torch.int32), out, seq_ids=torch.tensor([7]), scale=D ** -0.5)
    time.sleep(0.2)  # a new thread names itself once it runs
    new = {n for t, n in _thread_names().items() if t not in before}
    # Allowed: the engine's pool for the policies' paths (rayon, asleep between calls).
    assert all(re.fullmatch(r"kvsparse-\d+", n) for n in new), f"threads started: {sorted(new)}"
    # and they did not do the work (200 calls of ~1 ms: many 10 ms ticks if they had)
    assert (eng.stats()["policy_rows"] > 0) == bool(policy), "the policy path ran (layer 0 not kept dense)"
    assert busy_ticks() - ticks0 <= 1, "the engine's own threads ran the calls"
    k = kc[table[0].long()].reshape(ctx, KH, D)
    v = vc[table[0].long()].reshape(ctx, KH, D)
    if policy:  # (tests/policies.rs checks what it selects; here: where it runs)
        assert torch.isfinite(out).all()
    else:
        assert (out.double() - _reference(q, k, v, D ** -0.5)).abs().max().item() < 1e-5
