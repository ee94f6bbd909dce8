"""Per-kernel CUDA time of a callable, from torch.profiler (shared by the operator benchmarks)."""

from __future__ import annotations

from typing import Callable

import torch


def kernel_times(fn: Callable[[], object], reps: int = 5) -> list[tuple[str, float, float]]:
    """``[(kernel name, ms per call, launches per call)]`` for every CUDA kernel ``fn`` launches,
    slowest first: one warm call, then ``reps`` profiled calls."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        us = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if us > 0:
            rows.append((e.key, us / 1e3 / reps, e.count / reps))
    return sorted(rows, key=lambda r: -r[1])
