"""Adapters of third-party kernels to the suite's calling convention

    fn(q, k_cache, v_cache, block_table, seq_lens, query_start_loc, scale, window, softcap) -> (out, lse)

(`lse` may be None when the kernel returns none; `fn.rows = "decode"` for kernels that serve decode rows
only; `fn.versions()` names what was tested). Each module imports its third-party package on first use, so
listing the targets needs only torch."""
import importlib

from ..reference import reference

# name -> (module under this package, attribute)
TARGETS = {
    "reference": None,  # float64 gathering attention in torch: the control, must pass everything
    "kvsparse": ("kvsparse_engine", "kvsparse_engine"),
    "vllm-cpu": ("vllm_cpu", "vllm_cpu"),
    "vllm-cpu-bs16": ("vllm_cpu", "vllm_cpu_bs16"),
    "torch-sdpa": ("sdpa", "sdpa"),
    "torch-sdpa-math": ("sdpa", "sdpa_math"),
    "torch-sdpa-efficient": ("sdpa", "sdpa_efficient"),
    "torch-flex": ("flex", "flex_compiled"),
    "torch-flex-eager": ("flex", "flex_eager"),
    "flashinfer-decode": ("flashinfer", "flashinfer_decode"),
}


def load(name):
    """The adapter called `name` (see TARGETS), or `package.module:function` for your own."""
    if name == "reference":
        return reference
    if name in TARGETS:
        mod, attr = TARGETS[name]
        return getattr(importlib.import_module(f".{mod}", __name__), attr)
    if ":" in name:
        mod, attr = name.split(":", 1)
        return getattr(importlib.import_module(mod), attr)
    raise KeyError(f"unknown target {name!r}; known: {', '.join(TARGETS)} or module:function")
