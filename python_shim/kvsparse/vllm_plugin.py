"""vLLM `general_plugins` entry point: registers the kvsparse attention backend.

On GPU platforms the backend is registered as `CUSTOM` (select it with
attention_backend="CUSTOM"). The CPU platform always resolves `CPU_ATTN`, so
there the plugin replaces that entry, but only when KVSPARSE_OVERRIDE_CPU_ATTN=1:
installing the package must not change vLLM's behaviour by itself.
"""
import os

BACKEND_PATH = "kvsparse.vllm_backend.KvSparseBackend"


def register():
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    from .seq_ids import install_runner_hook

    register_backend(AttentionBackendEnum.CUSTOM, BACKEND_PATH)
    if os.environ.get("KVSPARSE_OVERRIDE_CPU_ATTN", "0") == "1":
        register_backend(AttentionBackendEnum.CPU_ATTN, BACKEND_PATH)
    install_runner_hook()
