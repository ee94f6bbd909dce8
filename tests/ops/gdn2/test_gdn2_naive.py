"""The GDN-2 torch oracles: chunked WY form == token recurrence (float64, gradients included), a hand-
computed step, gradcheck, harsh gates in float32."""

import pytest
import torch

from gdn2.ops import chunk_gdn2_reference, recurrent_gdn2_reference
from gdn2.ops.testing import gdn2_inputs, rel_err


def _loss_and_grads(fn, ins, h0, **kw):
    o, s = fn(*ins, initial_state=h0, output_final_state=True, **kw)
    gen = torch.Generator().manual_seed(123)
    do = torch.randn(o.shape, generator=gen, dtype=o.dtype)
    ds = torch.randn(s.shape, generator=gen, dtype=s.dtype)
    wrt = list(ins) + ([h0] if h0 is not None else [])
    grads = torch.autograd.grad((o * do).sum() + (s * ds).sum(), wrt)
    return o, s, grads


@pytest.mark.parametrize("T,cu,with_h0,harsh,HV", [
    (100, None, True, False, None),
    (63, None, False, True, None),
    (130, [0, 15, 100, 130], True, False, None),
    (64, None, True, True, 4),
])
def test_chunk_form_equals_recurrence_float64(T, cu, with_h0, harsh, HV):
    B = 1 if cu else 2
    H = 2
    ins = gdn2_inputs(B, T, H, 16, 8, torch.float64, HV=HV, harsh=harsh, seed=T, requires_grad=True)
    N = len(cu) - 1 if cu else B
    h0 = torch.randn(N, HV or H, 16, 8, dtype=torch.float64, requires_grad=True) if with_h0 else None
    cu_t = torch.tensor(cu, dtype=torch.int32) if cu else None
    kw = dict(cu_seqlens=cu_t, use_qk_l2norm_in_kernel=True)
    o1, s1, g1 = _loss_and_grads(recurrent_gdn2_reference, ins, h0, **kw)
    o2, s2, g2 = _loss_and_grads(chunk_gdn2_reference, ins, h0, **kw)
    assert rel_err(o2, o1) < 1e-10
    assert rel_err(s2, s1) < 1e-10
    for a, b in zip(g2, g1):
        assert rel_err(a, b) < 1e-10


def test_varlen_equals_separate_sequences():
    ins = gdn2_inputs(1, 50, 2, 8, 8, torch.float64, seed=3)
    cu = torch.tensor([0, 20, 50])
    o, s = chunk_gdn2_reference(*ins, cu_seqlens=cu, output_final_state=True)
    for n, (a, b) in enumerate([(0, 20), (20, 50)]):
        o_n, s_n = recurrent_gdn2_reference(*[t[:, a:b] for t in ins], output_final_state=True)
        assert rel_err(o[:, a:b], o_n) < 1e-12
        assert rel_err(s[n], s_n[0]) < 1e-12


def test_recurrence_matches_hand_computed_step():
    # one token from a known state: S' = (S * e^g), u = w*v - S'^T(b*k), S'' = S' + k u^T, o = scale S''^T q
    q, k, v, g, b, w = gdn2_inputs(1, 1, 1, 4, 3, torch.float64, seed=5)
    S = torch.randn(1, 1, 4, 3, dtype=torch.float64)
    o, s = recurrent_gdn2_reference(q, k, v, g, b, w, scale=0.7, initial_state=S, output_final_state=True)
    Sd = S[0, 0] * g[0, 0, 0].exp()[:, None]
    u = w[0, 0, 0] * v[0, 0, 0] - Sd.T @ (b[0, 0, 0] * k[0, 0, 0])
    S2 = Sd + torch.outer(k[0, 0, 0], u)
    assert torch.allclose(s[0, 0], S2)
    assert torch.allclose(o[0, 0, 0], 0.7 * S2.T @ q[0, 0, 0])


def test_gradcheck_small():
    ins = gdn2_inputs(1, 5, 1, 3, 2, torch.float64, seed=7, requires_grad=True)
    h0 = torch.randn(1, 1, 3, 2, dtype=torch.float64, requires_grad=True)

    def f(*args):
        o, s = chunk_gdn2_reference(*args[:6], initial_state=args[6], output_final_state=True, chunk_size=2,
                                    use_qk_l2norm_in_kernel=True)
        return o, s

    assert torch.autograd.gradcheck(f, (*ins, h0))


def test_harsh_gates_stay_finite_in_float32():
    ins = gdn2_inputs(1, 128, 2, 16, 16, torch.float32, harsh=True, seed=11)
    ref = recurrent_gdn2_reference(*[t.double() for t in ins], output_final_state=True)
    o, s = chunk_gdn2_reference(*ins, output_final_state=True)
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    assert rel_err(o, ref[0]) < 1e-4 and rel_err(s, ref[1]) < 1e-4
