"""Triton chunked GDN-2 (forward + backward) against the float64 token recurrence.

On CPU the kernels run under TRITON_INTERPRET=1 with fp32 and fp16 inputs and small heads; on CUDA the
same cases also run in bf16 at K = V = 128. Loss for the gradients: sum(o * do) + sum(S_T * dS_T).

Tolerances (relative Frobenius error, OPERATOR.md section 4): fp32 1e-4 for every quantity; bf16
5e-3 (o, state), 1e-2 (dq, dk, dv, dh0), 2e-2 (dg, db, dw). fp16 has no row in the spec: its unit
roundoff (2^-11) is 8x below bf16's, and the kernels round the matmul operands (and the per-chunk
rebuilt per-chunk states) to it, so errors measure 4e-4 to 9e-4 at these shapes; 3e-3 holds them with margin
while still catching any algebra slip (those give errors of order 1e-1).
"""

import pytest
import torch

import gdn2.ops.chunk as chunk_mod
from gdn2.ops.chunk import chunk_gdn2_triton, chunk_operands, chunk_start_states, gdn2_forward
from gdn2.ops.gdn2_triton_utils import chunk_layout
from gdn2.ops.reference import recurrent_gdn2_reference
from gdn2.ops.testing import gdn2_inputs, rel_err

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
GRADS = ("dq", "dk", "dv", "dg", "db", "dw", "dh0")
TOL = {
    torch.float32: dict(o=1e-4, state=1e-4, dq=1e-4, dk=1e-4, dv=1e-4, dh0=1e-4, dg=1e-4, db=1e-4, dw=1e-4),
    torch.float16: dict(o=3e-3, state=3e-3, dq=3e-3, dk=3e-3, dv=3e-3, dh0=3e-3, dg=3e-3, db=3e-3, dw=3e-3),
    torch.bfloat16: dict(o=5e-3, state=5e-3, dq=1e-2, dk=1e-2, dv=1e-2, dh0=1e-2, dg=2e-2, db=2e-2, dw=2e-2),
}


def make_case(B, T, H, K, V, dtype, harsh, with_h0, cu, seed, HV=None, device=DEVICE):
    ins = gdn2_inputs(B, T, H, K, V, dtype=dtype, device=device, HV=HV, harsh=harsh, seed=seed)
    N = len(cu) - 1 if cu else B
    gen = torch.Generator().manual_seed(seed + 1)
    h0 = torch.randn(N, HV or H, K, V, generator=gen).to(device) if with_h0 else None
    do = torch.randn(B, T, HV or H, V, generator=gen).to(device=device, dtype=dtype)
    dht = torch.randn(N, HV or H, K, V, generator=gen).to(device)
    cu_t = torch.tensor(cu, dtype=torch.int32, device=device) if cu else None
    return ins, h0, do, dht, cu_t


def oracle(ins, h0, do, dht, cu, l2, scale=None):
    """o, final state and the seven gradients of the float64 token recurrence."""
    leaves = [t.detach().double().requires_grad_() for t in ins]
    h = h0.detach().double().requires_grad_() if h0 is not None else None
    o, s = recurrent_gdn2_reference(*leaves, scale, h, True, l2, cu)
    wrt = leaves + ([h] if h is not None else [])
    grads = torch.autograd.grad((o * do.double()).sum() + (s * dht.double()).sum(), wrt)
    return o, s, dict(zip(GRADS, list(grads) + [None]))


def ours(ins, h0, do, dht, cu, l2, scale=None, output_final_state=True):
    leaves = [t.detach().clone().requires_grad_() for t in ins]
    h = h0.detach().clone().requires_grad_() if h0 is not None else None
    K = ins[0].shape[-1]
    o, s = chunk_gdn2_triton(*leaves, K ** -0.5 if scale is None else scale, h, output_final_state, l2, cu)
    loss = (o.float() * do.float()).sum()
    if output_final_state:
        loss = loss + (s * dht).sum()
    wrt = leaves + ([h] if h is not None else [])
    grads = torch.autograd.grad(loss, wrt)
    return o, s, dict(zip(GRADS, list(grads) + [None]))


def check(got, ref, dtype):
    o, s, g = got
    ro, rs, rg = ref
    tol = TOL[dtype]
    errs = {"o": rel_err(o, ro), "state": rel_err(s, rs)}
    for name in GRADS:
        if rg[name] is not None:
            assert g[name] is not None and g[name].shape == rg[name].shape, name
            errs[name] = rel_err(g[name], rg[name])
    for name, x in [("o", o), ("state", s)] + [(n, g[n]) for n in GRADS if g[n] is not None]:
        assert torch.isfinite(x).all(), f"{name} has NaN/Inf"
    bad = {n: e for n, e in errs.items() if not e <= tol[n]}
    assert not bad, f"errors over tolerance: {bad} (all: {errs})"
    return errs


# B, T, H, K, V, harsh, with_h0, cu_seqlens, l2
CASES = [
    (2, 1, 1, 16, 16, False, True, None, False),
    (1, 63, 2, 16, 16, False, False, None, True),
    (1, 64, 1, 32, 16, True, True, None, False),
    (2, 100, 2, 16, 32, True, True, None, True),
    (1, 130, 2, 16, 16, False, True, [0, 15, 100, 130], True),
    (1, 130, 1, 16, 16, True, False, [0, 15, 100, 130], False),
    (1, 64, 1, 64, 64, True, True, None, False),  # several key and value blocks per program
]
CPU_DTYPES = [torch.float32]
DTYPES = [torch.float32, torch.bfloat16] if CUDA else CPU_DTYPES


def _id(case):
    B, T, H, K, V, harsh, h0, cu, l2 = case
    return (f"B{B}T{T}H{H}K{K}V{V}" + ("-harsh" if harsh else "") + ("-h0" if h0 else "")
            + ("-varlen" if cu else "") + ("-l2" if l2 else ""))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=_id)
def test_chunk_matches_recurrence(case, dtype):
    B, T, H, K, V, harsh, with_h0, cu, l2 = case
    if dtype == torch.bfloat16:
        K = V = 128
    ins, h0, do, dht, cu_t = make_case(B, T, H, K, V, dtype, harsh, with_h0, cu, seed=T + 7 * H)
    check(ours(ins, h0, do, dht, cu_t, l2), oracle(ins, h0, do, dht, cu_t, l2), dtype)


@pytest.mark.parametrize("case", [
    (1, 100, 2, 32, 32, False, True, None, False),
    (1, 130, 1, 16, 16, True, True, [0, 15, 100, 130], True),
], ids=_id)
def test_chunk_matches_recurrence_fp16(case):
    B, T, H, K, V, harsh, with_h0, cu, l2 = case
    ins, h0, do, dht, cu_t = make_case(B, T, H, K, V, torch.float16, harsh, with_h0, cu, seed=5)
    check(ours(ins, h0, do, dht, cu_t, l2), oracle(ins, h0, do, dht, cu_t, l2), torch.float16)


def test_grouped_value_heads_bf16_gate_and_custom_scale():
    """HV = 2H (q, k repeated over value heads), g in bf16 with H heads, b with HV heads, scale 0.3."""
    B, T, H, HV, K, V = 1, 70, 1, 2, 16, 16
    ins, h0, do, dht, cu = make_case(B, T, H, K, V, torch.float32, True, True, None, seed=11, HV=HV)
    ins[3] = ins[3].to(torch.bfloat16)
    gen = torch.Generator().manual_seed(3)
    ins[4] = torch.rand(B, T, HV, K, generator=gen).to(DEVICE)
    got = ours(ins, h0, do, dht, cu, False, scale=0.3)
    ref = oracle(ins, h0, do, dht, cu, False, scale=0.3)
    assert got[2]["dg"].dtype == torch.bfloat16 and got[2]["dg"].shape == ins[3].shape
    assert got[2]["db"].shape == ins[4].shape
    # dg is returned in bf16 (g's dtype): its rounding alone is ~2e-3
    tol = dict(TOL[torch.float32], dg=1e-2)
    errs = {n: rel_err(got[2][n], ref[2][n]) for n in GRADS}
    errs.update(o=rel_err(got[0], ref[0]), state=rel_err(got[1], ref[1]))
    assert all(e <= tol[n] for n, e in errs.items()), errs


def test_extreme_decay_stays_finite():
    """Whole channels at g = -20 per token: a chunk's cumulative log-decay reaches -1280, far past
    fp32 range, so any k / gamma formed over the chunk would overflow."""
    B, T, H, K, V = 1, 128, 1, 16, 16
    ins, h0, do, dht, cu = make_case(B, T, H, K, V, torch.float32, False, True, None, seed=4)
    ins[3][..., : K // 2] = -20.0
    got = ours(ins, h0, do, dht, cu, False)
    check(got, oracle(ins, h0, do, dht, cu, False), torch.float32)


@pytest.mark.parametrize("span", [1, 2, 16])
def test_steep_gates_anchored_and_exact_diagonal_paths(span, monkeypatch):
    """Gates near the fast bound of the anchored diagonal blocks (-4 nats per token: factors up to
    2^46 inside a sub-chunk) in the first key block, next to steep bursts (-12 per token over 8
    tokens in a few channels of the second key block, in the first and the third chunk), which send
    those sub-chunks of that key block alone to the exact column path, redone by the intra kernels'
    second launches; both must match the recurrence. Those launches take ``span`` flagged programs of
    the first launch per program: one each, the third chunk alone in a program whose span runs past
    the last chunk, and all in one."""
    monkeypatch.setattr(chunk_mod, "EXACT_SPAN", span)
    B, T, H, K, V = 1, 192, 1, 64, 16
    ins, h0, do, dht, cu = make_case(B, T, H, K, V, torch.float32, False, True, None, seed=12)
    ins[3][..., : K // 2] = -4.0
    ins[3][:, 20:28, :, K // 2: K // 2 + 3] = -12.0
    ins[3][:, 150:158, :, K // 2 + 5: K // 2 + 7] = -12.0
    got = ours(ins, h0, do, dht, cu, False)
    check(got, oracle(ins, h0, do, dht, cu, False), torch.float32)


def test_without_final_state_and_frozen_initial_state():
    """output_final_state=False returns None and the backward runs without dS_T; an initial state
    that does not require grad gets no gradient."""
    B, T, H, K, V = 1, 80, 1, 16, 16
    ins, h0, do, dht, cu = make_case(B, T, H, K, V, torch.float32, False, True, None, seed=9)
    leaves = [t.clone().requires_grad_() for t in ins]
    o, s = chunk_gdn2_triton(*leaves, K ** -0.5, h0, False, False, None)
    assert s is None
    grads = torch.autograd.grad((o * do).sum(), leaves)
    rl = [t.double().requires_grad_() for t in ins]
    ro, _ = recurrent_gdn2_reference(*rl, None, h0.double(), False, False, None)
    rg = torch.autograd.grad((ro * do.double()).sum(), rl)
    assert rel_err(o, ro) < 1e-4
    for a, r in zip(grads, rg):
        assert rel_err(a, r) < 1e-4


@pytest.mark.parametrize("segment", [1, 64])
@pytest.mark.parametrize("cu", [None, [0, 15, 100, 130]], ids=["fixed", "varlen"])
def test_inference_path_equals_training_path(cu, segment, monkeypatch):
    """Without autograd the forward skips the checkpoints (R and the window-start states); o and the
    state must not change. With 1-chunk windows the training forward's scan runs in pieces."""
    monkeypatch.setattr(chunk_mod, "STATE_SEGMENT", segment)
    B, T = (2, 200) if cu is None else (1, 130)
    ins, h0, do, dht, cu = make_case(B, T, 2, 16, 16, torch.float32, False, True, cu, seed=2)
    with torch.no_grad():
        o1, s1 = chunk_gdn2_triton(*ins, 0.25, h0, True, True, cu)
    leaves = [t.clone().requires_grad_() for t in ins]
    o2, s2 = chunk_gdn2_triton(*leaves, 0.25, h0, True, True, cu)
    assert o2.requires_grad and not o1.requires_grad
    assert rel_err(o1, o2) < 1e-6 and rel_err(s1, s2) < 1e-6


@pytest.mark.parametrize("segment", [1, 2, 3, 64])
@pytest.mark.parametrize("cu", [None, [0, 70, 200]], ids=["fixed", "varlen"])
def test_backward_rebuilds_the_states_at_every_chunk_start(cu, segment, monkeypatch):
    """The backward keeps no per-chunk state checkpoints: it rebuilds the state at every chunk start
    from the saved A and R (prep kernel, then the state scan, in windows of ``segment`` chunks that
    start from the initial state or from a state the forward kept). Each must equal the recurrence's
    state after that many tokens of its sequence. The windows of 2 and 3 chunks start inside sequences,
    and (varlen, 3) a sequence also starts inside a window."""
    monkeypatch.setattr(chunk_mod, "STATE_SEGMENT", segment)
    B, T, H, K, V = (2, 200, 2, 16, 16) if cu is None else (1, 200, 2, 16, 16)
    ins, h0, _, _, cu_t = make_case(B, T, H, K, V, torch.float32, True, True, cu, seed=21)
    q, k, v, g, b, w = (t.reshape(B * T, H, t.shape[-1]).contiguous() for t in ins)
    lay = chunk_layout(B, T, cu_t, q.device)
    _, _, (_, amat, rbuf, hseg) = gdn2_forward(q, k, v, g, b, w, K ** -0.5, h0, False, lay, for_backward=True)
    _, kt, _, _, gcl = chunk_operands(q, k, g, b, v, w, amat, lay, with_u=False)
    hbuf = chunk_start_states(kt, rbuf, gcl, h0, hseg, lay)
    starts = cu if cu is not None else [n * T for n in range(B + 1)]
    c = 0
    for n in range(len(starts) - 1):
        for t0 in range(0, starts[n + 1] - starts[n], 64):
            if t0 == 0:
                want = h0[n]
            else:
                lo = starts[n]
                seq = [x.reshape(B * T, H, -1)[lo:lo + t0].unsqueeze(0) for x in ins]
                _, s = recurrent_gdn2_reference(*(x.double() for x in seq), K ** -0.5, h0[n:n + 1].double(),
                                                True, False, None)
                want = s[0]
            assert rel_err(hbuf[c], want) < 1e-4, (n, t0)
            c += 1
    assert c == lay.NC
