"""kvsparse: paged attention with sparse decode policies (binding of the C ABI in include/kvsparse.h)."""
from ._ffi import ffi, lib
from .engine import Engine, KvsError, KvsUnsupported

__all__ = ["Engine", "KvsError", "KvsUnsupported", "ffi", "lib", "abi_version"]


def abi_version() -> int:
    return lib.kvs_version()
