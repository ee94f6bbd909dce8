"""Triton chunked GDN-2 (forward + backward) against the float64 token recurrence.

On CPU the kernels run under TRITON_INTERPRET=1 with fp32 and fp16 inputs and small heads; on CUDA the
accuracy cases also run in bf16 at K = V = 128. Loss for the gradients: sum(o * do) + sum(S_T * dS_T).
The interpreter's cost is per program (chunk x head x key block), so each case covers several paths
at once with one or two heads.

Tolerances (relative Frobenius error, the project's accuracy policy): fp32 1e-4 for every quantity; bf16
5e-3 (o, state), 1e-2 (dq, dk, dv, dh0), 2e-2 (dg, db, dw). fp16 has no row in the policy: its unit
roundoff (2^-11) is 8x below bf16's, and the kernels round the matmul operands (and the rebuilt
per-chunk states) to it, so errors measure 4e-4 to 9e-4 at these shapes; 3e-3 holds them with margin
while still catching any algebra slip (those give errors of order 1e-1).
"""

import dataclasses
from typing import Optional

import pytest
import torch

import gdn2.ops.gdn2.chunk as chunk_mod
from gdn2.ops import recurrent_gdn2_reference
from gdn2.ops.gdn2.chunk import (chunk_gdn2_triton, chunk_operands, chunk_start_states, forward_operands,
                                 forward_scan)
from gdn2.ops.gdn2.utils import chunk_layout
from gdn2.ops.testing import gdn2_inputs, rel_err

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
GRADS = ("dq", "dk", "dv", "dg", "db", "dw", "dh0")
TOL = {
    torch.float32: dict(o=1e-4, state=1e-4, dq=1e-4, dk=1e-4, dv=1e-4, dh0=1e-4, dg=1e-4, db=1e-4, dw=1e-4),
    torch.float16: dict(o=3e-3, state=3e-3, dq=3e-3, dk=3e-3, dv=3e-3, dh0=3e-3, dg=3e-3, db=3e-3, dw=3e-3),
    torch.bfloat16: dict(o=5e-3, state=5e-3, dq=1e-2, dk=1e-2, dv=1e-2, dh0=1e-2, dg=2e-2, db=2e-2, dw=2e-2),
}


@dataclasses.dataclass(frozen=True)
class Case:
    B: int
    T: int
    H: int
    K: int
    V: int
    cu: Optional[tuple] = None  # cu_seqlens
    h0: Optional[str] = "grad"  # initial state: None, "grad" (differentiated) or "frozen"
    final: bool = True  # output_final_state (without it the backward runs without dS_T)
    l2: bool = False  # use_qk_l2norm_in_kernel
    harsh: bool = False  # some channels decay by about exp(-20) per token
    HV: Optional[int] = None  # grouped value heads

    def __str__(self):
        return (f"B{self.B}T{self.T}H{self.H}K{self.K}V{self.V}" + (f"HV{self.HV}" if self.HV else "")
                + ("-varlen" if self.cu else "") + (f"-h0{self.h0}" if self.h0 else "")
                + ("" if self.final else "-nofinal") + ("-l2" if self.l2 else "") + ("-harsh" if self.harsh else ""))


def make_case(c: Case, dtype, seed, device=DEVICE):
    ins = gdn2_inputs(c.B, c.T, c.H, c.K, c.V, dtype=dtype, device=device, HV=c.HV, harsh=c.harsh, seed=seed)
    N = len(c.cu) - 1 if c.cu else c.B
    HV = c.HV or c.H
    gen = torch.Generator().manual_seed(seed + 1)
    h0 = torch.randn(N, HV, c.K, c.V, generator=gen).to(device) if c.h0 else None
    do = torch.randn(c.B, c.T, HV, c.V, generator=gen).to(device=device, dtype=dtype)
    dht = torch.randn(N, HV, c.K, c.V, generator=gen).to(device)
    cu_t = torch.tensor(c.cu, dtype=torch.int32, device=device) if c.cu else None
    return ins, h0, do, dht, cu_t


def _leaves(ins, h0, c: Case):
    leaves = [t.detach().clone().requires_grad_() for t in ins]
    h = None if h0 is None else h0.detach().clone().requires_grad_(c.h0 == "grad")
    return leaves, h, leaves + ([h] if c.h0 == "grad" else [])


def oracle(ins, h0, do, dht, cu, c: Case, scale=None):
    """o, final state and the gradients of the float64 token recurrence."""
    leaves, h, wrt = _leaves([t.double() for t in ins], None if h0 is None else h0.double(), c)
    o, s = recurrent_gdn2_reference(*leaves, scale, h, True, c.l2, cu)
    loss = (o * do.double()).sum() + ((s * dht.double()).sum() if c.final else 0)
    return o, (s if c.final else None), dict(zip(GRADS, torch.autograd.grad(loss, wrt)))


def ours(ins, h0, do, dht, cu, c: Case, scale=None):
    leaves, h, wrt = _leaves(ins, h0, c)
    K = ins[0].shape[-1]
    o, s = chunk_gdn2_triton(*leaves, K ** -0.5 if scale is None else scale, h, c.final, c.l2, cu)
    assert (s is None) == (not c.final)
    loss = (o.float() * do.float()).sum() + ((s * dht).sum() if c.final else 0)
    return o, s, dict(zip(GRADS, torch.autograd.grad(loss, wrt)))


def check(got, ref, dtype, tol=None):
    tol = tol or TOL[dtype]
    errs = {"o": rel_err(got[0], ref[0])}
    if ref[1] is not None:
        errs["state"] = rel_err(got[1], ref[1])
    assert got[2].keys() == ref[2].keys()
    for name, g in got[2].items():
        assert g.shape == ref[2][name].shape, name
        errs[name] = rel_err(g, ref[2][name])
    for name, x in [("o", got[0]), ("state", got[1])] + list(got[2].items()):
        assert x is None or torch.isfinite(x).all(), f"{name} has NaN/Inf"
    bad = {n: e for n, e in errs.items() if not e <= tol[n]}
    assert not bad, f"errors over tolerance: {bad} (all: {errs})"


CASES = [
    # packed sequences of 63 and 65 tokens (a partial chunk; a chunk and a one-token chunk), an initial
    # state per sequence, q and k normalised in the kernel
    Case(1, 128, 1, 16, 16, cu=(0, 63, 128), l2=True),
    # a fixed-length batch, K != V, no initial state, no final state (the fixed-length layout over
    # several chunks per sequence: test_training_forward_and_the_states_the_backward_rebuilds)
    Case(2, 64, 1, 16, 32, h0=None, final=False),
    # harsh gates (most sub-chunks take the exact diagonal path in both directions) and whole channels
    # at g = -20 per token (a cumulative log-decay of -1280 over the chunk, far past fp32 range, so any
    # k / gamma formed over the chunk would overflow); the initial state is frozen (no dh0 computed)
    Case(1, 64, 1, 32, 32, h0="frozen", harsh=True),
]


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.gpu)], ids=str)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_chunk_matches_recurrence(case, dtype):
    if dtype == torch.bfloat16:
        case = dataclasses.replace(case, K=128, V=128)
    ins, h0, do, dht, cu = make_case(case, dtype, seed=case.T + 7 * case.H)
    if case.harsh:
        ins[3][..., :8] = -20.0
    check(ours(ins, h0, do, dht, cu, case), oracle(ins, h0, do, dht, cu, case), dtype)


def test_chunk_matches_recurrence_fp16():
    """16-bit operands in every product (tf32-class precision for 16-bit inputs) over two chunks."""
    case = Case(1, 80, 1, 32, 32, l2=True)
    ins, h0, do, dht, cu = make_case(case, torch.float16, seed=5)
    check(ours(ins, h0, do, dht, cu, case), oracle(ins, h0, do, dht, cu, case), torch.float16)


def test_grouped_value_heads_bf16_gate_and_custom_scale():
    """HV = 2H (q, k repeated over value heads), g in bf16 with H heads, b with HV heads, scale 0.3."""
    case = Case(1, 40, 1, 16, 16, HV=2)
    ins, h0, do, dht, cu = make_case(case, torch.float32, seed=11)
    ins[3] = ins[3].to(torch.bfloat16)
    ins[4] = torch.rand(1, 40, 2, 16, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    got = ours(ins, h0, do, dht, cu, case, scale=0.3)
    assert got[2]["dg"].dtype == torch.bfloat16 and got[2]["dg"].shape == ins[3].shape
    assert got[2]["db"].shape == ins[4].shape
    # dg is returned in bf16 (g's dtype): its rounding alone is ~2e-3
    check(got, oracle(ins, h0, do, dht, cu, case, scale=0.3), torch.float32, dict(TOL[torch.float32], dg=1e-2))


def _saved_bytes_and_results(ins, h0, do, dht, cu, case, recompute):
    """Bytes autograd holds for the operator's backward (every saved tensor, counted once) and its
    o, final state and gradients."""
    leaves, h, wrt = _leaves(ins, h0, case)
    held = {}

    def pack(t):
        held[(t.data_ptr(), t.dtype, tuple(t.shape))] = t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        o, s = chunk_gdn2_triton(*leaves, case.K ** -0.5, h, case.final, case.l2, cu, recompute=recompute)
    loss = (o.float() * do.float()).sum() + ((s * dht).sum() if case.final else 0)
    return sum(held.values()), (o, s, torch.autograd.grad(loss, wrt))


@pytest.mark.slow
@pytest.mark.parametrize("case,segment", [(CASES[0], 1), (Case(1, 70, 1, 16, 16), 64)], ids=["varlen", "fixed"])
def test_recompute_keeps_only_the_inputs_and_gives_the_same_gradients(case, segment, monkeypatch):
    """``recompute=True``: the forward saves nothing beyond its inputs (the default also keeps Aqk and
    A, [TT, H, 64] each, R, [TT, H, V], and the window-start states), and the backward, running the
    forward's kernels again, gives o, the final state and every gradient bit for bit. Windows of one
    chunk (varlen) make the window-start states a real buffer, rebuilt too."""
    monkeypatch.setattr(chunk_mod, "STATE_SEGMENT", segment)
    ins, h0, do, dht, cu = make_case(case, torch.float32, seed=31)
    kept, want = _saved_bytes_and_results(ins, h0, do, dht, cu, case, recompute=False)
    lean, got = _saved_bytes_and_results(ins, h0, do, dht, cu, case, recompute=True)
    inputs = sum(t.numel() * t.element_size() for t in ins) + h0.numel() * h0.element_size()
    assert lean == inputs
    TT, H, V = case.B * case.T, case.H, case.V
    lay = chunk_layout(case.B, case.T, cu, ins[0].device)
    windows = chunk_mod.window_starts_buffer(lay, H, case.K, V, "cpu").numel() * 4
    assert kept - lean == (2 * TT * H * 64 + TT * H * V) * 4 + windows
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    for name, a, b in zip(GRADS, got[2], want[2]):
        assert torch.equal(a, b), name


@pytest.mark.slow
def test_steep_gates_anchored_and_exact_diagonal_paths(monkeypatch):
    """Three chunks, two key blocks. Key block 0 decays at -4 nats per token everywhere, near the fast
    bound of the anchored diagonal blocks (factors up to 2^46 inside a sub-chunk); in key block 1 bursts
    of -12 per token over 8 tokens (chunks 0 and 2) send those sub-chunks of that key block alone to the
    exact column path, redone by the intra kernels' second launches; chunk 1 stays anchored. Those
    launches take EXACT_SPAN = 2 flagged programs of the first launch per program: a flagged chunk next
    to an unflagged one, a program with no flag, and the last chunk alone in a program whose span runs
    past the end (the default span, 16, runs past the end at every other test's sizes)."""
    monkeypatch.setattr(chunk_mod, "EXACT_SPAN", 2)
    case = Case(1, 192, 1, 64, 16)
    ins, h0, do, dht, cu = make_case(case, torch.float32, seed=12)
    ins[3][..., :32] = -4.0
    ins[3][:, 20:28, :, 32:35] = -12.0
    ins[3][:, 150:158, :, 37:39] = -12.0
    got = ours(ins, h0, do, dht, cu, case)
    check(got, oracle(ins, h0, do, dht, cu, case), torch.float32)


@pytest.mark.parametrize("B,T,cu,segments", [(2, 130, None, (1, 2, 64)), (1, 150, (0, 70, 150), (3, 64))],
                         ids=["fixed", "varlen"])
def test_training_forward_and_the_states_the_backward_rebuilds(B, T, cu, segments, monkeypatch):
    """The training forward (which also saves R and the window-start states) gives the inference
    forward's o and final state, and the backward rebuilds the state at every chunk start from the
    saved A and R (prep kernel without U, then the state scan in windows of ``segment`` chunks, each from
    the initial state or a state the forward kept); each must equal the recurrence's state after that
    many tokens of its sequence. Windows of 1 chunk run the forward scan in one-chunk pieces; of 2
    (fixed: 3 chunks a sequence) and 3 (varlen: 2 and 3 chunks), windows start inside sequences and
    sequences start inside windows; of 64 (the default), a fixed-length batch keeps no window-start
    state at all."""
    H, K, V = 1, 16, 16
    case = Case(B, T, H, K, V, cu=cu)
    ins, h0, _, _, cu_t = make_case(case, torch.float32, seed=21)
    q, k, v, g, b, w = (t.reshape(B * T, H, t.shape[-1]).contiguous() for t in ins)
    lay = chunk_layout(B, T, cu_t, q.device)
    scale = K ** -0.5
    aqk, amat, y, kt, qg, u, gcl = forward_operands(q, k, g, b, v, w, scale, lay)
    o_inf, s_inf, _, _ = forward_scan(y, u, kt, qg, aqk, gcl, scale, h0, lay, for_backward=False)
    ro, rs = recurrent_gdn2_reference(*(x.double() for x in ins), scale, h0.double(), True, False, cu_t)
    assert rel_err(o_inf, ro.reshape(B * T, H, V)) < 1e-4 and rel_err(s_inf, rs) < 1e-4
    _, kt_b, _, _, gcl_b = chunk_operands(q, k, g, b, v, w, amat, lay, with_u=False)
    assert torch.equal(kt_b, kt) and torch.equal(gcl_b, gcl)
    starts = list(cu) if cu is not None else [n * T for n in range(B + 1)]
    want = []
    for n in range(len(starts) - 1):
        for t0 in range(0, starts[n + 1] - starts[n], 64):
            seq = [x.reshape(B * T, H, -1)[starts[n]:starts[n] + t0].unsqueeze(0) for x in ins]
            want.append(h0[n] if t0 == 0 else recurrent_gdn2_reference(
                *(x.double() for x in seq), scale, h0[n:n + 1].double(), True, False, None)[1][0])
    assert len(want) == lay.NC
    for segment in segments:
        monkeypatch.setattr(chunk_mod, "STATE_SEGMENT", segment)
        o, s, rbuf, hseg = forward_scan(y, u, kt, qg, aqk, gcl, scale, h0, lay, for_backward=True)
        assert rel_err(o, o_inf) < 1e-6 and rel_err(s, s_inf) < 1e-6, segment
        assert hseg.numel() == (1 if cu is None and segment == 64 else chunk_mod.state_windows(lay) * H * K * V)
        hbuf = chunk_start_states(kt_b, rbuf, gcl_b, h0, hseg, lay)
        for c, state in enumerate(want):
            assert rel_err(hbuf[c], state) < 1e-4, (segment, c)
