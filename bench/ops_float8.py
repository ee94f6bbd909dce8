"""float8 matmuls at the training step's GEMM shapes: what torchao's float8 training would save.

For every distinct GEMM of one optimizer step of ``--config`` (micro-batch 4 x 4096 = 16,384 tokens,
grouped projections as the trainer runs them: a GDN-2 layer's seven input projections as one GEMM, an
MLP's two as one, the attention layer's qkv), this times forward + backward (y, dx, dW: three GEMMs)
of a bias-free linear with an fp32 weight and a bf16 input under bf16 autocast, as the trainer runs
it, against torchao's ``Float8Linear`` with each ``--recipes`` scaling (``tensorwise``, ``rowwise``,
``rowwise_with_gw_hp``); both compiled with ``torch.compile`` (float8's scaling and casts fused, as
torchao requires for speed). The per-step total (each shape's time x its count per step) says how much
of the step's GEMM time float8 could take off, casts and scales included; a second total keeps the
shapes ``train.float8`` leaves in bf16 (the head, the low-rank gate ups) at their bf16 time. Each
float8 output is checked against the bf16 one (relative error of y, dx, dW).

Prints a table and writes JSON to $OUT/ops_float8_<config>.json (./bench_out when OUT is unset).

    PYTHONPATH=. python bench/ops_float8.py [--config swa_gdn2_1.3B] [--recipes tensorwise,rowwise]
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import Counter
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def kept_in_bf16(config, spec) -> set:
    """The (in, out) shapes ``train.float8`` leaves in bf16, read off the model: the projections
    :func:`gdn2.options.apply_options` does not mark (the head, the GDN-2 gates' low-rank ups)."""
    from gdn2.model import GPT
    from gdn2.modules import Linear
    from gdn2.options import ModelOptions, apply_options

    with torch.device("meta"):
        model = GPT(config)
    apply_options(model, ModelOptions(float8=spec))
    return {(m.in_features, m.out_features) for m in model.modules() if isinstance(m, Linear) and m.float8 is None}


def step_gemms(config, tokens: int) -> Counter:
    """(in features, out features) -> count, for one forward of ``tokens`` tokens with grouped
    projections (the trainer's default); the head is one GEMM over all tokens."""
    c = config
    shapes: Counter = Counter()
    for i in range(c.n_layer):
        if c.is_gdn2_layer(i):
            kd, vd, r = c.gdn2_key_dim, c.gdn2_value_dim, c.gdn2_gate_rank
            # a gate per head is its own GEMM (as train.float8 runs it: exempt, out of the float8 group)
            gates = [(c.gdn2_erase_units, c.gdn2_erase == "channel"), (c.gdn2_write_units, c.gdn2_write == "channel")]
            per_channel = sum(units for units, channel in gates if channel)
            shapes[(c.n_embd, 2 * kd + vd + r + per_channel + r)] += 1  # q k v, decay low rank, gates, gate low rank
            for units, channel in gates:
                if units and not channel:
                    shapes[(c.n_embd, units)] += 1
            shapes[(r, c.gdn2_decay_units)] += 1  # decay up
            shapes[(r, vd)] += 1  # output gate up
            shapes[(vd, c.n_embd)] += 1  # o_proj
        else:
            shapes[(c.n_embd, (c.n_head + 2 * c.n_query_groups) * c.head_size)] += 1
            shapes[(c.n_head * c.head_size, c.n_embd)] += 1
        shapes[(c.n_embd, 2 * c.intermediate_size)] += 1
        shapes[(c.intermediate_size, c.n_embd)] += 1
    shapes[(c.n_embd, c.vocab_size)] += 1
    return shapes


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="swa_gdn2_1.3B")
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--recipes", type=lambda v: v.split(","), default=["tensorwise", "rowwise", "rowwise_with_gw_hp"])
    p.add_argument("--out", default=os.environ.get("OUT") or str(ROOT / "bench_out"))
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/ops_float8.py: needs a CUDA GPU with float8 (sm_89 or newer)")
    try:
        import torchao
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError:
        raise SystemExit("bench/ops_float8.py: torchao is not installed (pip install torchao)") from None
    import triton.testing
    from profiling import write_report

    from gdn2.float8 import float8_spec
    from gdn2.train.recipe import load_recipe

    config = load_recipe(args.config).model
    shapes = step_gemms(config, args.tokens)
    dev = "cuda"
    report: dict = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
                    "torchao": torchao.__version__, "config": args.config, "tokens": args.tokens, "rows": []}
    print(f"{args.config}: {sum(shapes.values())} GEMMs per forward at {args.tokens} tokens, "
          f"{len(shapes)} shapes; {report['device']}, torch {torch.__version__}, torchao {torchao.__version__}",
          flush=True)
    totals = Counter()
    kept = {r: kept_in_bf16(config, float8_spec(r)) for r in args.recipes}
    for (k, n), count in sorted(shapes.items()):
        torch.manual_seed(0)
        x = torch.randn(args.tokens, k, device=dev, dtype=torch.bfloat16)  # a norm's output, as in the model
        dy = torch.randn(args.tokens, n, device=dev, dtype=torch.bfloat16)
        row: dict = {"in": k, "out": n, "count": count, "ms": {}, "rel_err": {}}

        def fwd_bwd(layer, xr):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                y = layer(xr)
            y.backward(dy)
            return y

        base = torch.nn.Linear(k, n, bias=False, device=dev)
        torch.nn.init.normal_(base.weight, std=k ** -0.5)
        results = {}
        variants = {"bf16": None, **{r: r for r in args.recipes}}
        for name, recipe in variants.items():
            layer = torch.nn.Sequential(torch.nn.Linear(k, n, bias=False, device=dev))
            layer[0].weight.data.copy_(base.weight.data)
            if recipe is not None:
                if k % 16 or n % 16:
                    continue
                convert_to_float8_training(layer, config=Float8LinearConfig.from_recipe_name(recipe))
            torch._dynamo.reset()  # one compile per variant and shape, none hitting the recompile limit
            layer = torch.compile(layer)
            xr = x.clone().requires_grad_(True)
            y = fwd_bwd(layer, xr)
            results[name] = (y.detach().float(), xr.grad.float(), layer._orig_mod[0].weight.grad.float())
            ms = triton.testing.do_bench(lambda: fwd_bwd(layer, xr), warmup=10, rep=50, grad_to_none=[xr])
            row["ms"][name] = ms
            totals[name] += ms * count
        for name in variants:
            if name != "bf16" and name in row["ms"]:
                as_run = "bf16" if (k, n) in kept[name] else name
                totals[f"{name}, as train.float8 runs it"] += row["ms"][as_run] * count
        for name in results:
            if name == "bf16":
                continue
            row["rel_err"][name] = {t: ((a - b).norm() / b.norm()).item() for t, a, b in
                                    zip(("y", "dx", "dW"), results[name], results["bf16"])}
        report["rows"].append(row)
        print(f"{k} -> {n} x{count}: " + ", ".join(f"{m} {v:.3f} ms" for m, v in row["ms"].items()) + "; "
              + "; ".join(f"{m} err " + "/".join(f"{e:.1e}" for e in errs.values())
                          for m, errs in row["rel_err"].items()), flush=True)
    report["per_step_ms"] = dict(totals)
    print(f"\nforward + backward of every GEMM of one micro-batch ({args.tokens} tokens), {args.config}:")
    print("| variant | ms per micro-batch | vs bf16 |\n|---|---|---|")
    for name, ms in totals.items():
        print(f"| {name} | {ms:.1f} | {totals['bf16'] / ms:.2f}x |")
    write_report(args.out, f"ops_float8_{args.config}.json", report)


if __name__ == "__main__":
    main()
