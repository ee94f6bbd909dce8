"""Per-kernel time of a callable, from torch.profiler (shared by the operator and trainer benchmarks)."""

from __future__ import annotations

from typing import Callable

import torch


def kernel_times(fn: Callable[[], object], reps: int = 5, warm: bool = True) -> list[tuple[str, float, float]]:
    """``[(kernel name, ms per call, launches per call)]`` for every CUDA kernel ``fn`` launches,
    slowest first: one warm call (unless ``warm`` is False), then ``reps`` profiled calls. Without a
    GPU, every CPU operator's self time instead."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if warm:
        fn()
        sync()
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        for _ in range(reps):
            fn()
        sync()
    rows = []
    for e in prof.key_averages():
        us = ((getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)) if cuda
              else e.self_cpu_time_total)
        if us > 0:
            rows.append((e.key, us / 1e3 / reps, e.count / reps))
    return sorted(rows, key=lambda r: -r[1])
