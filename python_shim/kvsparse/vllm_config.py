"""kvsparse's part of a vLLM configuration, read and checked once, before vLLM starts its workers.

The plugin wraps `EngineArgs.create_engine_config` (run once, in the process that calls `LLM(...)` or starts
the server) with `check`, so a bad kvsparse configuration is the exception `LLM(...)` raises, with
kvsparse's message as its text, before any model is loaded. The workers check again when they create the
engine (`vllm_backend.get_engine`); only a failure of the device itself (no GPU, out of memory) comes from
there.

- `additional_config["kvsparse"]` may hold only the keys in `KEYS`; anything else is an error.
- A policy set there or in `$KVSPARSE_POLICY` while vLLM will not run the kvsparse backend (CPU platform
  without `KVSPARSE_OVERRIDE_CPU_ATTN=1`, GPU without `attention_backend="CUSTOM"`) is an error.
- With kvsparse as the backend, the engine configuration (policy spec, head size, block size, GQA ratio,
  dtype, KV cache dtype, and on a GPU whether the CUDA engine runs the policy) is validated by the library's
  own check for the workers' device (`kvs_engine_config_check`: the checks of engine creation, without
  creating an engine or touching the device).
"""
import os

KEYS = {"policy": "decode policy spec (docs/policies.md), e.g. 'quest(budget=1024)'; default dense"}
OVERRIDE_ENV = "KVSPARSE_OVERRIDE_CPU_ATTN"


# Block sizes kvs_engine_create accepts (include/kvsparse.h): vllm_backend declares them to vLLM.
BLOCK_SIZES = [1 << i for i in range(9)]


def kernel_block_size(block_size: int) -> int:
    """The block size vLLM gives kvsparse for its cache blocks of `block_size` tokens: the size itself when
    supported, else (vLLM's select_common_block_size) the largest supported size dividing it, vLLM then
    addressing the cache in kernel blocks of that size."""
    if block_size in BLOCK_SIZES:
        return block_size
    return max(b for b in BLOCK_SIZES if block_size % b == 0)


class KvsConfigError(ValueError):
    """A kvsparse configuration error found before vLLM starts; the text is the whole message."""


def section(vllm_config) -> dict:
    extra = getattr(vllm_config, "additional_config", None) or {}
    sec = extra.get("kvsparse") if isinstance(extra, dict) else None
    if sec is None:
        return {}
    if not isinstance(sec, dict):
        raise KvsConfigError(f"kvsparse: additional_config['kvsparse'] must be a dict, got {type(sec).__name__}")
    unknown = sorted(set(sec) - set(KEYS))
    if unknown:
        known = ", ".join(f"'{k}' ({v})" for k, v in KEYS.items())
        raise KvsConfigError(f"kvsparse: unknown key(s) {', '.join(repr(k) for k in unknown)} in "
                             f"additional_config['kvsparse']; known keys: {known}")
    return sec


def policy(vllm_config) -> str:
    """additional_config {"kvsparse": {"policy": ...}} first, then $KVSPARSE_POLICY, else "" (dense)."""
    spec = section(vllm_config).get("policy")
    if spec is None:
        spec = os.environ.get("KVSPARSE_POLICY", "")
    if not isinstance(spec, str):
        raise KvsConfigError(f"kvsparse: additional_config['kvsparse']['policy'] must be a string, got {spec!r}")
    return spec


def device_type(vllm_config) -> str:
    """"cpu" or "cuda": the workers' device type (vLLM may leave `device_config.device` None on platforms
    that handle the host device themselves; `device_type` is always set)."""
    dc = vllm_config.device_config
    return getattr(dc, "device_type", None) or dc.device.type


def is_backend(vllm_config) -> bool:
    """Whether vLLM will run kvsparse's backend for this configuration."""
    if device_type(vllm_config) == "cpu":
        return os.environ.get(OVERRIDE_ENV, "0") == "1"
    chosen = getattr(getattr(vllm_config, "attention_config", None), "backend", None)
    return getattr(chosen, "name", str(chosen)) == "CUSTOM"


def geometry(vllm_config) -> dict:
    mc, pc = vllm_config.model_config, vllm_config.parallel_config
    return dict(num_layers=mc.get_num_layers(pc), num_q_heads=mc.get_num_attention_heads(pc),
                num_kv_heads=mc.get_num_kv_heads(pc), head_dim=mc.get_head_size())


def cache_dtype(vllm_config) -> str:
    """vLLM's kv_cache_dtype ("auto" when unset)."""
    d = getattr(vllm_config.cache_config, "cache_dtype", "auto")
    return "auto" if d is None or str(d) == "None" else str(d)


def check_cache_dtype(vllm_config):
    """Refuses a kv_cache_dtype the C config cannot express (FP8 E4M3/E5M2 it can: `fp8`, `fp8_e4m3`,
    `fp8_e5m2`; whether the device serves it is the library's check)."""
    from .engine import CACHE_DTYPES, KvsUnsupported

    d = cache_dtype(vllm_config)
    if d not in CACHE_DTYPES:
        raise KvsUnsupported(f"kv_cache_dtype {d!r} is not supported (kvsparse keeps K/V in the model dtype or in "
                             f"FP8: use kv_cache_dtype='auto', 'fp8', 'fp8_e4m3' or 'fp8_e5m2')")


def check(vllm_config):
    """Raises kvsparse's error for a configuration that would not run as asked; returns quietly otherwise
    (at once when kvsparse is neither configured nor the backend)."""
    spec = policy(vllm_config)
    configured = bool(section(vllm_config)) or bool(spec)
    if not is_backend(vllm_config):
        if configured:
            where = (f"set {OVERRIDE_ENV}=1 (vLLM's CPU platform otherwise runs its own CPU_ATTN backend)"
                     if device_type(vllm_config) == "cpu" else "pass attention_backend='CUSTOM'")
            raise KvsConfigError(f"kvsparse: policy {spec or 'dense'!r} is configured but vLLM will not run the "
                                 f"kvsparse attention backend: {where}")
        return
    check_cache_dtype(vllm_config)
    from .engine import check_config

    block = vllm_config.cache_config.block_size
    if block is None:
        raise KvsConfigError("kvsparse: vLLM's cache config has no block size to check")

    # For the device the workers will use, without touching it (this process must not initialize CUDA
    # before vLLM forks its workers): kvs_engine_config_check.
    device = "cpu" if device_type(vllm_config) == "cpu" else "cuda"
    check_config(**geometry(vllm_config), block_size=kernel_block_size(block), dtype=vllm_config.model_config.dtype,
                 device=device, policy=spec, num_threads=1, cache_dtype=cache_dtype(vllm_config))
