"""Generation speed of ``swa_gdn2_1.3B`` in bf16 (random weights built on the GPU): prefill and decode.

One run does, in order (each stage writes what it has to the JSON before the next one starts):
1. correctness on the GPU: prompts of different lengths prefilled together, then decoded step by step,
   against full forward passes (relative error of the logits, bf16), judged against the error of the
   bf16 full forward pass itself against fp32; the captured CUDA graph against the eager decode step;
2. the device-to-device copy bandwidth, for the memory floor of a decode step (every weight read once,
   plus the whole KV ring buffer, which a static-shape step attends over with a mask);
3. prefill tokens/s: batch 1 x 1024 tokens and batch 64 x 512 tokens (packed, one pass);
4. decode ms/token and tokens/s at batch 1 and 64, for the eager step, the captured CUDA graph, and
   the CUDA graph of the torch.compile'd block step (greedy argmax between steps, on the device);
5. end to end ``Generator.generate`` at batch 1 (128 new tokens): host-side stop checks included.

Prints a table and writes JSON to $OUT/generate_bench.json (./bench_out when OUT is unset).

    PYTHONPATH=. python bench/generate.py [--config swa_gdn2_1.3B] [--steps 100] [--deadline 185]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from gdn2.config import Config  # noqa: E402
from gdn2.generate import CapturedDecodeStep, Generator  # noqa: E402
from gdn2.model import GPT, InferenceCache, block_decode_step  # noqa: E402

START = time.time()
RESULTS: dict = {"stages": {}, "errors": {}}


def out_path() -> Path:
    out = Path(os.environ.get("OUT") or ROOT / "bench_out")
    out.mkdir(parents=True, exist_ok=True)
    return out / "generate_bench.json"


def save() -> None:
    RESULTS["elapsed_s"] = round(time.time() - START, 1)
    out_path().write_text(json.dumps(RESULTS, indent=2) + "\n")


def stage(name: str, fn, *args, **kwargs):
    """Run one stage; record its result or its error, save, and go on."""
    t = time.time()
    try:
        value = fn(*args, **kwargs)
        RESULTS["stages"][name] = value
    except Exception as e:  # noqa: BLE001 - a failing stage must not lose the others
        RESULTS["errors"][name] = f"{type(e).__name__}: {e}"
        traceback.print_exc()
        value = None
    print(f"[{time.time() - START:6.1f}s] {name} ({time.time() - t:.1f}s): {json.dumps(value)[:300]}", flush=True)
    save()
    return value


def build_model(name: str) -> GPT:
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = GPT(Config.from_name(name))
    keep = {id(b.mixer.A_log) for b in model.transformer.h if b.kind == "gdn2"}
    keep |= {id(b.mixer.dt_bias) for b in model.transformer.h if b.kind == "gdn2"}
    for p in model.parameters():
        if id(p) not in keep:  # decay parameters stay fp32, as in training
            p.data = p.data.to(torch.bfloat16)
    return model.eval()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


@torch.no_grad()
def check_correctness(model: GPT) -> dict:
    V = model.config.vocab_size
    lengths, extra = [37, 64, 1], 8
    seqs = [torch.randint(0, V, (n + extra,), device="cuda") for n in lengths]
    cache = InferenceCache(model, len(lengths), max_length=256)
    eager = [model.prefill([s[:n] for s, n in zip(seqs, lengths)], cache)]
    for j in range(extra):
        eager.append(model.decode_step(torch.stack([s[n + j] for s, n in zip(seqs, lengths)]), cache))
    errs, baseline = [], []
    # bf16 rounding alone: the same full forward pass in bf16 against fp32 (weights upcast)
    reference = GPT(model.config).to("cuda").eval()
    reference.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    for r, (s, n) in enumerate(zip(seqs, lengths)):
        full = model(s[None])[0]
        full32 = reference(s[None])[0]
        errs.append(max(rel_err(eager[j][r], full[n - 1 + j]) for j in range(extra + 1)))
        baseline.append(max(rel_err(full[n - 1 + j], full32[n - 1 + j]) for j in range(extra + 1)))
    del reference
    graph_cache = InferenceCache(model, len(lengths), max_length=256)
    step = CapturedDecodeStep(model, graph_cache)
    graph_cache.reset()
    graph = [model.prefill([s[:n] for s, n in zip(seqs, lengths)], graph_cache)]
    for j in range(extra):
        graph.append(step(torch.stack([s[n + j] for s, n in zip(seqs, lengths)])).clone())
    graph_err = max(rel_err(g, e) for g, e in zip(graph, eager))
    return {"prompt_lengths": lengths, "decode_vs_full_forward_rel_err": errs,
            "bf16_vs_fp32_full_forward_rel_err": baseline, "graph_vs_eager_rel_err": graph_err,
            "ok": max(errs) < 2 * max(baseline) + 1e-3 and graph_err < 1e-3}


def copy_bandwidth() -> float:
    """Bytes read + written per second by a large device-to-device copy (median of 10)."""
    src = torch.randn(512 * 2**20, device="cuda", dtype=torch.float32)  # 2 GiB
    dst = torch.empty_like(src)
    times = []
    for i in range(13):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        torch.cuda.synchronize()
        if i >= 3:
            times.append(a.elapsed_time(b) / 1e3)
    del src, dst
    return 2 * 512 * 2**20 * 4 / statistics.median(times)


def prompts(batch: int, length: int, vocab: int, ragged: bool) -> list[torch.Tensor]:
    """``batch`` prompts of ``length`` tokens, or of lengths spread over [length/2, length]."""
    lengths = [length - (i * length // (2 * batch) if ragged else 0) for i in range(batch)]
    return [torch.randint(0, vocab, (n,), device="cuda") for n in lengths]


@torch.no_grad()
def time_prefill(model: GPT, batch: int, length: int, cache: InferenceCache) -> dict:
    ps = prompts(batch, length, model.config.vocab_size, ragged=False)
    times = []
    for i in range(6):
        cache.reset()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        model.prefill(ps, cache)
        b.record()
        torch.cuda.synchronize()
        if i >= 2:
            times.append(a.elapsed_time(b) / 1e3)
    t = statistics.median(times)
    return {"batch": batch, "prompt_tokens": length, "ms": round(t * 1e3, 3),
            "tokens_per_s": round(batch * length / t, 1)}


@torch.no_grad()
def time_decode(model: GPT, cache: InferenceCache, variant: str, steps: int, compiled=None) -> dict:
    B = cache.batch_size
    if variant == "eager":
        step = lambda tok: model.decode_step(tok, cache)  # noqa: E731
    else:
        captured = CapturedDecodeStep(model, cache, block_step=compiled if variant == "graph+compile" else None)
        step = captured
    cache.reset()
    logits = model.prefill(prompts(B, 128, model.config.vocab_size, ragged=True), cache)
    tok = logits.argmax(-1)
    for _ in range(8):
        tok = step(tok).argmax(-1)
    times = []
    for _ in range(3):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(steps):
            tok = step(tok).argmax(-1)
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / 1e3 / steps)
    t = statistics.median(times)
    return {"batch": B, "variant": variant, "ms_per_token": round(t * 1e3, 4), "tokens_per_s": round(B / t, 1),
            "all_ms_per_token": [round(x * 1e3, 4) for x in times]}


@torch.no_grad()
def end_to_end(model: GPT, new_tokens: int) -> dict:
    gen = Generator(model, None, max_batch_size=1)
    prompt = prompts(1, 128, model.config.vocab_size, ragged=False)[0].tolist()
    gen.generate([prompt], max_new_tokens=4)  # capture the graph
    cache = gen._cache_rows(1)
    walls = []
    for _ in range(3):
        cache.reset()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        model.prefill([torch.tensor(prompt, device="cuda")], cache)
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        out = gen.generate([prompt], max_new_tokens=new_tokens)
        t2 = time.perf_counter()
        assert len(out[0].tokens) == new_tokens
        walls.append(((t2 - t1) - (t1 - t0)) / (new_tokens - 1))
    return {"batch": 1, "new_tokens": new_tokens, "decode_ms_per_token": round(statistics.median(walls) * 1e3, 4)}


def floor_ms(model: GPT, batch: int, bandwidth: float) -> float:
    """Bytes a decode step must move: every weight but the embedding table once, the KV ring buffers
    (a static-shape step reads all of it), the GDN-2 states read and written."""
    c = model.config
    weights = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "wte" not in n)
    attn_layers = sum(1 for b in model.transformer.h if b.kind == "attention")
    gdn_layers = c.n_layer - attn_layers
    cap = min(c.sliding_window or c.block_size, c.block_size)
    kv = attn_layers * 2 * batch * cap * c.n_query_groups * c.head_size * 2
    state = gdn_layers * 2 * batch * c.gdn2_num_v_heads * c.gdn2_head_dim * c.gdn2_head_v_dim * 4
    return (weights + kv + state) / bandwidth * 1e3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="swa_gdn2_1.3B")
    parser.add_argument("--steps", type=int, default=100, help="decode steps per timing")
    parser.add_argument("--deadline", type=float, default=185.0, help="skip stages that would start after this (s)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench/generate.py needs a CUDA GPU", file=sys.stderr)
        return 2
    RESULTS["env"] = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                      "triton": __import__("triton").__version__, "config": args.config, "dtype": "bfloat16"}
    try:
        model = build_model(args.config)
    except Exception as e:  # noqa: BLE001
        RESULTS["errors"]["build"] = f"{type(e).__name__}: {e}"
        save()
        raise
    RESULTS["env"]["parameters"] = model.num_parameters()
    stage("correctness", check_correctness, model)
    bandwidth = stage("copy_bandwidth_bytes_per_s", copy_bandwidth) or 4.3e12

    big = InferenceCache(model, 64, max_length=model.config.block_size)
    for batch, length in ((1, 1024), (64, 512)):
        stage(f"prefill_b{batch}", time_prefill, model, batch, length, big.rows(batch))

    compiled = torch.compile(block_decode_step, dynamic=False)
    # cheapest first; compilation last, so that a slow compile costs only its own numbers
    for variant in ("eager", "graph", "graph+compile"):
        for batch in (1, 64):
            if time.time() - START > args.deadline:
                RESULTS["errors"][f"decode_b{batch}_{variant}"] = "skipped: deadline"
                continue
            r = stage(f"decode_b{batch}_{variant}", time_decode, model, big.rows(batch), variant, args.steps,
                      compiled)
            if r is not None:
                r["floor_ms_per_token"] = round(floor_ms(model, batch, bandwidth), 4)
            save()
    if time.time() - START < args.deadline:
        stage("generate_end_to_end_b1", end_to_end, model, 128)

    print()
    print(f"{args.config} bf16 on {RESULTS['env']['gpu']}, copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    print(f"{'what':<28}{'batch':>6}{'ms':>12}{'tokens/s':>14}{'floor ms':>10}")
    for name, r in RESULTS["stages"].items():
        if isinstance(r, dict) and "tokens_per_s" in r:
            ms = r.get("ms_per_token", r.get("ms"))
            print(f"{name:<28}{r['batch']:>6}{ms:>12.4f}{r['tokens_per_s']:>14.1f}"
                  f"{r.get('floor_ms_per_token', math.nan):>10.4f}")
    e2e = RESULTS["stages"].get("generate_end_to_end_b1")
    if e2e:
        print(f"{'generate() end to end':<28}{1:>6}{e2e['decode_ms_per_token']:>12.4f}")
    if RESULTS["errors"]:
        print("errors:", json.dumps(RESULTS["errors"], indent=1))
    print(f"wrote {out_path()}")
    save()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
