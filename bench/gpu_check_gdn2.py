"""GPU accuracy of the GDN-2 kernels, ours and flash-linear-attention's, against float64 oracles.

    PYTHONPATH=. python bench/gpu_check_gdn2.py [--probe] [--quick] [--no-peer] [--fp32]
    PYTHONPATH=/path/to/triton-3.6-site:. python bench/gpu_check_gdn2.py --aot [--pinned] [--fp32]   (no GPU)

--probe  first AOT-compiles every autotuning config of our kernels for this GPU, each in its own
         process (a compiler crash cannot take the run down), prints registers / spills, and writes
         the failing ones to $OUT/skip_configs.txt in GDN2_SKIP_CONFIGS format.
Accuracy: bf16 inputs, K = V = 128, loss sum(o*do) + sum(S_T*dS_T); ground truth is the float64 token
recurrence on the GPU, or for T = 4096 the float64 chunked oracle (equal to it, and affordable).
Metric ||x - ref|| / ||ref||. Prints a table and writes $OUT/gpu_check_gdn2.json (./bench_out without
$OUT).
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import sys
import time
import traceback

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from gdn2.ops import chunk_gdn2, chunk_gdn2_reference, fused_recurrent_gdn2, recurrent_gdn2_reference  # noqa: E402
from gdn2.ops.gdn2.utils import EXACT_SPAN  # noqa: E402
from gdn2.ops.testing import rel_err  # noqa: E402

OUT = os.environ.get("OUT") or os.path.join(ROOT, "bench_out")
DEV = "cuda"
NAMES = ("o", "state", "dq", "dk", "dv", "dg", "db", "dw", "dh0")
BF16_TOL = dict(o=5e-3, state=5e-3, dq=1e-2, dk=1e-2, dv=1e-2, dh0=1e-2, dg=2e-2, db=2e-2, dw=2e-2)
FP32_TOL = {n: 1e-4 for n in NAMES}
HEAD_DIM = 128  # K = V


# --------------------------------------------------------------------------------------------------
# inputs (generated on the GPU, same recipe as gdn2.ops.testing)
# --------------------------------------------------------------------------------------------------

def gpu_inputs(B, T, H, K, V, dtype=torch.bfloat16, harsh=False, seed=0, normalize=True):
    gen = torch.Generator(device=DEV).manual_seed(seed)

    def randn(*s):
        return torch.randn(*s, device=DEV, generator=gen)

    def rand(*s):
        return torch.rand(*s, device=DEV, generator=gen)

    q, k = randn(B, T, H, K), randn(B, T, H, K)
    if normalize:
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
    v = randn(B, T, H, V)
    A = 1 + 15 * rand(H)
    dt = torch.exp(rand(H, K) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3)).clamp_min(1e-4)
    dt_bias = dt + torch.log(-torch.expm1(-dt))
    g = -A[:, None] * F.softplus(randn(B, T, H, K) * 0.5 + dt_bias)
    if harsh:
        g = torch.where(rand(B, T, H, K) < 0.1, -20.0 * rand(B, T, H, K) - 10.0, g)
    b, w = rand(B, T, H, K), rand(B, T, H, V)
    return [q.to(dtype), k.to(dtype), v.to(dtype), g.float(), b.to(dtype), w.to(dtype)]


# --------------------------------------------------------------------------------------------------
# one accuracy case
# --------------------------------------------------------------------------------------------------

def _grads(fn, ins, h0, do, dht, **kw):
    leaves = [t.detach().clone().requires_grad_() for t in ins]
    h = h0.detach().clone().requires_grad_() if h0 is not None else None
    o, s = fn(*leaves, initial_state=h, output_final_state=True, **kw)
    wrt = leaves + ([h] if h is not None else [])
    grads = torch.autograd.grad((o.double() * do.double()).sum() + (s.double() * dht.double()).sum(), wrt)
    out = dict(o=o.detach(), state=s.detach())
    out.update(zip(("dq", "dk", "dv", "dg", "db", "dw", "dh0"), [g.detach() for g in grads]))
    return out


def oracle(ins, h0, do, dht, cu, l2):
    T = ins[0].shape[1]
    ref_fn = chunk_gdn2_reference if T > 512 else recurrent_gdn2_reference

    def fn(*a, initial_state, output_final_state):
        return ref_fn(*a, None, initial_state, output_final_state, l2, cu)

    return _grads(fn, [t.double() for t in ins], None if h0 is None else h0.double(), do, dht)


def ours(ins, h0, do, dht, cu, l2):
    return _grads(chunk_gdn2, ins, h0, do, dht, cu_seqlens=cu, use_qk_l2norm_in_kernel=l2, backend="triton")


def ours_inference(ins, h0, do, dht, cu, l2):
    """o and the final state without autograd (the forward that keeps nothing for a backward)."""
    with torch.inference_mode():
        o, s = chunk_gdn2(*ins, initial_state=h0, output_final_state=True, cu_seqlens=cu,
                          use_qk_l2norm_in_kernel=l2, backend="triton")
    return dict(o=o, state=s)


def peer_chunk():
    try:
        from fla.ops.gdn2 import chunk_gdn2 as fla_chunk
    except Exception as e:  # noqa: BLE001
        print(f"peer unavailable: {type(e).__name__}: {e}")
        return None

    def run(ins, h0, do, dht, cu, l2):
        return _grads(fla_chunk, ins, h0, do, dht, cu_seqlens=None if cu is None else cu.long(),
                      use_qk_l2norm_in_kernel=l2)
    return run


def compare(got, ref):
    """Relative errors; where the reference is exactly zero (e.g. dg and db at T = 1 without an
    initial state: the decay and the erase act on a zero state) the absolute norm, flagged '_abs'."""
    errs = {}
    for n in NAMES:
        if n in ref and n in got:
            x = got[n]
            if not torch.isfinite(x).all():
                errs[n] = float("nan")
            elif float(ref[n].double().norm()) == 0.0:
                errs[n] = float(x.double().norm())
                errs[n + "_abs"] = True
            else:
                errs[n] = rel_err(x, ref[n])
    return errs


def within(errs, tol):
    # an absolute error against a zero reference passes at bf16-rounding level of unit-scale tensors
    return "error" not in errs and all(
        errs.get(n, 0) <= (1e-4 if errs.get(n + "_abs") else tol[n]) for n in NAMES)


def accuracy_cases(quick: bool):
    """(label, B, T, H, harsh, with_h0, cu, l2). --quick keeps H = 16 and fixed-length batches first
    (every kernel variant costs a compile on the first call: H = 1 and varlen are variants of their
    own), then one varlen case, which the time budget may skip."""
    if quick:
        return [("T1 H16 realistic", 2, 1, 16, False, False, None, False),
                ("T1 H16 harsh h0", 2, 1, 16, True, True, None, False),
                ("T63 H16 realistic", 2, 63, 16, False, False, None, False),
                ("T63 H16 harsh h0", 2, 63, 16, True, True, None, False),
                ("T100 H16 harsh h0", 2, 100, 16, True, True, None, False),
                ("T100 H16 l2norm h0", 2, 100, 16, False, True, None, True),
                ("T4096 H16 realistic h0", 1, 4096, 16, False, True, None, False),
                # past 64 chunks the backward's state scan starts windows inside sequences
                ("T8200 H16 realistic h0", 1, 8200, 16, False, True, None, False),
                ("varlen H16 harsh h0", 1, 256, 16, True, True, [0, 15, 100, 256], False),
                ("varlen long H16 realistic h0", 1, 8200, 16, False, True, [0, 5000, 8200], False)]
    cases = []
    for T in (1, 63, 64, 100):
        for H in (1, 16):
            cases.append((f"T{T} H{H} realistic", 2, T, H, False, False, None, False))
            cases.append((f"T{T} H{H} harsh h0", 2, T, H, True, True, None, False))
        cases.append((f"T{T} H16 realistic h0", 2, T, 16, False, True, None, False))
    for H in (1, 16):
        cases.append((f"varlen H{H} realistic", 1, 256, H, False, False, [0, 15, 100, 256], False))
        cases.append((f"varlen H{H} harsh h0", 1, 256, H, True, True, [0, 15, 100, 256], False))
    cases.append(("T100 H16 l2norm h0", 2, 100, 16, False, True, None, True))
    cases.append(("T4096 H16 realistic h0", 1, 4096, 16, False, True, None, False))
    cases.append(("T8200 H16 realistic h0", 1, 8200, 16, False, True, None, False))
    cases.append(("varlen long H16 realistic h0", 1, 8200, 16, False, True, [0, 5000, 8200], False))
    cases.append(("T4096 H1 harsh", 1, 4096, 1, True, False, None, False))
    return cases


def _case_tensors(i, B, T, H, harsh, with_h0, cu, l2, dtype=torch.bfloat16):
    K = V = HEAD_DIM
    ins = gpu_inputs(B, T, H, K, V, dtype=dtype, harsh=harsh, seed=100 + i, normalize=not l2)
    gen = torch.Generator(device=DEV).manual_seed(7 + i)
    N = len(cu) - 1 if cu else B
    h0 = torch.randn(N, H, K, V, device=DEV, generator=gen) if with_h0 else None
    do = torch.randn(B, T, H, V, device=DEV, generator=gen).to(dtype)
    dht = torch.randn(N, H, K, V, device=DEV, generator=gen)
    cu_t = torch.tensor(cu, dtype=torch.int32, device=DEV) if cu else None
    return ins, h0, do, dht, cu_t


def _run(fn, args, tol, label, impl, dtype):
    try:
        errs = compare(fn(*args[:-1]), args[-1])
    except Exception as e:  # noqa: BLE001
        traceback.print_exc()
        errs = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
    row = dict(case=label, impl=impl, dtype=dtype, ok=within(errs, tol), **errs)
    print(_fmt(row), flush=True)
    return row


def _warm_one(family):
    """Run one tiny call of an accuracy family so that its kernel variants land in Triton's on-disk
    cache (same dtypes, heads, varlen flag and value-block class as the cases)."""
    t = time.time()
    dtype = torch.float32 if family.endswith("fp32") else torch.bfloat16
    if family.startswith("recurrent"):
        ins = gpu_inputs(64, 1, 16, HEAD_DIM, HEAD_DIM, seed=0)
        with torch.no_grad():
            fused_recurrent_gdn2(*ins, initial_state=torch.zeros(64, 16, HEAD_DIM, HEAD_DIM, device=DEV),
                                 output_final_state=True, backend="triton")
        ins = gpu_inputs(2, 20, 16, HEAD_DIM, HEAD_DIM, seed=0)
        with torch.no_grad():
            fused_recurrent_gdn2(*ins, initial_state=torch.zeros(2, 16, HEAD_DIM, HEAD_DIM, device=DEV),
                                 output_final_state=True, backend="triton")
        args = (0, 2, 40, 16, False, True, None, True)
    elif family.startswith("varlen"):
        args = (0, 1, 256, 16, False, True, [0, 15, 100, 256], False)
    else:
        args = (0, 2, 64, 16, False, True, None, False)
    ins, h0, do, dht, cu_t = _case_tensors(*args, dtype=dtype)
    ours(ins, h0, do, dht, cu_t, args[-1])
    torch.cuda.synchronize()
    return family, round(time.time() - t, 1)


def warm_cache(fp32=False):
    """Compile the kernel variants of the accuracy cases in parallel processes (one per family): a
    first call compiles every kernel it meets one after the other, and compiling dominates a short
    GPU run."""
    families = ["fixed", "varlen", "recurrent+l2norm"] + (["fixed-fp32", "varlen-fp32"] if fp32 else [])
    t = time.time()
    ctx = mp.get_context("spawn")
    with ctx.Pool(len(families)) as pool:
        for res in pool.imap_unordered(_warm_one, families):
            print(f"warm {res[0]}: {res[1]} s", flush=True)
    print(f"kernel cache warm in {time.time() - t:.1f} s", flush=True)


def run_accuracy(quick=False, with_peer=True, fp32=False, budget_s=None):
    """Ours on every case first, then the peer on the same inputs (its first-call autotuning is
    slow, and must not starve our rows). Cases that would start more than ``budget_s`` seconds after
    the kernel cache is warm are listed as skipped."""
    rows = []
    cases = accuracy_cases(quick)
    refs = []
    try:
        warm_cache(fp32)
    except Exception:  # noqa: BLE001  (the cases compile what they need themselves)
        traceback.print_exc()
    t_start = time.time()
    for i, (label, B, T, H, harsh, with_h0, cu, l2) in enumerate(cases):
        t0 = time.time()
        if budget_s is not None and t0 - t_start > budget_s:
            print(f"{label:26s} ours  skipped (time budget)", flush=True)
            rows.append(dict(case=label, impl="ours", dtype="bf16", ok=False, skipped=True))
            cases = cases[:i]
            break
        ins, h0, do, dht, cu_t = _case_tensors(i, B, T, H, harsh, with_h0, cu, l2)
        ref = oracle(ins, h0, do, dht, cu_t, l2)
        rows.append(_run(ours, (ins, h0, do, dht, cu_t, l2, ref), BF16_TOL, label, "ours", "bf16"))
        rows.append(_run(ours_inference, (ins, h0, do, dht, cu_t, l2, ref), BF16_TOL, label, "ours inference",
                         "bf16"))
        print(f"   ({time.time() - t0:.1f}s)", flush=True)
        refs.append({n: t.cpu() for n, t in ref.items()})
        del ref
        torch.cuda.empty_cache()
    if fp32:
        for j, (label, B, T, H, harsh, with_h0, cu) in enumerate([
                ("fp32 T100 H16 harsh h0", 2, 100, 16, True, True, None),
                ("fp32 varlen H16", 1, 256, 16, False, True, [0, 15, 100, 256])]):
            ins, h0, do, dht, cu_t = _case_tensors(50 + j, B, T, H, harsh, with_h0, cu, False, torch.float32)
            ref = oracle(ins, h0, do, dht, cu_t, False)
            rows.append(_run(ours, (ins, h0, do, dht, cu_t, False, ref), FP32_TOL, label, "ours", "fp32"))
    rows += decode_accuracy(with_peer=False)
    peer = peer_chunk() if with_peer else None
    if peer is not None:
        for i, (label, B, T, H, harsh, with_h0, cu, l2) in enumerate(cases):
            ins, h0, do, dht, cu_t = _case_tensors(i, B, T, H, harsh, with_h0, cu, l2)
            ref = {n: t.to(DEV) for n, t in refs[i].items()}
            rows.append(_run(peer, (ins, h0, do, dht, cu_t, l2, ref), BF16_TOL, label, "fla", "bf16"))
        rows += decode_accuracy(with_peer=True, ours_too=False)
    return rows


def decode_accuracy(with_peer, ours_too=True):
    """One decode step (T = 1) and a 20-token prefill through the recurrent entry points."""
    rows = []
    peer = None
    if with_peer:
        try:
            from fla.ops.gdn2 import fused_recurrent_gdn2 as peer
        except Exception:  # noqa: BLE001
            peer = None
    K = V = HEAD_DIM
    for label, B, T, H in [("decode B64 H16", 64, 1, 16), ("recurrent T20 B2 H16", 2, 20, 16)]:
        ins = gpu_inputs(B, T, H, K, V, seed=B + T)
        h0 = torch.randn(B, H, K, V, device=DEV)
        ro, rs = recurrent_gdn2_reference(*(t.double() for t in ins), None, h0.double(), True)
        impls = [("ours", lambda: fused_recurrent_gdn2(*ins, initial_state=h0.clone(), output_final_state=True,
                                                      backend="triton"))] if ours_too else []
        if peer is not None:
            impls.append(("fla", lambda: peer(*ins, initial_state=h0.clone(), output_final_state=True)))
        for name, fn in impls:
            with torch.no_grad():
                try:
                    o, s = fn()
                    errs = dict(o=rel_err(o, ro), state=rel_err(s, rs))
                except Exception as e:  # noqa: BLE001
                    traceback.print_exc()
                    errs = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
            ok = "error" not in errs and errs["o"] <= 5e-3 and errs["state"] <= 5e-3
            rows.append(dict(case=label, impl=name, dtype="bf16", ok=ok, **errs))
            print(_fmt(rows[-1]), flush=True)
    return rows


def _fmt(r):
    if r.get("skipped"):
        return f"{r['case']:26s} {r['impl']:5s} skipped (time budget)"
    if "error" in r:
        return f"{r['case']:26s} {r['impl']:5s} ERROR {r['error']}"
    vals = " ".join(f"{n}={r[n]:.1e}" + ("(abs)" if r.get(n + "_abs") else "") for n in NAMES if n in r)
    return f"{r['case']:26s} {r['impl']:5s} {'ok ' if r['ok'] else 'BAD'} {vals}"


def table(rows):
    head = f"| case | impl | {' | '.join(NAMES)} | within spec |"
    lines = [head, "|" + "---|" * (len(NAMES) + 3)]
    for r in rows:
        if r.get("skipped"):
            lines.append(f"| {r['case']} | {r['impl']} | skipped (time budget) |")
            continue
        if "error" in r:
            lines.append(f"| {r['case']} | {r['impl']} | error: {r['error']} |")
            continue
        vals = " | ".join((f"{r[n]:.1e}" + (" abs" if r.get(n + "_abs") else "")) if n in r else "" for n in NAMES)
        lines.append(f"| {r['case']} | {r['impl']} | {vals} | {'yes' if r['ok'] else 'NO'} |")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------
# compile probe (on the GPU) and ahead-of-time compile check (no GPU: sm_90 through Triton's ptxas)
# --------------------------------------------------------------------------------------------------

def _kernels():
    from gdn2.ops.gdn2 import chunk_bwd as B_, chunk_fwd as F_
    return {"gdn2_intra_kernel": F_.gdn2_intra_kernel,
            "gdn2_fwd_scan_kernel": F_.gdn2_fwd_scan_kernel, "gdn2_state_scan_kernel": F_.gdn2_state_scan_kernel,
            "gdn2_prep_kernel": F_.gdn2_prep_kernel,
            "gdn2_bwd_scan_kernel": B_.gdn2_bwd_scan_kernel, "gdn2_bwd_wy_kernel": B_.gdn2_bwd_wy_kernel,
            "gdn2_bwd_intra_kernel": B_.gdn2_bwd_intra_kernel, "gdn2_bwd_qkbg_kernel": B_.gdn2_bwd_qkbg_kernel}


def _ptxas_usage(ptx: str):
    """(registers, spill bytes) per thread from Triton's bundled ptxas -v on this PTX."""
    import re
    import subprocess
    import tempfile

    import triton
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    arch = re.search(r"\.target (sm_\w+)", ptx).group(1)
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    try:
        out = subprocess.run([ptxas, f"-arch={arch}", "-v", f.name, "-o", os.devnull], capture_output=True,
                             text=True)
    finally:
        os.unlink(f.name)
    text = out.stdout + out.stderr
    regs = re.search(r"Used (\d+) registers", text)
    spill = re.search(r"(\d+) bytes spill stores", text)
    return (int(regs.group(1)) if regs else None), (int(spill.group(1)) if spill else None)


def _probe_one(job):
    """Compile one (kernel, config, variant) in a fresh process; returns a result dict.

    job = (kernel name, config index, dtype, variant flags, aot): with aot the target is sm_90 (no
    GPU needed) and registers / spills come from ptxas -v; otherwise the current GPU is the target."""
    kname, idx, dtype, flags, aot = job
    flags = dict(flags)
    try:
        os.environ.pop("TRITON_INTERPRET", None)
        import triton
        from triton.compiler import ASTSource

        tuned = _kernels()[kname]
        cfg = tuned.configs[idx]
        fn = tuned.fn
        dt = {"bf16": "bf16", "fp32": "fp32"}[dtype]
        fp32_ptrs = {"g", "gcl", "h0", "ht", "hseg", "dht", "dh0", "dg", "dq", "dk", "dqi", "dbki", "dki"}
        ints = {"T", "NT", "NC", "SIZE"}
        consts = dict(H=16, K=128, V=128, KP=128, VP=128, BT=64, BC=16, SEG=64, SPAN=EXACT_SPAN, IS_VARLEN=False,
                      SAVE_R=True, DOT_PREC="ieee" if dtype == "fp32" else "tf32")
        consts.update(flags)
        consts.update(cfg.kwargs)
        consts = {k: v for k, v in consts.items() if k in fn.arg_names}
        sig = {}
        for a in fn.arg_names:
            if a in consts:
                sig[a] = "constexpr"
            elif a in ints:
                sig[a] = "i32"
            elif a == "scale":
                sig[a] = "fp32"
            elif a in ("cu", "chunk_info", "chunk_off", "steep"):
                sig[a] = "*i32"
            else:
                sig[a] = "*fp32" if a in fp32_ptrs else "*" + dt
        # pointer arguments 16-byte aligned, as the launcher specialises them for torch's allocations:
        # without it the axis analysis cannot vectorise the loads and the pipeliner leaves them synchronous,
        # so registers and spills would be those of a different program
        aligned = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(fn.arg_names) if sig[a].startswith("*")}
        src = ASTSource(fn, sig, constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()}, attrs=aligned)
        t = time.time()
        if aot:
            from triton.backends.compiler import GPUTarget
            target = GPUTarget("cuda", 90, 32)
        else:
            target = triton.runtime.driver.active.get_current_target()
        opts = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        if cfg.maxnreg is not None:
            opts["maxnreg"] = cfg.maxnreg
        k = triton.compile(src, target=target, options=opts)
        if aot:
            regs, spills = _ptxas_usage(k.asm["ptx"])
        else:
            k._init_handles()
            regs, spills = k.n_regs, k.n_spills
        variant = ",".join(f"{a}={b}" for a, b in flags.items())
        return dict(kernel=kname, index=idx, dtype=dtype, variant=variant, ok=True, regs=regs, spills=spills,
                    shared=k.metadata.shared, seconds=round(time.time() - t, 1), config=str(cfg))
    except Exception as e:  # noqa: BLE001
        return dict(kernel=kname, index=idx, dtype=dtype, ok=False, error=f"{type(e).__name__}: {str(e)[:300]}")


# kernel variants compiled by the probe besides each config: (kernel, flags)
_VARIANTS = [("gdn2_intra_kernel", dict(EXACT=False)), ("gdn2_intra_kernel", dict(EXACT=True)),
             ("gdn2_fwd_scan_kernel", dict(SAVE_R=True)), ("gdn2_fwd_scan_kernel", dict(SAVE_R=False)),
             ("gdn2_state_scan_kernel", {}), ("gdn2_prep_kernel", dict(WITH_U=1)), ("gdn2_prep_kernel", dict(WITH_U=0)),
             ("gdn2_bwd_scan_kernel", {}), ("gdn2_bwd_wy_kernel", {}), ("gdn2_bwd_intra_kernel", dict(EXACT=False, SIDE=0)),
             ("gdn2_bwd_intra_kernel", dict(EXACT=False, SIDE=1)), ("gdn2_bwd_intra_kernel", dict(EXACT=True, SIDE=0)),
             ("gdn2_bwd_intra_kernel", dict(EXACT=True, SIDE=1)),
             ("gdn2_bwd_qkbg_kernel", {})]


def probe(dtypes=("bf16",), aot=False, pinned_only=False):
    """Compile every config (or only the pinned first one) of every kernel variant, one process each."""
    kernels = _kernels()
    jobs = []
    for kname, flags in _VARIANTS:
        n = 1 if pinned_only else len(kernels[kname].configs)
        for i in range(n):
            for dt in dtypes:
                jobs.append((kname, i, dt, flags, aot))
    results = []
    ctx = mp.get_context("spawn")
    with ctx.Pool(min(len(jobs), max(1, (os.cpu_count() or 2) - (0 if aot else 2))), maxtasksperchild=1) as pool:
        pending = {job: pool.apply_async(_probe_one, (job,)) for job in [(a, b, c, tuple(d.items()), e)
                                                                           for a, b, c, d, e in jobs]}
        for job, res in pending.items():
            try:
                r = res.get(timeout=600)
            except Exception as e:  # noqa: BLE001  (a crashed worker or a hang)
                r = dict(kernel=job[0], index=job[1], dtype=job[2], ok=False, error=f"{type(e).__name__}: {e}")
            results.append(r)
            if r["ok"]:
                print(f"probe {r['kernel']:22s} #{r['index']} {r['dtype']} {r['variant']:17s} {r['config']:52s} "
                      f"regs={r['regs']} spills={r['spills']} smem={r['shared']} {r['seconds']}s", flush=True)
            else:
                print(f"probe {r['kernel']:22s} #{r['index']} {r['dtype']} FAILED {r['error']}", flush=True)
    bad = sorted({f"{r['kernel']}:{r['index']}" for r in results if not r["ok"]})
    return results, bad


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--probe", action="store_true")
    ap.add_argument("--aot", action="store_true",
                    help="no GPU: compile every kernel config for sm_90 and print ptxas registers / spills")
    ap.add_argument("--pinned", action="store_true", help="with --probe / --aot: only the pinned configs")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-peer", action="store_true")
    ap.add_argument("--fp32", action="store_true")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="start no new case of ours this many seconds after the kernel cache is warm "
                         "(default: 40 with --quick)")
    args = ap.parse_args()
    os.makedirs(OUT, exist_ok=True)
    import triton
    if args.aot:
        results, bad = probe(("bf16", "fp32") if args.fp32 else ("bf16",), aot=True, pinned_only=args.pinned)
        print("failed:", ",".join(bad) or "none")
        with open(os.path.join(OUT, "aot_gdn2.json"), "w") as f:
            json.dump(dict(triton=triton.__version__, target="sm_90", results=results), f, indent=1)
        return
    res = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__)
    res["triton"] = triton.__version__
    if args.probe:
        results, bad = probe(("bf16", "fp32") if args.fp32 else ("bf16",), pinned_only=args.pinned)
        res["probe"] = results
        with open(os.path.join(OUT, "skip_configs.txt"), "w") as f:
            f.write(",".join(bad))
        print("configs to skip:", ",".join(bad) or "none", flush=True)
    else:
        budget = args.budget_s if args.budget_s is not None else (40.0 if args.quick else None)
        rows = run_accuracy(args.quick, not args.no_peer, args.fp32, budget)
        res["accuracy"] = rows
        print("\n## Accuracy vs float64 oracle (bf16 unless marked; K = V = 128)\n")
        print(table(rows))
    name = "gpu_probe_gdn2.json" if args.probe else "gpu_check_gdn2.json"
    with open(os.path.join(OUT, name), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
