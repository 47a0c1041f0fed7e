"""kvsparse: paged attention with sparse decode policies (binding of the C ABI in include/kvsparse.h).

`import kvsparse` needs only cffi; `Engine` and the vLLM/SGLang backends need torch (imported on first use).
"""
from ._ffi import ffi, lib

__all__ = ["Engine", "KvsError", "KvsUnsupported", "ffi", "lib", "abi_version"]


def abi_version() -> int:
    return lib.kvs_version()


def __getattr__(name):
    if name in ("Engine", "KvsError", "KvsUnsupported"):
        from . import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'kvsparse' has no attribute {name!r}")
