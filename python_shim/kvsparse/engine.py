"""Pythonic wrapper of one kvsparse engine: create, write cache, forward, release, stats.

Every failing call raises KvsError carrying the status name and kvsparse's own
message (kvs_last_error), so configuration errors surface verbatim at startup.

A CUDA engine (`device="cuda"`) takes torch CUDA tensors (DLPack device 2, no copy) and enqueues its work on
the caller's current torch stream (`torch.cuda.current_stream()`, so inside `torch.cuda.graph` the capture
stream) unless `stream=` names another; `cache_write` and `forward` never synchronize. Only `stats()` does
(it reads the device counters). These one-off calls build their descriptors per call; a serving loop uses
`step.LayerCall`, which keeps them (docs/vllm.md).
"""
import torch

from ._ffi import ffi, lib
from .dlpack import described, ptr
from .streams import raw_stream

_DTYPE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
# vLLM's kv_cache_dtype names -> kvs_cache_dtype ("fp8" is E4M3 on CUDA, as in vLLM).
CACHE_DTYPES = {"auto": 0, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 2}
_STATS_FIELDS = [f[0] for f in ffi.typeof("kvs_stats").fields if f[0] not in ("struct_size", "reserved")]


class KvsError(RuntimeError):
    """A kvsparse call failed; `status` is the status name (e.g. KVS_ERR_UNSUPPORTED)."""

    def __init__(self, status: int, what: str):
        self.status = ffi.string(lib.kvs_status_name(status)).decode()
        self.message = ffi.string(lib.kvs_last_error()).decode()
        super().__init__(f"kvsparse {what}: {self.status}: {self.message}")


class KvsUnsupported(ValueError):
    """A configuration the C ABI cannot even express (e.g. a dtype outside kvs_dtype), refused before
    kvs_engine_create; the message reads like the library's: `kvsparse engine_create: KVS_ERR_UNSUPPORTED: ...`."""

    status = "KVS_ERR_UNSUPPORTED"

    def __init__(self, message: str):
        self.message = message
        super().__init__(f"kvsparse engine_create: KVS_ERR_UNSUPPORTED: {message}")


KVS_ERR_UNKNOWN_SEQUENCE = lib.KVS_ERR_UNKNOWN_SEQUENCE


def check(status: int, what: str):
    """Raises KvsError (with kvsparse's message) for a failed call."""
    if status != 0:
        raise KvsError(status, what)


_check = check


def _engine_config(*, num_layers, num_q_heads, num_kv_heads, head_dim, block_size, dtype=torch.float16,
                   device="cpu", policy="", num_threads=0, max_state_bytes=0, validate="deferred",
                   cache_dtype="auto", padded_batches=False):
    """The C config (and the policy string it points at, which must outlive it) of an engine.
    `cache_dtype`: vLLM's kv_cache_dtype name ("auto", "fp8", "fp8_e4m3", "fp8_e5m2"; None = "auto")."""
    if dtype not in _DTYPE:
        raise KvsUnsupported(f"dtype {dtype} is not supported (float32, float16, bfloat16)")
    cache_dtype = "auto" if cache_dtype is None else str(cache_dtype)
    if cache_dtype not in CACHE_DTYPES:
        raise KvsUnsupported(f"kv_cache_dtype {cache_dtype!r} is not supported (use 'auto', 'fp8', 'fp8_e4m3' or "
                             f"'fp8_e5m2')")
    cfg = ffi.new("kvs_engine_config *")
    _check(lib.kvs_engine_config_init(cfg), "config_init")
    dev = torch.device(device)
    cfg.device_type = 1 if dev.type == "cpu" else 2
    cfg.device_id = dev.index or 0
    cfg.num_layers, cfg.num_q_heads, cfg.num_kv_heads = num_layers, num_q_heads, num_kv_heads
    cfg.head_dim, cfg.block_size = head_dim, block_size
    cfg.dtype = _DTYPE[dtype]
    cfg.cache_dtype = CACHE_DTYPES[cache_dtype]
    # Serving engines' CUDA graphs pad decode batches: rows past query_start_loc's end are padding.
    cfg.padded_batches = 1 if padded_batches else 0
    cfg.num_threads, cfg.max_state_bytes = num_threads, max_state_bytes
    # CUDA engines: "deferred" (device checks surface at check()), or "sync" (each call waits and raises
    # what they found; not capturable). docs/abi.md, "Where each check runs".
    if validate not in ("deferred", "sync"):
        raise ValueError(f"validate must be 'deferred' or 'sync', got {validate!r}")
    cfg.validate = lib.KVS_VALIDATE_SYNC if validate == "sync" else lib.KVS_VALIDATE_DEFERRED
    spec = ffi.new("char[]", (policy or "").encode())
    cfg.policy = spec
    return cfg, spec


def check_config(**config):
    """Raises what `Engine(**config)` would raise about the configuration itself (geometry, dtype, policy spec,
    and on a CUDA device whether the CUDA engine runs the policy), without creating an engine or touching any
    device (`kvs_engine_config_check`): the check a serving engine runs before it starts its workers. The
    error reads as the engine's (`kvsparse engine_create: ...`), since it is the same check."""
    cfg, _spec = _engine_config(**config)
    _check(lib.kvs_engine_config_check(cfg), "engine_create")


_POLICY_FIELDS = ("num_stages", "dense_layers", "stateful", "graph_capturable")


def _policy_dict(info) -> dict:
    return {f: (bool(getattr(info, f)) if f in ("stateful", "graph_capturable") else getattr(info, f)) for f in _POLICY_FIELDS}


def policy_info(spec: str) -> dict:
    """What the library says about a policy spec (`kvs_policy_query`): `num_stages` (0 = dense),
    `dense_layers`, `stateful` (forward calls need seq_ids) and `graph_capturable` (a CUDA engine's decode
    steps may be captured in a CUDA graph). A malformed spec raises the parser's error. No device is touched."""
    info = ffi.new("kvs_policy_info *")
    info.struct_size = ffi.sizeof("kvs_policy_info")
    _check(lib.kvs_policy_query((spec or "").encode(), info), "policy_query")
    return _policy_dict(info)


def with_max_seqs(spec: str, n: int) -> str:
    """`spec` with the option `max_seqs=n` added when its policy keeps per-sequence state (the library's
    reading, `policy_info`) and the spec does not set `max_seqs` itself. For serving plugins, which know how
    many sequences run at once: a CUDA engine allocates every slot's state at a layer's first call (the
    predictor's history is 4 MiB per slot and KV head at 128K tokens), and the default is 256 slots. `n` None
    (a serving config that has not settled its concurrency) leaves the spec as it is."""
    if not spec or n is None or "max_seqs" in spec or not policy_info(spec)["stateful"]:
        return spec
    return f"{spec}; max_seqs={max(1, min(int(n), 1 << 20))}"


class Engine:
    """One kvsparse engine (all attention layers of one model on one device)."""

    def __init__(self, *, num_layers, num_q_heads, num_kv_heads, head_dim, block_size,
                 dtype=torch.float16, device="cpu", policy="", num_threads=0, max_state_bytes=0,
                 validate="deferred", cache_dtype="auto", padded_batches=False):
        cfg, _spec = _engine_config(num_layers=num_layers, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
                                    head_dim=head_dim, block_size=block_size, dtype=dtype, device=device,
                                    policy=policy, num_threads=num_threads, max_state_bytes=max_state_bytes,
                                    validate=validate, cache_dtype=cache_dtype, padded_batches=padded_batches)
        out = ffi.new("kvs_engine **")
        _check(lib.kvs_engine_create(cfg, out), "engine_create")
        self._h = ffi.gc(out[0], lib.kvs_engine_destroy)
        self.policy = policy or ""
        self.device = torch.device("cpu") if cfg.device_type == 1 else torch.device("cuda", cfg.device_id)
        self.dtype = dtype
        self.cache_dtype = "auto" if cache_dtype is None else str(cache_dtype)
        # Bytes of one cache element (FP8: one).
        self.cache_itemsize = dtype.itemsize if self.cache_dtype == "auto" else 1
        self.num_layers = num_layers
        self.num_q_heads, self.num_kv_heads, self.head_dim = num_q_heads, num_kv_heads, head_dim
        self.block_size = block_size

    def _stream(self, stream):
        """The stream handle passed to C: `stream` when given, else torch's current stream (CPU: none)."""
        return raw_stream(self.device) if stream is None else int(stream)

    def cache_write(self, layer, key, value, key_cache, value_cache, slot_mapping, stream=None):
        vs = [described(t) for t in (key, value, key_cache, value_cache, slot_mapping)]
        a = ffi.new("kvs_cache_write_args *")
        a.struct_size = ffi.sizeof("kvs_cache_write_args")
        a.layer = layer
        a.key, a.value, a.key_cache, a.value_cache, a.slot_mapping = [v.ptr for v in vs]
        a.stream = ffi.cast("void *", self._stream(stream))
        _check(lib.kvs_cache_write(self._h, a), "cache_write")

    def forward(self, layer, query, key_cache, value_cache, block_table, seq_lens, query_start_loc,
                out, *, seq_ids=None, lse=None, scale, sliding_window=0, softcap=0.0,
                max_query_len=0, max_seq_len=0, stream=None, call_stats=False):
        """Causal paged attention of one layer; returns this call's counters when call_stats (host-known
        counts on a CUDA engine: its policy counters stay on the device until `stats()`)."""
        tensors = [query, key_cache, value_cache, block_table, seq_lens, query_start_loc, seq_ids, out, lse]
        vs = [described(t) for t in tensors]
        a = ffi.new("kvs_forward_args *")
        a.struct_size = ffi.sizeof("kvs_forward_args")
        a.layer = layer
        (a.query, a.key_cache, a.value_cache, a.block_table, a.seq_lens, a.query_start_loc,
         a.seq_ids, a.out, a.lse) = [ptr(v) for v in vs]
        a.scale, a.sliding_window, a.softcap = scale, sliding_window, softcap
        a.max_query_len, a.max_seq_len = max_query_len, max_seq_len
        a.stream = ffi.cast("void *", self._stream(stream))
        st = None
        if call_stats:
            st = ffi.new("kvs_stats *")
            st.struct_size = ffi.sizeof("kvs_stats")
            a.call_stats = st
        _check(lib.kvs_attention_forward(self._h, a), "attention_forward")
        return None if st is None else {f: getattr(st, f) for f in _STATS_FIELDS}

    def set_kv_scales(self, layer: int, k_scale: float, v_scale: float):
        """An FP8 cache's dequantization scales (vLLM's per-layer `k_scale`, `v_scale`; `layer = -1`: all
        layers). Must be set before the layer's first cache write or forward call; ignored by other caches."""
        _check(lib.kvs_engine_set_kv_scales(self._h, layer, float(k_scale), float(v_scale)), "set_kv_scales")

    def check(self, stream=None):
        """Raises what a CUDA engine's device checks of block tables, lengths, query offsets and slots
        found since the last check (waits for `stream`, default torch's current one; clears the record).
        A CPU engine checks at the call: nothing to raise."""
        _check(lib.kvs_engine_check(self._h, ffi.cast("void *", self._stream(stream))), "engine_check")

    def release(self, seq_id: int, missing_ok: bool = False) -> bool:
        """Frees a sequence's state; with missing_ok an id the engine does not hold (never named in a
        forward call's seq_ids, or released already) is not an error. Returns whether the engine held it."""
        st = lib.kvs_sequence_release(self._h, seq_id)
        if missing_ok and st == KVS_ERR_UNKNOWN_SEQUENCE:
            return False
        _check(st, "sequence_release")
        return True

    def policy_info(self) -> dict:
        """`policy_info` of the engine's policy (`kvs_engine_policy`)."""
        info = ffi.new("kvs_policy_info *")
        info.struct_size = ffi.sizeof("kvs_policy_info")
        _check(lib.kvs_engine_policy(self._h, info), "engine_policy")
        return _policy_dict(info)

    def stats(self, layer: int = -1) -> dict:
        st = ffi.new("kvs_stats *")
        st.struct_size = ffi.sizeof("kvs_stats")
        _check(lib.kvs_engine_stats(self._h, layer, st), "engine_stats")
        return {f: getattr(st, f) for f in _STATS_FIELDS}
