"""Launch-config sweep of the GDN-2 chunk kernels on the GPU: per-kernel CUDA time for each config.

    PYTHONPATH=. python bench/sweep_gdn2.py [--budget-s S] [--kernels intra,qkbg,...]

For every kernel named below and every config of its sweep list, the kernel is pinned to that config,
one forward + backward of ``chunk_gdn2`` at 8 x 4096 x 16 (bf16, K = V = 128) runs under
torch.profiler (3 calls) and the kernel's own CUDA time per call is printed, beside the output's
relative difference to the first config's (a miscompile shows as a large difference). The fastest
config per kernel is printed last; it is the one to pin in ``gdn2/ops``. Writes $OUT/sweep_gdn2.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

import torch
import triton

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for p in (ROOT, os.path.join(ROOT, "bench")):
    if p not in sys.path:
        sys.path.insert(0, p)

from gdn2.ops import chunk_gdn2  # noqa: E402
from gdn2.ops.gdn2 import chunk_bwd as bwd_mod  # noqa: E402
from gdn2.ops.gdn2 import chunk_fwd as fwd_mod  # noqa: E402
from gpu_check_gdn2 import gpu_inputs  # noqa: E402
from profiling import kernel_times  # noqa: E402

OUT = os.environ.get("OUT") or os.path.join(ROOT, "bench_out")


def cfg(w, s=1, r=None, **kw):
    return triton.Config(kw, num_warps=w, num_stages=s, maxnreg=r)


# short name -> (module, kernel attribute, configs to try; the first is the pinned one)
SWEEPS = {
    "intra": (fwd_mod, "gdn2_intra_kernel", [
        cfg(1, 2, BK=32), cfg(1, BK=32), cfg(1, 3, BK=32), cfg(1, 2, BK=16), cfg(1, BK=16), cfg(1, 2, BK=64),
        cfg(2, 2, BK=32), cfg(1, 2, r=192, BK=32)]),
    "bwd_intra": (bwd_mod, "gdn2_bwd_intra_kernel", [
        cfg(1, BK=32), cfg(1, 2, BK=32), cfg(1, 3, BK=32), cfg(1, r=192, BK=32), cfg(1, r=160, BK=32),
        cfg(1, r=128, BK=32), cfg(1, r=128, BK=16), cfg(1, BK=16)]),
    "qkbg": (bwd_mod, "gdn2_bwd_qkbg_kernel", [
        cfg(4, 3, BK=32, BV=64), cfg(4, 3, BK=32, BV=32), cfg(4, 1, BK=32, BV=128), cfg(4, 2, BK=32, BV=128),
        cfg(4, 3, BK=16, BV=64), cfg(2, 3, BK=16, BV=64), cfg(8, 2, BK=32, BV=128), cfg(4, 2, r=168, BK=32, BV=64),
        cfg(8, 3, BK=64, BV=64), cfg(4, 2, BK=32, BV=64), cfg(2, 3, BK=32, BV=64), cfg(8, 3, BK=32, BV=64)]),
    "fwd_scan": (fwd_mod, "gdn2_fwd_scan_kernel", [
        cfg(4, 3, BV=64), cfg(4, 2, BV=64), cfg(8, 2, BV=64), cfg(4, 2, BV=32), cfg(4, 3, BV=32), cfg(8, 2, BV=128),
        cfg(4, 3, BV=16), cfg(2, 3, BV=16)]),
    "state_scan": (fwd_mod, "gdn2_state_scan_kernel", [
        cfg(4, 2, BV=64), cfg(8, 2, BV=64), cfg(4, 3, BV=64), cfg(4, 2, BV=32), cfg(8, 2, BV=128), cfg(2, 2, BV=64),
        cfg(4, 3, BV=32), cfg(4, 3, BV=16)]),
    "prep": (fwd_mod, "gdn2_prep_kernel", [
        cfg(4, 2, BK=32, BV=32), cfg(4, 2, BK=64, BV=64), cfg(2, 2, BK=32, BV=32), cfg(8, 2, BK=128, BV=128),
        cfg(8, 2, BK=64, BV=64), cfg(4, 1, BK=64, BV=64)]),
    "bwd_scan": (bwd_mod, "gdn2_bwd_scan_kernel", [
        cfg(4, 3, BV=64), cfg(4, 2, BV=64), cfg(8, 2, BV=64), cfg(4, 2, BV=32), cfg(4, 3, BV=32), cfg(8, 2, BV=128),
        cfg(4, 3, BV=16), cfg(2, 3, BV=16)]),
    "wy": (bwd_mod, "gdn2_bwd_wy_kernel", [
        cfg(4, 3, BV=128), cfg(4, 3, BV=64), cfg(8, 3, BV=128), cfg(4, 2, r=128, BV=128)]),
}


def kernel_ms(step, name, reps=3):
    """CUDA time per call of the kernels named ``name`` and of all kernels together (ms)."""
    rows = kernel_times(step, reps)
    return sum(ms for key, ms, _ in rows if key.startswith(name)), sum(ms for _, ms, _ in rows)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget-s", type=float, default=240.0)
    ap.add_argument("--kernels", default="intra,bwd_intra,qkbg,fwd_scan,state_scan,prep,bwd_scan,wy")
    ap.add_argument("--shape", default="8,4096,16")
    args = ap.parse_args()
    os.makedirs(OUT, exist_ok=True)
    B, T, H = map(int, args.shape.split(","))
    t0 = time.time()
    ins = gpu_inputs(B, T, H, 128, 128, seed=5)
    leaves = [x.detach().requires_grad_() for x in ins]
    do = torch.randn(B, T, H, 128, device="cuda", dtype=ins[0].dtype)
    res = {}

    def step():
        for x in leaves:
            x.grad = None
        o, _ = chunk_gdn2(*leaves, backend="triton")
        o.backward(do)
        return o

    for short in args.kernels.split(","):
        mod, attr, configs = SWEEPS[short]
        kern = getattr(mod, attr)
        ref = None
        rows = []
        for c in configs:
            if time.time() - t0 > args.budget_s:
                print(f"[{short}] budget reached", flush=True)
                break
            label = f"{short} {c.kwargs} w{c.num_warps} s{c.num_stages}" + (f" r{c.maxnreg}" if c.maxnreg else "")
            ts = time.time()
            try:
                with kern.pinned(c):
                    o = step().detach().float()
                    grads = torch.cat([x.grad.float().flatten() for x in leaves])
                    if ref is None:
                        ref = (o, grads)
                        diff = 0.0
                    else:
                        diff = max(((o - ref[0]).norm() / ref[0].norm()).item(),
                                   ((grads - ref[1]).norm() / ref[1].norm()).item())
                    ms, total = kernel_ms(step, attr)
                rows.append((ms, label, diff))
                res[label] = {"kernel_ms": round(ms, 4), "fwdbwd_sum_ms": round(total, 4), "rel_diff": diff,
                              "first_call_s": round(time.time() - ts, 1)}
                print(f"{label:60s} kernel {ms:8.3f} ms  fwd+bwd sum {total:8.3f} ms  diff {diff:.1e}  "
                      f"({time.time() - ts:.0f} s)", flush=True)
            except Exception as e:  # noqa: BLE001
                traceback.print_exc(limit=1)
                res[label] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
                print(f"{label:60s} FAILED {type(e).__name__}", flush=True)
            with open(os.path.join(OUT, "sweep_gdn2.json"), "w") as f:
                json.dump(res, f, indent=1)
        ok = [r for r in rows if r[2] < 1e-2]
        if ok:
            best = min(ok)
            print(f"BEST {best[1]}: {best[0]:.3f} ms", flush=True)
    print(f"total {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
