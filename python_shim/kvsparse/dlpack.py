"""Zero-copy DLTensor descriptors for torch tensors.

The descriptor points at the tensor's own storage (data_ptr + element strides);
the returned holder keeps the shape/stride arrays and the tensor alive for as
long as the caller holds it, i.e. for the duration of one kvsparse call.
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
}
_DEVICES = {"cpu": 1, "cuda": 2}


class DLView:
    """Owns one DLTensor describing `t` (no copy); `.ptr` is the `DLTensor*`."""

    __slots__ = ("tensor", "shape", "strides", "ptr")

    def __init__(self, t: torch.Tensor):
        if t.dtype not in _DTYPES:
            raise TypeError(f"kvsparse: dtype {t.dtype} cannot be passed")
        if t.device.type not in _DEVICES:
            raise TypeError(f"kvsparse: device {t.device} cannot be passed")
        self.tensor = t
        self.shape = ffi.new("int64_t[]", list(t.shape) or [1])
        self.strides = ffi.new("int64_t[]", list(t.stride()) or [1])
        p = ffi.new("DLTensor *")
        p.data = ffi.cast("void *", t.data_ptr())
        p.device.device_type = _DEVICES[t.device.type]
        p.device.device_id = t.device.index or 0
        p.ndim = t.dim()
        code, bits = _DTYPES[t.dtype]
        p.dtype.code, p.dtype.bits, p.dtype.lanes = code, bits, 1
        p.shape = self.shape
        p.strides = self.strides
        p.byte_offset = 0
        self.ptr = p


def view(t):
    """DLView of `t`, or None for None (optional arguments)."""
    return None if t is None else DLView(t)


def ptr(v):
    return ffi.NULL if v is None else v.ptr
