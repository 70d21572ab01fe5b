"""Median CUDA-event time of a GPU call, for the kernel benchmarks beside this file (`from cuda_timing import
median_ms`; a script's folder is on its import path)."""
import torch


def median_ms(f, reps: int = 30, warmup: int = 3) -> float:
    """Median over `reps` of one call of f, each timed alone between CUDA events (L2 left warm), in ms."""
    for _ in range(warmup):
        f()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        f()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b))
    return sorted(ts)[len(ts) // 2]
