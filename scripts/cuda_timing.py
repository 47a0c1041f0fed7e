"""CUDA-event timing shared by the decode peer benchmarks (sdpa_bench.py, peer_decode_bench.py), which must
time calls exactly as `kvsparse bench --device cuda` does: a warm-up, then the median of `groups` groups of
`per` back-to-back calls."""
import statistics

import torch


def time_ms(fn, groups=15, per=10):
    """Median milliseconds per call of `fn` over `groups` groups of `per` calls (3 warm-up calls first)."""
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(3):
        fn()
    ts = []
    for _ in range(groups):
        s.record()
        for _ in range(per):
            fn()
        e.record()
        e.synchronize()
        ts.append(s.elapsed_time(e) / per)
    return statistics.median(ts)
