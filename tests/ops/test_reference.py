"""The torch oracles: chunked WY form == token recurrence (float64), gradients, SWA oracle."""

import pytest
import torch

from gdn2.ops import chunk_gdn2, fused_recurrent_gdn2, sliding_window_attention
from gdn2.ops.reference import (chunk_gdn2_reference, recurrent_gdn2_reference,
                                sliding_window_attention_reference, sliding_window_attention_torch)
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


def test_public_api_torch_backend_and_inplace_state():
    ins = gdn2_inputs(2, 6, 2, 8, 8, torch.float32, seed=2)
    h0 = torch.randn(2, 2, 8, 8)
    o1, s1 = chunk_gdn2(*ins, initial_state=h0, output_final_state=True, backend="torch")
    h = h0.clone()
    o2, s2 = fused_recurrent_gdn2(*ins, initial_state=h, inplace_final_state=True, backend="torch")
    assert s2 is h
    assert rel_err(o2, o1) < 1e-5 and rel_err(h, s1) < 1e-5


@pytest.mark.parametrize("bad, match", [
    (dict(q=torch.zeros(1, 4, 2)), "q must have rank 4"),
    (dict(k=torch.zeros(1, 4, 2, 9)), "k must have q's shape"),
    (dict(v=torch.zeros(1, 4, 3, 8), w=torch.zeros(1, 4, 3, 8)), "not a multiple"),
    (dict(initial_state=torch.zeros(1, 2, 8, 8, dtype=torch.bfloat16)), "initial_state must be float32"),
    (dict(cu_seqlens=torch.tensor([0, 3, 2, 4])), "strictly increasing"),
    (dict(q=torch.zeros(1, 4, 2, 512), k=torch.zeros(1, 4, 2, 512), g=torch.zeros(1, 4, 2, 512),
          b=torch.zeros(1, 4, 2, 512)), "exceeds the supported maximum"),
])
def test_bad_input_names_argument(bad, match):
    q, k, v, g, b, w = (torch.zeros(1, 4, 2, 8) for _ in range(6))
    args = dict(q=q, k=k, v=v, g=g, b=b, w=w, initial_state=None, cu_seqlens=None)
    args.update(bad)
    with pytest.raises(ValueError, match=match):
        chunk_gdn2(**args, backend="torch")


def test_cu_seqlens_needs_batch_one():
    ins = gdn2_inputs(2, 4, 1, 8, 8)
    with pytest.raises(ValueError, match="batch size 1"):
        chunk_gdn2(*ins, cu_seqlens=torch.tensor([0, 4]), backend="torch")


@pytest.mark.parametrize("window,hkv,cu", [(1, 2, None), (5, 1, None), (None, 2, None), (1000, 2, None),
                                           (4, 2, [0, 7, 20])])
def test_swa_oracle_matches_explicit_loop(window, hkv, cu):
    B, T, H, D = 1, 20, 4, 8
    q, k, v = torch.randn(B, T, H, D, dtype=torch.float64), *(torch.randn(B, T, hkv, D, dtype=torch.float64) for _ in range(2))
    cu_t = torch.tensor(cu) if cu else None
    o = sliding_window_attention_reference(q, k, v, window, cu_seqlens=cu_t)
    doc = [0] * T if cu is None else [sum(i >= c for c in cu[1:-1]) for i in range(T)]
    expect = torch.zeros_like(o)
    for i in range(T):
        js = [j for j in range(i + 1) if (window is None or i - j < window) and doc[j] == doc[i]]
        for h in range(H):
            kh = h // (H // hkv)
            s = torch.stack([q[0, i, h] @ k[0, j, kh] for j in js]) * D ** -0.5
            p = s.softmax(0)
            expect[0, i, h] = sum(pj * v[0, j, kh] for pj, j in zip(p, js))
    assert torch.allclose(o, expect, atol=1e-12)
    o2 = sliding_window_attention_torch(q.float(), k.float(), v.float(), window, cu_seqlens=cu_t)
    assert torch.allclose(o2.double(), expect, atol=1e-5)
    o3 = sliding_window_attention(q.float(), k.float(), v.float(), window, cu_seqlens=cu_t, backend="torch")
    assert torch.allclose(o3.double(), expect, atol=1e-5)


def test_swa_bad_input():
    q = torch.zeros(1, 4, 3, 8)
    kv = torch.zeros(1, 4, 2, 8)
    with pytest.raises(ValueError, match="multiple"):
        sliding_window_attention(q, kv, kv, 2, backend="torch")
    with pytest.raises(ValueError, match="window"):
        sliding_window_attention(q, q, q, 0, backend="torch")
