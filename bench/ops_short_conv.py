"""The GDN-2 layer's short convolution (causal depthwise conv, kernel 4, + SiLU) on the GPU: our Triton
kernel against the torch stage it replaces, compiled (``train.compile``) and eager.

At the training shape of ``swa_gdn2_1.3B`` (micro-batch 4 x 4096 tokens, 2048 channels, the input a
slice of the grouped projection's [4, 4096, 10496] bf16 output, fp32 taps):
1. accuracy of the kernel against the float64 oracle: output, dx and dw (with and without document
   starts), relative to each reference's largest value;
2. forward and forward + backward times (``triton.testing.do_bench`` medians) of the kernel, the
   compiled stage and the eager stage, and the memory floor (x read once, y written once; backward:
   x and dy read, dx written) at the measured copy bandwidth;
3. with ``--sweep``: the forward and the backward kernels alone over candidate tiles (rows, channels,
   warps), each checked against the default tiles' results first.

Prints a table and writes JSON to $OUT/ops_short_conv.json (./bench_out when OUT is unset).

    PYTHONPATH=. python bench/ops_short_conv.py [--sweep]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


FWD_CANDIDATES = [(32, 64, 4), (32, 128, 4), (64, 64, 4), (64, 128, 4), (64, 128, 8), (128, 64, 4), (128, 128, 8)]
BWD_CANDIDATES = [(16, 64, 2), (16, 128, 4), (32, 64, 4), (32, 128, 4), (32, 128, 8), (64, 64, 4), (64, 128, 4),
                  (64, 128, 8)]


def sweep(x: torch.Tensor, weight: torch.Tensor, dy: torch.Tensor) -> dict:
    """The kernels alone over candidate tiles: forward (y) and backward (dx, dw) times, every candidate's
    results checked against the default tiles' (y and dx equal: each element's sum does not depend on
    the tile; dw to fp32 summation order, 1e-5 of its largest value)."""
    import triton.testing

    from gdn2.ops.short_conv import conv

    default_fwd, default_bwd = conv.FWD_TILE, conv.BWD_TILE

    def run():
        xr = x.detach().requires_grad_(True)
        wr = weight.detach().requires_grad_(True)
        y = conv.ShortConvSiLUFunction.apply(xr, wr, None)
        y.backward(dy)
        return y.detach(), xr.grad, wr.grad

    ref = run()
    rows: dict = {"forward": [], "backward": []}
    with torch.no_grad():
        for tile in FWD_CANDIDATES:
            conv.FWD_TILE = tile
            y = conv.ShortConvSiLUFunction.apply(x.detach(), weight.detach(), None)
            ok = torch.equal(y, ref[0])
            ms = triton.testing.do_bench(lambda: conv.ShortConvSiLUFunction.apply(x.detach(), weight.detach(), None),
                                         warmup=25, rep=100)
            rows["forward"].append({"tile": tile, "ms": ms, "same": ok})
    conv.FWD_TILE = default_fwd
    xs = x.detach().requires_grad_(True)
    ws = weight.detach().requires_grad_(True)
    scale = {name: t.abs().max().item() for name, t in (("dx", ref[1]), ("dw", ref[2]))}
    for tile in BWD_CANDIDATES:
        conv.BWD_TILE = tile
        _, dx, dw = run()
        ok = torch.equal(dx, ref[1]) and bool(((dw - ref[2]).abs().max() <= 1e-5 * scale["dw"]).item())
        y = conv.ShortConvSiLUFunction.apply(xs, ws, None)
        ms = triton.testing.do_bench(lambda: torch.autograd.backward(y, dy, inputs=[xs, ws], retain_graph=True),
                                     warmup=25, rep=100, grad_to_none=[xs, ws])
        rows["backward"].append({"tile": tile, "ms": ms, "same": ok})
    conv.BWD_TILE = default_bwd
    for kind, default in (("forward", default_fwd), ("backward", default_bwd)):
        print(f"\n{kind} kernels by tile (rows, channels, warps); default {default}")
        print("| tile | ms | same results |\n|---|---|---|")
        for r in sorted(rows[kind], key=lambda r: r["ms"]):
            print(f"| {r['tile']} | {r['ms']:.3f} | {r['same']} |")
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--channels", type=int, default=2048)
    p.add_argument("--row-width", type=int, default=10496, help="width of the tensor x is a slice of")
    p.add_argument("--sweep", action="store_true", help="time the kernels over candidate tiles")
    p.add_argument("--out", default=os.environ.get("OUT") or str(ROOT / "bench_out"))
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device: this benchmark needs a GPU")
    import triton.testing

    from gdn2 import stages as elementwise
    from gdn2.ops import short_conv_silu, short_conv_silu_reference

    B, T, C, W = args.batch, args.seq_len, args.channels, args.row_width
    dev = "cuda"
    torch.manual_seed(0)
    wide = torch.randn(B, T, W, device=dev, dtype=torch.bfloat16)
    weight = (0.5 * torch.randn(C, 1, 4, device=dev)).requires_grad_(True)
    up = torch.randn(B, T, C, device=dev, dtype=torch.bfloat16)
    pos = torch.cat([torch.arange(n) for n in (1000, 1, 2047, T - 3048)]).to(dev)

    report: dict = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
                    "shape": {"B": B, "T": T, "C": C, "row_width": W}, "accuracy": {}, "times_ms": {}}
    # 1. accuracy
    for label, pd in (("no documents", None), ("document starts", pos)):
        x = wide[..., :C].detach().requires_grad_(True)
        w = weight.detach().requires_grad_(True)
        y = short_conv_silu(x, w, pd, backend="triton")
        (y.float() * up.float()).sum().backward()
        x64 = x.detach().double().requires_grad_(True)
        w64 = w.detach().double().requires_grad_(True)
        ref = short_conv_silu_reference(x64, w64.to(torch.bfloat16).double(), None, pd)
        (ref * up.double()).sum().backward()
        errs = {name: ((a.double() - b).abs().max() / b.abs().max()).item()
                for name, a, b in (("y", y, ref), ("dx", x.grad, x64.grad), ("dw", w.grad, w64.grad))}
        report["accuracy"][label] = errs
        print(f"accuracy, {label}: " + ", ".join(f"{k} {v:.1e}" for k, v in errs.items()), flush=True)

    # 2. times
    x = wide[..., :C].detach().requires_grad_(True)
    elementwise.set_compiled(True)
    variants = {
        "ours (Triton)": lambda: short_conv_silu(x, weight, None, backend="triton"),
        "torch stage, compiled": lambda: elementwise.causal_conv_silu(x, weight, None, None),
        "torch stage, eager": lambda: elementwise.causal_conv_silu.eager(x, weight, None, None),
    }
    dy = torch.randn(B, T, C, device=dev, dtype=torch.bfloat16)
    for name, fn in variants.items():
        with torch.no_grad():
            fwd = triton.testing.do_bench(fn, warmup=25, rep=100)

        def fwd_bwd():
            y = fn()
            torch.autograd.backward(y, dy, inputs=[x, weight])

        both = triton.testing.do_bench(fwd_bwd, warmup=25, rep=100, grad_to_none=[x, weight])
        report["times_ms"][name] = {"forward": fwd, "forward_backward": both}
    elementwise.set_compiled(False)
    copy_src = torch.empty(B * T * C * 4, device=dev, dtype=torch.uint8)
    copy_dst = torch.empty_like(copy_src)
    copy_ms = triton.testing.do_bench(lambda: copy_dst.copy_(copy_src), warmup=25, rep=100)
    bandwidth = 2 * copy_src.numel() / (copy_ms * 1e-3)
    act = B * T * C * 2
    report["floor_ms"] = {"forward": 2 * act / bandwidth * 1e3, "forward_backward": 6 * act / bandwidth * 1e3}
    report["copy_bandwidth_TBps"] = bandwidth / 1e12

    base = report["times_ms"]["torch stage, compiled"]
    print(f"\nshort conv + SiLU, {B} x {T} x {C} (a slice of {W}), bf16, {report['device']}")
    print("| variant | forward ms | forward + backward ms | fwd + bwd vs compiled stage |")
    print("|---|---|---|---|")
    for name, t in report["times_ms"].items():
        print(f"| {name} | {t['forward']:.3f} | {t['forward_backward']:.3f} | "
              f"{t['forward_backward'] / base['forward_backward']:.2f}x |")
    f = report["floor_ms"]
    print(f"| memory floor ({report['copy_bandwidth_TBps']:.2f} TB/s) | {f['forward']:.3f} | "
          f"{f['forward_backward']:.3f} | |")
    if args.sweep:
        report["sweep"] = sweep(x, weight, dy)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "ops_short_conv.json").write_text(json.dumps(report, indent=1))
    print(f"wrote {out / 'ops_short_conv.json'}")


if __name__ == "__main__":
    main()
