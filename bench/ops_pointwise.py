"""The row-wise stages around the projections on the GPU: RoPE over the attention's joint q | k | v
projection and SwiGLU over the MLP's joint gate | up projection, our Triton kernels against the
compiled torch forms (``train.compile``): the joint stage as one compiled function, and the split form
the layers ran before (the projection split into views, RoPE on q and on k, v copied densely by the
attention operator; SwiGLU on the two halves), whose backward concatenates the pieces' gradients.

At the training shapes of the 1.3B configs (micro-batch 4 x 4096 tokens, bf16): qkv [4, 4096, 6912]
(18 + 2 x 18 heads of 128), gate | up [4, 4096, 13568].
1. accuracy of the kernels against the float64 oracles (outputs and the joint gradient), relative to
   each reference's largest value;
2. forward and forward + backward times: the GPU time of the kernels (torch.profiler), as a training
   step pays it, and the wall time per call (``triton.testing.do_bench`` medians, which at these sizes
   include the host's launch overhead); the memory floor (each input read once, each output written
   once) at the measured copy bandwidth.

Prints a table and writes JSON to $OUT/ops_pointwise.json (./bench_out when OUT is unset).

    PYTHONPATH=. python bench/ops_pointwise.py
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b).abs().max() / b.abs().max()).item()


def _time(fn, inputs, grads) -> dict:
    """Forward alone (no grad) and forward + backward against fixed output gradients: the GPU time of
    their kernels (torch.profiler; what a training step pays, the host running ahead) and the wall time
    of one call (``do_bench``; for launches this small it includes the host's launch overhead)."""
    import triton.testing

    from profiling import kernel_times

    def fwd():
        with torch.no_grad():
            return fn()

    def both():
        for t in inputs:
            t.grad = None
        outs = fn()
        outs = outs if isinstance(outs, tuple) else (outs,)
        torch.autograd.backward(outs, grads, inputs=inputs)

    return {"forward": sum(ms for _, ms, _ in kernel_times(fwd, reps=20)),
            "forward_backward": sum(ms for _, ms, _ in kernel_times(both, reps=20)),
            "wall_forward": triton.testing.do_bench(fwd, warmup=25, rep=100),
            "wall_forward_backward": triton.testing.do_bench(both, warmup=25, rep=100)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--heads", type=int, default=18)
    p.add_argument("--kv-heads", type=int, default=18)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--intermediate", type=int, default=6784)
    p.add_argument("--out", default=os.environ.get("OUT") or str(ROOT / "bench_out"))
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device: this benchmark needs a GPU")
    import triton.testing
    from profiling import write_report

    from gdn2 import stages as elementwise
    from gdn2.layers.attention import rope_tables
    from gdn2.ops import rope_qkv, rope_qkv_reference, swiglu_joined, swiglu_joined_reference

    B, T, H, Hkv, D, F = args.batch, args.seq_len, args.heads, args.kv_heads, args.head_dim, args.intermediate
    C = (H + 2 * Hkv) * D
    dev, bf16 = "cuda", torch.bfloat16
    torch.manual_seed(0)
    qkv = torch.randn(B, T, C, device=dev, dtype=bf16, requires_grad=True)
    gu = (2 * torch.randn(B, T, 2 * F, device=dev)).to(bf16).requires_grad_(True)
    cos, sin = rope_tables(torch.arange(T, device=dev), D, 10000.0)
    d_qkv = [torch.randn(B, T, n, D, device=dev, dtype=bf16) for n in (H, Hkv, Hkv)]
    d_h = torch.randn(B, T, F, device=dev, dtype=bf16)
    report: dict = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
                    "shape": {"B": B, "T": T, "H": H, "Hkv": Hkv, "D": D, "F": F}, "accuracy": {}, "times_ms": {}}

    # 1. accuracy against float64
    outs = rope_qkv(qkv, cos, sin, H, Hkv, backend="triton")
    torch.autograd.backward(outs, d_qkv, inputs=[qkv])
    q64 = qkv.detach().double().requires_grad_(True)
    refs = rope_qkv_reference(q64, cos.double(), sin.double(), H, Hkv)
    torch.autograd.backward(refs, [g.double() for g in d_qkv], inputs=[q64])
    report["accuracy"]["rope_qkv"] = {**{n: _rel(o, r) for n, o, r in zip("qkv", outs, refs)},
                                      "dqkv": _rel(qkv.grad, q64.grad)}
    h = swiglu_joined(gu, backend="triton")
    h.backward(d_h)
    g64 = gu.detach().double().requires_grad_(True)
    ref = swiglu_joined_reference(g64)
    ref.backward(d_h.double())
    report["accuracy"]["swiglu_joined"] = {"h": _rel(h, ref), "dgate_up": _rel(gu.grad, g64.grad)}
    for name, errs in report["accuracy"].items():
        print(f"accuracy, {name}: " + ", ".join(f"{k} {v:.1e}" for k, v in errs.items()), flush=True)

    # 2. times
    def rope_split():
        q, k, v = qkv.split([H * D, Hkv * D, Hkv * D], dim=-1)
        return (elementwise.apply_rope(q.reshape(B, T, H, D), cos, sin), elementwise.apply_rope(k.reshape(B, T, Hkv, D), cos, sin),
                v.reshape(B, T, Hkv, D).contiguous())

    elementwise.set_compiled(True)
    stages = {
        "RoPE q|k|v": ([qkv], d_qkv, {
            "ours (Triton)": lambda: rope_qkv(qkv, cos, sin, H, Hkv, backend="triton"),
            "joint stage, compiled": lambda: elementwise.rope_qkv_stage(qkv, cos, sin, H, Hkv),
            "split form, compiled": rope_split,
        }),
        "SwiGLU gate|up": ([gu], [d_h], {
            "ours (Triton)": lambda: swiglu_joined(gu, backend="triton"),
            "joint stage, compiled": lambda: elementwise.swiglu_joined_stage(gu),
            "split form, compiled": lambda: elementwise.swiglu(*gu.chunk(2, dim=-1)),
        }),
    }
    for stage, (inputs, grads, variants) in stages.items():
        report["times_ms"][stage] = {name: _time(fn, inputs, grads) for name, fn in variants.items()}
    elementwise.set_compiled(False)
    copy_src = torch.empty(B * T * C * 2, device=dev, dtype=torch.uint8)
    copy_dst = torch.empty_like(copy_src)
    copy_ms = triton.testing.do_bench(lambda: copy_dst.copy_(copy_src), warmup=25, rep=100)
    bandwidth = 2 * copy_src.numel() / (copy_ms * 1e-3)
    report["copy_bandwidth_TBps"] = bandwidth / 1e12
    rope_bytes = B * T * C * 2  # one bf16 pass over qkv
    glu_bytes = B * T * F * 2  # one bf16 pass over one half
    floors = {"RoPE q|k|v": (2 * rope_bytes, 4 * rope_bytes), "SwiGLU gate|up": (3 * glu_bytes, 8 * glu_bytes)}
    report["floor_ms"] = {k: {"forward": f / bandwidth * 1e3, "forward_backward": fb / bandwidth * 1e3}
                          for k, (f, fb) in floors.items()}

    print(f"\nrow-wise stages, {B} x {T} tokens, bf16, {report['device']}")
    print("| stage | variant | kernel ms forward | kernel ms fwd + bwd | fwd + bwd vs split form | "
          "wall ms forward | wall ms fwd + bwd |")
    print("|---|---|---|---|---|---|---|")
    for stage, times in report["times_ms"].items():
        base = times["split form, compiled"]["forward_backward"]
        for name, t in times.items():
            print(f"| {stage} | {name} | {t['forward']:.3f} | {t['forward_backward']:.3f} | "
                  f"{t['forward_backward'] / base:.2f}x | {t['wall_forward']:.3f} | {t['wall_forward_backward']:.3f} |")
        f = report["floor_ms"][stage]
        print(f"| {stage} | memory floor ({report['copy_bandwidth_TBps']:.2f} TB/s) | {f['forward']:.3f} | "
              f"{f['forward_backward']:.3f} | | | |")
    write_report(args.out, "ops_pointwise.json", report)


if __name__ == "__main__":
    main()
