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


def write_report(out: str, name: str, report: dict) -> None:
    """``report`` as JSON to ``out``/``name`` (the folder made if missing), and a line saying where."""
    import json
    from pathlib import Path

    path = Path(out) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1))
    print(f"wrote {path}")


COPY_OPS = ("aten::copy_", "aten::cat")


def _site(event, package: str) -> str:
    """Where an operator came from: the innermost frame in ``package`` (its folder's absolute path
    ending in /, or ``gdn2/`` relative to the working directory, as the profiler may record it) of the
    Python stack of it or of its nearest ancestor that has one, else the autograd node whose backward
    ran it."""
    e = event
    while e is not None:
        for frame in e.stack or []:
            for prefix in (package, "gdn2/"):
                if frame.startswith(prefix):
                    return frame[len(prefix):]
        if e.name.startswith("autograd::engine::evaluate_function: "):
            return "backward of " + e.name.split(": ", 1)[1]
        e = e.cpu_parent
    return "(no gdn2 frame)"


def copy_sites(fn: Callable[[], object], top: int = 25) -> list[dict]:
    """``[{"op", "site", "shapes", "ms", "calls"}]``: the device time (CPU time without a GPU) of the
    copies and concatenations one call of ``fn`` runs, by the place in gdn2 that asked for them
    (``_site``: a file, line and function of gdn2, or the backward node) and input shapes, largest
    first."""
    from pathlib import Path

    from torch._C._profiler import _ExperimentalConfig
    from torch.profiler import ProfilerActivity, profile

    import gdn2

    package = str(Path(gdn2.__file__).resolve().parent) + "/"
    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    # verbose: the Python stack of every operator, not only of the top-level ones
    with profile(activities=activities, record_shapes=True, with_stack=True,
                 experimental_config=_ExperimentalConfig(verbose=True)) as prof:
        fn()
        if cuda:
            torch.cuda.synchronize()
    groups: dict[tuple, list[float]] = {}
    for e in prof.events():
        if e.name not in COPY_OPS or (e.cpu_parent is not None and e.cpu_parent.name in COPY_OPS):
            continue
        us = (getattr(e, "self_device_time_total", 0) or 0) if cuda else e.self_cpu_time_total
        key = (e.name, _site(e, package), str([tuple(s) for s in e.input_shapes[:2]]))
        acc = groups.setdefault(key, [0.0, 0])
        acc[0] += us / 1e3
        acc[1] += 1
    rows = [{"op": op, "site": site, "shapes": shapes, "ms": ms, "calls": n}
            for (op, site, shapes), (ms, n) in groups.items()]
    return sorted(rows, key=lambda r: -r["ms"])[:top]
