"""Benchmark of the GDN-2 operator: ours (Triton) beside flash-linear-attention's, in the same run.

    PYTHONPATH=. python bench/ops_gdn2.py [--quick] [--no-peer] [--accuracy] [--profile] [--budget-s S]

Per training shape (bf16 q/k/v/b/w, fp32 g, K = V = 128): forward time (inference, no saved state),
forward + backward time, the memory-traffic floor (bytes each must move / measured copy bandwidth) and
the activation memory kept for the backward. Decode: one token through the recurrent kernels at batch
1, 64, 256 (H = 16, state in and out), called eagerly and from a CUDA graph. Times are medians of triton.testing.do_bench (warmup 10 ms,
rep 50 ms). Order: ours at every shape, our decode, --profile (per-kernel CUDA time of ours at
8 x 4096 x 16, forward + backward and inference forward), then the peer (whose first calls autotune
for a long time) shape by shape while --budget-s seconds are left. The JSON is rewritten after every
stage, so a cut run keeps what it measured. --accuracy also runs bench/gpu_check_gdn2.py's accuracy
table. Writes $OUT/ops_gdn2.json (./bench_out without $OUT).
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
from triton.testing import do_bench

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for p in (ROOT, os.path.join(ROOT, "bench")):
    if p not in sys.path:
        sys.path.insert(0, p)

from gdn2.ops import chunk_gdn2, fused_recurrent_gdn2  # noqa: E402
from gpu_check_gdn2 import gpu_inputs  # noqa: E402
from profiling import kernel_times  # noqa: E402

OUT = os.environ.get("OUT") or os.path.join(ROOT, "bench_out")
SHAPES = [(8, 4096, 16), (4, 8192, 16), (1, 32768, 16)]
PROFILE_SHAPE = SHAPES[0]
K = V = 128
res: dict = {}


def rec(key, value):
    res[key] = value
    print(f"{key}: {value}", flush=True)


T_START = time.time()


def median_ms(fn, warmup=10, rep=50):
    return do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def copy_bandwidth():
    x = torch.empty(2 * 1024 ** 3, device="cuda", dtype=torch.uint8)
    y = torch.empty_like(x)
    t = median_ms(lambda: y.copy_(x))
    return 2 * 2 * 1024 ** 3 / (t * 1e-3)  # bytes read + written per second


def floor_bytes(B, T, H):
    """Bytes each implementation must move at least (inputs once, outputs once, bf16 checkpoints)."""
    n = B * T * H * K
    inputs = 5 * 2 * n + 4 * n            # q, k, v, b, w bf16; g fp32
    ckpt = B * H * triton.cdiv(T, 64) * K * V * 2
    fwd = inputs + 2 * n + ckpt           # + o, + state checkpoints
    bwd = inputs + 2 * n + ckpt + inputs  # read inputs, do, checkpoints; write the six gradients
    return fwd, fwd + bwd


def peer_ops():
    try:
        from fla.ops.gdn2 import chunk_gdn2 as fc, fused_recurrent_gdn2 as fr
        return fc, fr
    except Exception as e:  # noqa: BLE001
        print(f"peer unavailable: {type(e).__name__}: {e}")
        return None, None


def ours_chunk(*ins, **kw):
    return chunk_gdn2(*ins, backend="triton", **kw)


def save():
    with open(os.path.join(OUT, "ops_gdn2.json"), "w") as f:
        json.dump(res, f, indent=1)


def time_impl(name, fn, ins, tag):
    """Inference forward time, activation memory kept for the backward, forward + backward time."""
    with torch.inference_mode():
        t = median_ms(lambda: fn(*ins))
    rec(f"{name}_fwd_ms_{tag}", round(t, 3))
    leaves = [x.detach().requires_grad_() for x in ins]
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    o, _ = fn(*leaves)
    torch.cuda.synchronize()
    saved = torch.cuda.memory_allocated() - base - o.numel() * o.element_size()
    rec(f"{name}_saved_MB_{tag}", round(saved / 2 ** 20, 1))
    do = torch.randn_like(o)
    o.backward(do)
    del o

    def fb():
        for x in leaves:
            x.grad = None
        o, _ = fn(*leaves)
        o.backward(do)

    rec(f"{name}_fwdbwd_ms_{tag}", round(median_ms(fb), 3))


def bench_training(B, T, H, impls, bw):
    tag = f"{B}x{T}x{H}"
    ins = gpu_inputs(B, T, H, K, V, seed=1)
    fwd_floor, total_floor = floor_bytes(B, T, H)
    rec(f"floor_fwd_ms_{tag}", round(fwd_floor / bw * 1e3, 3))
    rec(f"floor_fwdbwd_ms_{tag}", round(total_floor / bw * 1e3, 3))
    for name, fn in impls:
        t_first = time.time()
        try:
            time_impl(name, fn, ins, tag)  # its tensors are freed when it returns
        except Exception:  # noqa: BLE001
            traceback.print_exc()
        rec(f"{name}_wall_s_{tag}", round(time.time() - t_first, 1))  # compile / autotune included
        torch.cuda.empty_cache()
    save()


GRAPH_CALLS = 16


def graph_call_ms(make_call, calls=GRAPH_CALLS):
    """GPU time of one call, from a CUDA graph of ``calls`` calls replayed by do_bench (which flushes L2
    before each replay): no host launch overhead, as in generation, where the decode step runs as a
    graph. ``make_call(i)`` returns call i; each call should use its own state, so that no call finds
    another's state in L2."""
    fns = [make_call(i) for i in range(calls)]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile / autotune outside the capture
        for f in fns[:2]:
            f()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for f in fns:
            f()
    return median_ms(graph.replay) / calls


def bench_decode(impls):
    """One decode step per implementation: eager (``*_decode_us_*``: one call as Python launches it,
    mostly host time at these sizes) and inside a CUDA graph (``*_decode_graph_us_*``: GPU time)."""
    H = 16
    for Bd in (1, 64, 256):
        ins = [x.detach() for x in gpu_inputs(Bd, 1, H, K, V, seed=2)]
        st = torch.randn(Bd, H, K, V, device="cuda") * 0.1
        floor = 2 * st.numel() * 4
        rec(f"floor_decode_us_B{Bd}", round(floor / res["copy_bw_Bps"] * 1e6, 2))
        states = [st.clone() for _ in range(GRAPH_CALLS)]
        for name, fn in impls:
            try:
                with torch.inference_mode():
                    t = median_ms(lambda: fn(*ins, initial_state=st, output_final_state=True))
                rec(f"{name}_decode_us_B{Bd}", round(t * 1e3, 1))
            except Exception:  # noqa: BLE001
                traceback.print_exc()
            try:
                with torch.inference_mode():
                    t = graph_call_ms(lambda i: (lambda: fn(*ins, initial_state=states[i], output_final_state=True)))
                rec(f"{name}_decode_graph_us_B{Bd}", round(t * 1e3, 1))
            except Exception:  # noqa: BLE001
                traceback.print_exc()
        del states
        if any(name == "ours" for name, _ in impls):
            try:
                cache = st.clone()
                with torch.inference_mode():
                    t = median_ms(lambda: fused_recurrent_gdn2(*ins, initial_state=cache, inplace_final_state=True,
                                                               backend="triton"))
                rec(f"ours_inplace_decode_us_B{Bd}", round(t * 1e3, 1))
            except Exception:  # noqa: BLE001
                traceback.print_exc()
    save()


def profile_split(fn, name="ours", reps=5):
    """Per-kernel CUDA time (ms per call of the operator) at 8 x 4096 x 16: one forward + backward and
    one inference forward, each averaged over ``reps`` profiled calls."""
    B, T, H = PROFILE_SHAPE
    ins = gpu_inputs(B, T, H, K, V, seed=3)
    leaves = [x.detach().requires_grad_() for x in ins]
    do = torch.randn(B, T, H, V, device=ins[0].device, dtype=ins[0].dtype)

    def fb():
        for x in leaves:
            x.grad = None
        o, _ = fn(*leaves)
        o.backward(do)

    def fwd():
        with torch.inference_mode():
            fn(*ins)

    for label, step in (("fwdbwd", fb), ("fwd", fwd)):
        rows = kernel_times(step, reps)
        total = sum(ms for _, ms, _ in rows)
        print(f"\nper-kernel CUDA time, {name} {label} at {B}x{T}x{H} (ms per call, launches per call); "
              f"sum {total:.3f} ms", flush=True)
        for key, ms, n in rows[:16]:
            print(f"  {ms:8.3f} {n:4.1f}  {key[:90]}")
        res[f"{name}_profile_{label}_ms"] = {k: round(ms, 4) for k, ms, _ in rows[:24]}
    save()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="only the first training shape")
    ap.add_argument("--no-peer", action="store_true")
    ap.add_argument("--accuracy", action="store_true")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--budget-s", type=float, default=170.0,
                    help="start no peer shape after this many seconds of the run")
    args = ap.parse_args()
    os.makedirs(OUT, exist_ok=True)
    rec("gpu", torch.cuda.get_device_name())
    rec("torch", torch.__version__)
    rec("triton", triton.__version__)
    bw = copy_bandwidth()
    rec("copy_bw_Bps", round(bw))
    shapes = SHAPES[:1] if args.quick else SHAPES
    # ours first, everywhere; the peer last (its first calls autotune)
    for shape in shapes:
        bench_training(*shape, [("ours", ours_chunk)], bw)
    bench_decode([("ours", lambda *a, **kw: fused_recurrent_gdn2(*a, backend="triton", **kw))])
    if args.profile:
        try:
            profile_split(ours_chunk)
        except Exception:  # noqa: BLE001
            traceback.print_exc()
    rec("ours_done_s", round(time.time() - T_START, 1))
    fla_chunk, fla_rec = (None, None) if args.no_peer else peer_ops()
    if fla_chunk:
        for shape in shapes:
            if time.time() - T_START > args.budget_s:
                rec(f"fla_skipped_{shape[0]}x{shape[1]}x{shape[2]}", "time budget")
                continue
            bench_training(*shape, [("fla", fla_chunk)], bw)
    if fla_rec and time.time() - T_START <= args.budget_s:
        bench_decode([("fla", fla_rec)])
    rec("total_s", round(time.time() - T_START, 1))
    print("\n## GDN-2 operator, bf16, fp32 g, K = V = 128 (ms; median of do_bench)\n")
    print("| shape | floor fwd | ours fwd | fla fwd | floor fwd+bwd | ours fwd+bwd | fla fwd+bwd | speedup | "
          "saved MB ours | saved MB fla |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for B, T, H in SHAPES:
        tag = f"{B}x{T}x{H}"
        if f"floor_fwd_ms_{tag}" not in res:
            continue
        g = lambda k: res.get(f"{k}_{tag}", float("nan"))  # noqa: E731
        sp = g("fla_fwdbwd_ms") / g("ours_fwdbwd_ms")
        print(f"| {tag} | {g('floor_fwd_ms')} | {g('ours_fwd_ms')} | {g('fla_fwd_ms')} | {g('floor_fwdbwd_ms')} | "
              f"{g('ours_fwdbwd_ms')} | {g('fla_fwdbwd_ms')} | {sp:.2f}x | {g('ours_saved_MB')} | {g('fla_saved_MB')} |")
    print("\n| decode (T=1, H=16) | floor us | ours us | ours in-place us | fla us | ours graph us | fla graph us |"
          "\n|---|---|---|---|---|---|---|")
    for Bd in (1, 64, 256):
        print(f"| batch {Bd} | {res.get(f'floor_decode_us_B{Bd}')} | {res.get(f'ours_decode_us_B{Bd}')} | "
              f"{res.get(f'ours_inplace_decode_us_B{Bd}')} | {res.get(f'fla_decode_us_B{Bd}')} | "
              f"{res.get(f'ours_decode_graph_us_B{Bd}')} | {res.get(f'fla_decode_graph_us_B{Bd}')} |")
    save()
    if args.accuracy:
        from gpu_check_gdn2 import run_accuracy, table
        rows = run_accuracy(quick=args.quick, with_peer=not args.no_peer)
        res["accuracy"] = rows
        print(table(rows))
        save()


if __name__ == "__main__":
    main()
