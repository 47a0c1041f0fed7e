"""Zero-copy DLTensor descriptors for torch tensors, reusable from call to call.

A `Desc` owns one `DLTensor` and its shape/stride arrays. `set(t)` describes `t` (its own storage: data_ptr
and element strides, no copy) and keeps `t` alive until the next `set`. Building the cffi objects costs far
more than a kvsparse call's own Python (~18 us against ~1 us on the dev machine), so the backends keep one
`Desc` per argument and only re-point it per call: when dtype, device, strides and trailing extents are the
ones already described, `set` writes the data pointer and the row count and nothing else.
"""
import torch

from ._ffi import ffi

# DLPack type codes: 0 int, 1 uint, 2 float, 4 bfloat.
_DTYPES = {
    torch.float32: (2, 32),
    torch.float16: (2, 16),
    torch.bfloat16: (4, 16),
    torch.int32: (0, 32),
    torch.int64: (0, 64),
    torch.uint64: (1, 64),
    torch.uint8: (1, 8),  # FP8 caches as vLLM allocates them
}
# FP8 caches typed as such (DLPack kDLFloat8_e4m3fn = 10, kDLFloat8_e5m2 = 12), where torch has the dtypes.
for _name, _code in (("float8_e4m3fn", 10), ("float8_e5m2", 12)):
    if hasattr(torch, _name):
        _DTYPES[getattr(torch, _name)] = (_code, 8)
# torch's get_device(): -1 for CPU, the ordinal for CUDA.
_KDLCPU, _KDLCUDA = 1, 2
assert ffi.offsetof("DLTensor", "data") == 0 and ffi.sizeof("void *") == 8


# A descriptor and its shape/stride arrays in one allocation (a Python-side struct, not part of the ABI).
ffi.cdef("typedef struct { DLTensor t; int64_t shape[4]; int64_t strides[4]; } kvs_py_desc;")


class Desc:
    """One reusable `DLTensor` (`.ptr`); `set(t)` points it at `t`."""

    __slots__ = ("ptr", "_c", "_shape", "_strides", "_words", "_key", "_n", "_addr", "tensor", "rows", "_asked")

    def __init__(self):
        c = self._c = ffi.new("kvs_py_desc *")
        p = self.ptr = ffi.cast("DLTensor *", c)  # the first member; valid while self._c lives
        self._shape = p.shape = c.shape
        self._strides = p.strides = c.strides
        # The data pointer written as a 64-bit word (ffi.cast to void* costs 5x more).
        self._words = ffi.cast("uint64_t *", c)
        self._key = None
        self._n = 0  # first extent of the described tensor
        self._addr = None
        self.tensor = None
        self.rows = 0  # the first extent written into the descriptor
        self._asked = None

    def set(self, t, rows=None, tail=None):
        """Describes `t`, with `rows` as its first extent when given (a prefix of the rows: no slicing) and,
        with `tail=(heads, dim)`, a 2-D `t` of `heads * dim` contiguous columns read as `[rows, heads, dim]`
        (no reshape; tensors of other ranks are described as they are). Returns `self.ptr`.

        Costs: the same tensor object at the same address and rows as last time, one comparison (a step's
        slot mapping, set once per layer); another tensor of the same dtype, device, shape and strides (the
        next layer's query), the pointer and row count; anything else, a full description."""
        addr = t.data_ptr()
        if t is self.tensor and rows == self._asked and addr == self._addr:
            return self.ptr
        key = (t.dtype, t.get_device(), t.stride(), t.shape, tail)
        if key != self._key:
            self._describe(t, key, tail)
        n = self._n
        if rows is not None:
            if rows > n or rows < 0:
                raise ValueError(f"kvsparse: {rows} rows asked of a tensor with {n}")
            n = rows
        self._shape[0] = self.rows = n
        self._words[0] = self._addr = addr
        self.tensor = t
        self._asked = rows
        return self.ptr

    def _describe(self, t, key, tail):
        if t.dtype not in _DTYPES:
            raise TypeError(f"kvsparse: dtype {t.dtype} cannot be passed")
        dev = t.get_device()
        if dev < 0 and t.device.type != "cpu":
            raise TypeError(f"kvsparse: device {t.device} cannot be passed")
        shape, strides = list(t.shape) or [1], list(t.stride()) or [1]
        if tail is not None and t.dim() == 2:
            heads, dim = tail
            if shape[1] != heads * dim or strides[1] != 1:
                raise ValueError(f"kvsparse: a [rows, {heads}*{dim}] tensor with unit column stride was expected, "
                                 f"got shape {tuple(t.shape)} strides {tuple(t.stride())}")
            shape, strides = [shape[0], heads, dim], [strides[0], dim, 1]
        nd = len(shape)
        if nd > 4:
            raise ValueError(f"kvsparse: tensors of {nd} dimensions cannot be passed")
        p = self.ptr
        p.ndim = nd
        p.device = (_KDLCPU if dev < 0 else _KDLCUDA, max(dev, 0))
        p.dtype = _DTYPES[t.dtype] + (1,)  # code, bits, lanes
        p.byte_offset = 0
        self._shape[0:nd] = shape
        self._strides[0:nd] = strides
        self._n = shape[0]
        self._key = key


def described(t, **kw):
    """A fresh descriptor of `t` (one-off calls); None for None."""
    if t is None:
        return None
    d = Desc()
    d.set(t, **kw)
    return d


def ptr(d):
    return ffi.NULL if d is None else d.ptr
