"""The caller's current CUDA stream as the integer handle kvsparse's C calls take."""
import torch

_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def raw_stream(device) -> int:
    """The current CUDA stream of `device` as an integer handle; 0 (no stream) on the CPU."""
    if device.type != "cuda":
        return 0
    if _raw_stream is not None:
        return _raw_stream(device.index or 0)
    return torch.cuda.current_stream(device).cuda_stream
