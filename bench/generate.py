"""Generation speed of ``swa_gdn2_1.3B`` in bf16 (random weights built on the GPU): prefill and decode.

One run does, in order (each stage writes what it has to the JSON before the next one starts):
1. correctness on the GPU: prompts of different lengths prefilled together, then decoded step by step
   with the unfused and the fused decode step (``DecodeWeights``), against full forward passes
   (relative error of the logits, bf16), judged against the error of the bf16 full forward pass itself
   against fp32; the captured CUDA graph of the fused step against its eager run; the compiled fused
   step (batch 1, the graphs the timings reuse) against the eager fused step and the full forward;
2. the device-to-device copy bandwidth, for the memory floor of a decode step (every weight read once,
   plus the whole KV ring buffer, which a static-shape step attends over with a mask); the attention
   layers' decode op alone (the Triton ring-buffer kernel against the torch path) at batch 1 and 64;
3. prefill tokens/s: batch 1 x 1024 tokens and batch 64 x 512 tokens (packed, one pass);
4. decode ms/token and tokens/s at batch 1 and 64: the captured CUDA graph of the torch.compile'd
   step, the plain CUDA graph and the eager step, each unfused and fused (greedy argmax between
   steps, on the device); the most telling first, eager last; at batch 1 also the device kernels per
   step of the four captured variants (torch.profiler): their count, summed time and top kernels;
5. end to end ``Generator.generate`` at batch 1 (128 new tokens; its defaults: fused and compiled):
   host-side stop checks included (run between the decode timings, see the plan in ``main``).

Time budget: each stage has an expected cost; a stage that would end after ``--budget`` seconds
(default 160) is skipped and listed as such, so that the run ends within about 3 minutes on an H200.
The stages run in the order of the plan in ``main``, the most telling first.

Prints a table and writes JSON to $OUT/generate_bench.json (./bench_out when OUT is unset).

    PYTHONPATH=. python bench/generate.py [--config swa_gdn2_1.3B] [--steps 100] [--budget 160]
    PYTHONPATH=. python bench/generate.py --smoke   # CPU, tiny config: checks the script itself

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
from typing import Callable, Optional

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from gdn2.config import Config  # noqa: E402
from gdn2.generation import CapturedDecodeStep, Generator  # noqa: E402
from gdn2.generation.cache import InferenceCache  # noqa: E402
from gdn2.generation.decode import DecodeWeights, compiled_block_step, decode_step, prefill  # noqa: E402
from gdn2.model import GPT  # noqa: E402

START = time.time()
RESULTS: dict = {"stages": {}, "errors": {}, "skipped": {}}
BUDGET = 160.0
DEVICE = torch.device("cuda")


def out_path() -> Path:
    out = Path(os.environ.get("OUT") or ROOT / "bench_out")
    out.mkdir(parents=True, exist_ok=True)
    return out / "generate_bench.json"


def save() -> None:
    RESULTS["elapsed_s"] = round(time.time() - START, 1)
    out_path().write_text(json.dumps(RESULTS, indent=2) + "\n")


def stage(name: str, expected_s: float, fn, *args, **kwargs):
    """Run one stage unless it would end past the budget; record its result or its error, save, go on."""
    elapsed = time.time() - START
    if elapsed + expected_s > BUDGET:
        RESULTS["skipped"][name] = f"at {elapsed:.0f} s, expected {expected_s:.0f} s, budget {BUDGET:.0f} s"
        print(f"[{elapsed:6.1f}s] {name}: skipped (budget)", flush=True)
        save()
        return None
    t = time.time()
    try:
        value = fn(*args, **kwargs)
        RESULTS["stages"][name] = value
    except Exception as e:  # noqa: BLE001 - a failing stage must not lose the others
        RESULTS["errors"][name] = f"{type(e).__name__}: {e}"
        traceback.print_exc()
        value = None
    if isinstance(value, dict):
        value["stage_s"] = round(time.time() - t, 1)
    print(f"[{time.time() - START:6.1f}s] {name} ({time.time() - t:.1f}s): {json.dumps(value)[:300]}", flush=True)
    save()
    return value


def sync() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def build_model(name: str, smoke: bool) -> GPT:
    torch.manual_seed(0)
    overrides = dict(vocab_size=512, sliding_window=64) if smoke else {}
    dtype = torch.float32 if smoke else torch.bfloat16  # bf16 GEMMs on a CPU only slow the smoke run
    with torch.device(DEVICE):
        model = GPT(Config.from_name(name, **overrides))
    keep = {id(b.mixer.A_log) for b in model.transformer.h if b.kind == "gdn2"}
    keep |= {id(b.mixer.dt_bias) for b in model.transformer.h if b.kind == "gdn2"}
    for p in model.parameters():
        if id(p) not in keep:  # decay parameters stay fp32, as in training
            p.data = p.data.to(dtype)
    return model.eval()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def decode_run(model: GPT, seqs: list[torch.Tensor], lengths: list[int], extra: int,
               weights: Optional[DecodeWeights] = None, step: Optional[Callable] = None,
               cache: Optional[InferenceCache] = None) -> list[torch.Tensor]:
    """Ragged prefill of ``seqs[r][:lengths[r]]``, then ``extra`` steps feeding the known tokens.
    ``step(tokens)`` replaces the eager ``decode_step`` (a captured graph). Logits per step."""
    cache = cache or InferenceCache(model, len(seqs), max_length=256)
    cache.reset()
    out = [prefill(model, [s[:n] for s, n in zip(seqs, lengths)], cache)]
    for j in range(extra):
        tokens = torch.stack([s[n + j] for s, n in zip(seqs, lengths)])
        logits = step(tokens) if step is not None else decode_step(model, tokens, cache, weights)
        out.append(logits.clone())
    return out


@torch.no_grad()
def check_correctness(model: GPT) -> dict:
    V = model.config.vocab_size
    lengths, extra = [37, 64, 1], 8
    seqs = [torch.randint(0, V, (n + extra,), device=DEVICE) for n in lengths]
    weights = DecodeWeights(model)
    unfused = decode_run(model, seqs, lengths, extra)
    fused = decode_run(model, seqs, lengths, extra, weights)
    # bf16 rounding alone: the same full forward pass in bf16 against fp32 (weights upcast)
    with torch.device(DEVICE):
        reference = GPT(model.config).eval()
    reference.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    errs, fused_errs, baseline = [], [], []
    for r, (s, n) in enumerate(zip(seqs, lengths)):
        full = model(s[None])[0]
        full32 = reference(s[None])[0]
        errs.append(max(rel_err(unfused[j][r], full[n - 1 + j]) for j in range(extra + 1)))
        fused_errs.append(max(rel_err(fused[j][r], full[n - 1 + j]) for j in range(extra + 1)))
        baseline.append(max(rel_err(full[n - 1 + j], full32[n - 1 + j]) for j in range(extra + 1)))
    del reference
    fused_vs_unfused = max(rel_err(f, u) for f, u in zip(fused, unfused))
    result = {"prompt_lengths": lengths, "decode_vs_full_forward_rel_err": errs,
              "fused_decode_vs_full_forward_rel_err": fused_errs,
              "bf16_vs_fp32_full_forward_rel_err": baseline, "fused_vs_unfused_rel_err": fused_vs_unfused}
    limit = 2 * max(baseline) + 1e-3
    ok = max(errs) < limit and max(fused_errs) < limit
    if DEVICE.type == "cuda":
        graph_cache = InferenceCache(model, len(lengths), max_length=256)
        captured = CapturedDecodeStep(model, graph_cache, weights=weights)
        graph = decode_run(model, seqs, lengths, extra, step=captured, cache=graph_cache)
        result["fused_graph_vs_eager_rel_err"] = max(rel_err(g, e) for g, e in zip(graph, fused))
        ok = ok and result["fused_graph_vs_eager_rel_err"] < 1e-3
    result["ok"] = ok
    return result


@torch.no_grad()
def check_compiled(model: GPT) -> dict:
    """The compiled fused step at batch 1 (the bucket the timings and Generator reuse) against the
    eager fused step and the full forward: inductor fuses differently, so bf16 rounding differs."""
    V = model.config.vocab_size
    lengths, extra = [37], 8
    seqs = [torch.randint(0, V, (n + extra,), device=DEVICE) for n in lengths]
    weights = DecodeWeights(model)
    # the attention ring as long as in the timings and in Generator, so that they reuse this compile
    cache = InferenceCache(model, 1, max_length=model.config.block_size)
    eager = decode_run(model, seqs, lengths, extra, weights, cache=cache)
    compiled = compiled_block_step()
    if DEVICE.type == "cuda":
        step = CapturedDecodeStep(model, cache, block_step=compiled, weights=weights)
    else:
        step = lambda tok: decode_step(model, tok, cache, weights, compiled)  # noqa: E731
    got = decode_run(model, seqs, lengths, extra, step=step, cache=cache)
    full = model(seqs[0][None])[0]
    vs_eager = max(rel_err(g, e) for g, e in zip(got, eager))
    vs_full = max(rel_err(got[j][0], full[lengths[0] - 1 + j]) for j in range(extra + 1))
    eager_vs_full = max(rel_err(eager[j][0], full[lengths[0] - 1 + j]) for j in range(extra + 1))
    return {"compiled_vs_eager_fused_rel_err": vs_eager, "compiled_vs_full_forward_rel_err": vs_full,
            "eager_fused_vs_full_forward_rel_err": eager_vs_full,
            "ok": vs_full < 2 * eager_vs_full + 1e-2}


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


@torch.no_grad()
def decode_attention_kernel(model: GPT, batches: tuple[int, ...]) -> dict:
    """The attention layers' decode op alone, on the model's shapes with a full ring: the Triton kernel
    (rotation, slot write and attention in one pass) against the torch path it replaced (RoPE, two
    index_copy_ and SDPA), time per call and the largest difference of their outputs."""
    from gdn2.ops import ring_decode_attention_reference
    from gdn2.ops.decode_attention.ring import ring_decode_attention_triton

    c = model.config
    dtype = next(model.parameters()).dtype
    cap = min(c.sliding_window or c.block_size, c.block_size)
    H, Hkv, D = c.n_head, c.n_query_groups, c.head_size
    result = {}
    for B in batches:
        g = torch.Generator(device=DEVICE).manual_seed(B)
        qkv = torch.randn(B, (H + 2 * Hkv) * D, device=DEVICE, dtype=dtype, generator=g)
        kc = torch.randn(B, cap, Hkv, D, device=DEVICE, dtype=dtype, generator=g)
        vc = torch.randn(B, cap, Hkv, D, device=DEVICE, dtype=dtype, generator=g)
        column = torch.tensor(5 * cap + 17, device=DEVICE)
        slot = (column % cap).reshape(1)
        # slot s holds the newest column that maps to it; rows start at different columns
        positions = column - (slot - torch.arange(cap, device=DEVICE)) % cap
        offsets = torch.arange(B, device=DEVICE) * 7 + 4 * cap
        visible = positions[None, :] >= offsets[:, None]
        ang = (column - offsets).float()[:, None] / 10000 ** (torch.arange(0, D, 2, device=DEVICE) / D)[None, :]
        ang = torch.cat([ang, ang], dim=-1)
        args = (qkv, ang.cos(), ang.sin())
        row = {}
        outs = {}
        for name, fn in (("triton", ring_decode_attention_triton), ("torch", ring_decode_attention_reference)):
            state = (kc.clone(), vc.clone(), positions.clone())
            call = lambda: fn(*args, *state, slot, column, visible, H)  # noqa: E731
            outs[name] = call()
            for _ in range(3):
                call()
            row[f"{name}_us"] = round(statistics.median(timed(lambda: [call() for _ in range(20)]) / 20
                                                        for _ in range(5)) * 1e6, 2)
        row["max_abs_diff"] = float((outs["triton"].float() - outs["torch"].float()).abs().max())
        row["ring_bytes_per_s_triton"] = round(2 * B * cap * Hkv * D * kc.element_size() / (row["triton_us"] * 1e-6))
        result[f"b{B}"] = row
    return result


def prompts(batch: int, length: int, vocab: int, ragged: bool) -> list[torch.Tensor]:
    """``batch`` prompts of ``length`` tokens, or of lengths spread over [length/2, length]."""
    lengths = [length - (i * length // (2 * batch) if ragged else 0) for i in range(batch)]
    return [torch.randint(0, vocab, (n,), device=DEVICE) for n in lengths]


def timed(fn: Callable[[], None]) -> float:
    """Seconds one call of ``fn`` takes on the device."""
    if DEVICE.type == "cuda":
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        return a.elapsed_time(b) / 1e3
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


@torch.no_grad()
def time_prefill(model: GPT, batch: int, length: int, cache: InferenceCache) -> dict:
    ps = prompts(batch, length, model.config.vocab_size, ragged=False)
    times = []
    for i in range(6):
        cache.reset()
        t = timed(lambda: prefill(model, ps, cache))
        if i >= 2:
            times.append(t)
    t = statistics.median(times)
    return {"batch": batch, "prompt_tokens": length, "ms": round(t * 1e3, 3),
            "tokens_per_s": round(batch * length / t, 1)}


@torch.no_grad()
def time_decode(model: GPT, cache: InferenceCache, variant: str, fused: bool, steps: int,
                weights: Optional[DecodeWeights], prompt_len: int = 128) -> dict:
    B = cache.batch_size
    weights = weights if fused else None
    block_step = compiled_block_step() if variant == "graph+compile" else None
    if variant == "eager":
        step = lambda tok: decode_step(model, tok, cache, weights)  # noqa: E731
    elif DEVICE.type == "cuda":
        step = CapturedDecodeStep(model, cache, block_step=block_step, weights=weights)
    else:  # the CPU smoke run: compiled, without a graph
        step = lambda tok: decode_step(model, tok, cache, weights, block_step)  # noqa: E731
    cache.reset()
    logits = prefill(model, prompts(B, prompt_len, model.config.vocab_size, ragged=True), cache)
    tok = logits.argmax(-1)
    for _ in range(8):
        tok = step(tok).argmax(-1)
    times = []

    def run() -> None:
        nonlocal tok
        for _ in range(steps):
            tok = step(tok).argmax(-1)

    for _ in range(3):
        times.append(timed(run) / steps)
    t = statistics.median(times)
    return {"batch": B, "variant": variant, "fused": fused, "ms_per_token": round(t * 1e3, 4),
            "tokens_per_s": round(B / t, 1), "all_ms_per_token": [round(x * 1e3, 4) for x in times]}


@torch.no_grad()
def profile_kernels(model: GPT, cache: InferenceCache, weights: DecodeWeights, steps: int, prompt_len: int) -> dict:
    """Device kernels per decode step at batch ``cache.batch_size`` (torch.profiler over ``steps``
    replays), per variant: how many, the summed kernel time, and the kernels that take the most.
    The count checks the one predicted from the code; the greedy argmax adds one kernel per step."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    on_cuda = DEVICE.type == "cuda"
    B = cache.batch_size
    result = {}
    for variant, fused in (("graph+compile", True), ("graph+compile", False), ("graph", True), ("graph", False)):
        name = f"{variant}_{'fused' if fused else 'unfused'}"
        try:
            block_step = compiled_block_step() if variant == "graph+compile" else None
            w = weights if fused else None
            if on_cuda:
                step = CapturedDecodeStep(model, cache, block_step=block_step, weights=w)
            else:
                step = lambda tok: decode_step(model, tok, cache, w, block_step)  # noqa: E731
            cache.reset()
            tok = prefill(model, prompts(B, prompt_len, model.config.vocab_size, ragged=True), cache).argmax(-1)
            for _ in range(3):
                tok = step(tok).argmax(-1)
            sync()
            activity = ProfilerActivity.CUDA if on_cuda else ProfilerActivity.CPU
            with profile(activities=[activity]) as prof:
                for _ in range(steps):
                    tok = step(tok).argmax(-1)
                sync()
            kind = DeviceType.CUDA if on_cuda else DeviceType.CPU
            per_name: dict = {}
            for e in prof.events():
                if e.device_type != kind or (not on_cuda and e.cpu_parent is not None):
                    continue
                n, t = per_name.get(e.name, (0, 0.0))
                per_name[e.name] = (n + 1, t + e.time_range.elapsed_us())
            count = sum(n for n, _ in per_name.values())
            total = sum(t for _, t in per_name.values())
            top = sorted(per_name.items(), key=lambda kv: -kv[1][1])[:12]
            result[name] = {"kernels_per_step": round(count / steps, 1), "kernel_us_per_step": round(total / steps, 1),
                            "top": [{"kernel": k[:90], "per_step": round(n / steps, 2), "us_per_step": round(t / steps, 1)}
                                    for k, (n, t) in top]}
        except Exception as e:  # noqa: BLE001 - one variant failing must not lose the others
            result[name] = {"error": f"{type(e).__name__}: {e}"}
            traceback.print_exc()
    return result


@torch.no_grad()
def end_to_end(model: GPT, new_tokens: int, prompt_len: int = 128) -> dict:
    gen = Generator(model, None, max_batch_size=1)  # defaults: fused, compiled and captured on CUDA
    prompt = prompts(1, prompt_len, model.config.vocab_size, ragged=False)[0].tolist()
    gen.generate([prompt], max_new_tokens=4)  # capture the graph
    cache = gen._cache_rows(1)
    walls = []
    for _ in range(3):
        cache.reset()
        sync()
        t0 = time.perf_counter()
        prefill(model, [torch.tensor(prompt, device=DEVICE)], cache)
        sync()
        t1 = time.perf_counter()
        out = gen.generate([prompt], max_new_tokens=new_tokens)
        t2 = time.perf_counter()
        assert len(out[0].tokens) == new_tokens
        walls.append(((t2 - t1) - (t1 - t0)) / (new_tokens - 1))
    return {"batch": 1, "new_tokens": new_tokens, "fused": gen.fused, "compiled": gen.compile,
            "decode_ms_per_token": round(statistics.median(walls) * 1e3, 4)}


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
    global BUDGET, DEVICE
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="swa_gdn2_1.3B")
    parser.add_argument("--steps", type=int, default=100, help="decode steps per timing (CUDA graph variants)")
    parser.add_argument("--eager-steps", type=int, default=20, help="decode steps per timing (eager variants)")
    parser.add_argument("--budget", type=float, default=160.0,
                        help="skip every stage that would end after this many seconds")
    parser.add_argument("--smoke", action="store_true",
                        help="run on the CPU in fp32 with swa_gdn2_tiny and small sizes (checks the script)")
    args = parser.parse_args()
    BUDGET = args.budget
    big_batch, prefill_sizes, prompt_len = 64, ((1, 1024), (64, 512)), 128
    if args.smoke:
        DEVICE = torch.device("cpu")
        args.config = "swa_gdn2_tiny"
        args.steps = args.eager_steps = min(args.steps, 3)
        big_batch, prefill_sizes, prompt_len = 4, ((1, 64), (4, 32)), 16
    elif not torch.cuda.is_available():
        print("bench/generate.py needs a CUDA GPU (or --smoke)", file=sys.stderr)
        return 2
    RESULTS["env"] = {"device": torch.cuda.get_device_name() if DEVICE.type == "cuda" else "cpu (smoke)",
                      "torch": torch.__version__, "triton": __import__("triton").__version__,
                      "config": args.config, "dtype": "float32" if args.smoke else "bfloat16"}
    try:
        model = build_model(args.config, args.smoke)
    except Exception as e:  # noqa: BLE001
        RESULTS["errors"]["build"] = f"{type(e).__name__}: {e}"
        save()
        raise
    RESULTS["env"]["parameters"] = model.num_parameters()
    weights = DecodeWeights(model)
    RESULTS["env"]["fused_weight_copies_bytes"] = weights.nbytes()
    stage("correctness", 25, check_correctness, model)
    stage("correctness_compiled_b1", 20, check_compiled, model)
    bandwidth = (stage("copy_bandwidth_bytes_per_s", 3, copy_bandwidth) if DEVICE.type == "cuda" else None) or 4.3e12
    if DEVICE.type == "cuda":  # (the kernel runs on the CPU only under TRITON_INTERPRET=1)
        stage("decode_attention_kernel", 5, decode_attention_kernel, model, (1, big_batch))

    big = InferenceCache(model, big_batch, max_length=model.config.block_size)
    for batch, length in prefill_sizes:
        stage(f"prefill_b{batch}", 10, time_prefill, model, batch, length, big.rows(batch))

    # the most telling first, since the budget cuts from the end; a batch size not compiled yet costs a compile
    B = big_batch
    plan = [(1, "graph+compile", True, 3), (1, "graph", True, 3), (1, "graph", False, 3),
            (1, "graph+compile", False, 15), (B, "graph", True, 3), (B, "graph", False, 3),
            (1, "eager", True, 3), (1, "eager", False, 3), "profile", (B, "graph+compile", True, 15), "end_to_end",
            (B, "eager", True, 4), (B, "eager", False, 4), (B, "graph+compile", False, 15)]
    for item in plan:
        if item == "end_to_end":
            stage("generate_end_to_end_b1", 8, end_to_end, model, 16 if args.smoke else 128, prompt_len)
            continue
        if item == "profile":
            stage("kernels_b1", 12, profile_kernels, model, big.rows(1), weights, 3 if args.smoke else 10, prompt_len)
            continue
        batch, variant, fused, expected = item
        if DEVICE.type != "cuda" and variant == "graph":
            continue
        steps = args.eager_steps if variant == "eager" else args.steps
        name = f"decode_b{batch}_{variant}_{'fused' if fused else 'unfused'}"
        r = stage(name, expected, time_decode, model, big.rows(batch), variant, fused, steps, weights, prompt_len)
        if r is not None:
            r["floor_ms_per_token"] = round(floor_ms(model, batch, bandwidth), 4)
        save()

    from torch._dynamo.utils import counters

    RESULTS["env"]["dynamo_unique_graphs"] = counters["stats"]["unique_graphs"]  # no silent recompiles
    print()
    print(f"{args.config} {RESULTS['env']['dtype']} on {RESULTS['env']['device']}, copy bandwidth "
          f"{bandwidth / 1e12:.2f} TB/s, fused weight copies {weights.nbytes() / 2**30:.2f} GiB")
    for name in ("correctness", "correctness_compiled_b1"):
        r = RESULTS["stages"].get(name)
        if r:
            print(f"{name}: ok={r['ok']} " + ", ".join(f"{k}={v}" for k, v in r.items() if k.endswith("err")))
    print(f"{'what':<34}{'batch':>6}{'ms':>12}{'tokens/s':>14}{'floor ms':>10}{'unfused/fused':>15}")
    stages = RESULTS["stages"]
    for name, r in stages.items():
        if isinstance(r, dict) and "tokens_per_s" in r:
            ms = r.get("ms_per_token", r.get("ms"))
            ratio = ""
            if r.get("fused"):
                other = stages.get(name.replace("_fused", "_unfused"))
                if isinstance(other, dict):
                    ratio = f"{other['ms_per_token'] / ms:.2f}x"
            print(f"{name:<34}{r['batch']:>6}{ms:>12.4f}{r['tokens_per_s']:>14.1f}"
                  f"{r.get('floor_ms_per_token', math.nan):>10.4f}{ratio:>15}")
    kernels = stages.get("kernels_b1")
    if kernels:
        print("kernels per decode step at batch 1 (torch.profiler; the greedy argmax adds one):")
        for name, r in kernels.items():
            if not isinstance(r, dict):
                continue
            if "error" in r:
                print(f"  {name:<24} error: {r['error'][:120]}")
                continue
            print(f"  {name:<24}{r['kernels_per_step']:>8} kernels {r['kernel_us_per_step']:>10} us of kernel time")
        best = kernels.get("graph+compile_fused", {})
        for t in best.get("top", [])[:12]:
            print(f"    {t['us_per_step']:>8} us  x{t['per_step']:<6} {t['kernel'][:70]}")
    e2e = stages.get("generate_end_to_end_b1")
    if e2e:
        how = f"{'fused' if e2e['fused'] else 'unfused'}{', compiled' if e2e['compiled'] else ''}"
        print(f"{'generate() end to end (' + how + ')':<34}{1:>6}{e2e['decode_ms_per_token']:>12.4f}")
    if RESULTS["skipped"]:
        print("skipped:", ", ".join(RESULTS["skipped"]))
    if RESULTS["errors"]:
        print("errors:", json.dumps(RESULTS["errors"], indent=1))
    print(f"total {time.time() - START:.0f} s; wrote {out_path()}")
    save()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
