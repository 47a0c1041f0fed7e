"""vLLM `general_plugins` entry point: registers the kvsparse attention backend and its config check.

The installed vLLM's version is checked first (`vllm_compat.check_version`: 0.26 on CUDA, 0.32 on the CPU);
another one raises `UnsupportedVllmVersion` with the supported list, unless
KVSPARSE_ALLOW_UNSUPPORTED_VLLM=1.

On GPU platforms the backend is registered as `CUSTOM` (select it with attention_backend="CUSTOM"). The CPU
platform always resolves `CPU_ATTN`, so there the plugin replaces that entry, but only when
KVSPARSE_OVERRIDE_CPU_ATTN=1: installing the package must not change vLLM's behaviour by itself.

`EngineArgs.create_engine_config` (run once, where `LLM(...)` or the server starts) gets a wrapper that runs
`vllm_config.check` on the finished config: a kvsparse configuration that cannot run as asked fails there,
before any worker starts. Nothing else is wrapped here; per-step hooks are installed only by the kvsparse
backend itself (vllm_runner.py), so a plain vLLM run executes no kvsparse code per step.
"""
import os

BACKEND_PATH = "kvsparse.vllm_backend.KvSparseBackend"
_MARK = "_kvsparse_checked"


def register():
    from .vllm_compat import check_version

    # An unsupported vLLM fails here, in every process, before any of its classes is touched: vLLM's
    # attention-backend interface changes between minor versions (vllm_compat.py lists what differs).
    check_version()
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.CUSTOM, BACKEND_PATH)
    if os.environ.get("KVSPARSE_OVERRIDE_CPU_ATTN", "0") == "1":
        register_backend(AttentionBackendEnum.CPU_ATTN, BACKEND_PATH)
    _check_configs()


def _check_configs():
    from vllm.engine.arg_utils import EngineArgs

    from .vllm_runner import wrap_method

    def make(orig):
        def create_engine_config(self, *args, **kwargs):
            config = orig(self, *args, **kwargs)
            from .vllm_config import check

            check(config)
            return config

        return create_engine_config

    wrap_method(EngineArgs, "create_engine_config", make, mark=_MARK)
