"""cffi (ABI mode) binding generated at import time from include/kvsparse.h.

The header is the single source of truth: its text (preprocessor lines and the
C++ `extern "C"` wrapper removed) is the cdef, so a field or function that
changes in the header changes here with no hand-written mirror to go stale.
"""
import os
import re
from pathlib import Path

import cffi

_PKG_LIB = Path(__file__).resolve().parent / "lib"


def _find(name: str, env: str) -> Path:
    if os.environ.get(env):
        return Path(os.environ[env])
    cand = _PKG_LIB / name
    if cand.is_file():
        return cand
    # Source checkout without install: python_shim/kvsparse -> repo root.
    repo = Path(__file__).resolve().parents[2]
    for c in (repo / "target" / "release" / name, repo / "include" / name):
        if c.is_file():
            return c
    raise ImportError(f"kvsparse: cannot find {name} (set {env} or pip install the package)")


def header_cdef(text: str) -> str:
    """Turns the header into a cffi cdef: drops the C++ guard block and all preprocessor lines."""
    text = re.sub(r"#ifdef __cplusplus.*?#endif[^\n]*\n", "", text, flags=re.S)
    lines = [l for l in text.splitlines() if not l.lstrip().startswith("#")]
    return "\n".join(lines)


HEADER_PATH = _find("kvsparse.h", "KVSPARSE_HEADER")
LIB_PATH = _find("libkvsparse.so", "KVSPARSE_LIB")

ffi = cffi.FFI()
ffi.cdef(header_cdef(HEADER_PATH.read_text()))
lib = ffi.dlopen(str(LIB_PATH))
