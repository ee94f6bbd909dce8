"""The GDN-2 entry points: bad input is refused with a ValueError naming the argument, before any backend
runs; the backend choice routes both entry points; the torch backend's in-place state update."""

import pytest
import torch

import gdn2.ops.gdn2.chunk as chunk_mod
import gdn2.ops.gdn2.recurrent as recurrent_mod
from gdn2.ops import chunk_gdn2, fused_recurrent_gdn2, recurrent_gdn2_reference
from gdn2.ops.testing import gdn2_inputs, rel_err


def _ins(B=1, T=8, H=2, K=16, V=16, HV=None, dtype=torch.float32):
    return gdn2_inputs(B, T, H, K, V, dtype=dtype, HV=HV, seed=0)


def _bad_cases():
    q, k, v, g, b, w = _ins()
    yield "q", "q must be a tensor, got list", dict(q=q.tolist())
    yield "q", "q must be a tensor", dict(q=q.numpy())
    yield "v", "v is on meta, q on cpu", dict(v=v.to("meta"))
    yield "q", "q must have rank 4", dict(q=q[0])
    yield "b", "b must be a floating tensor", dict(b=(b > 0.5))
    yield "v", "v has batch/length", dict(v=v[:, :4], w=w[:, :4])
    yield "k", "k must have q's shape", dict(k=k[..., :8])
    yield "w", "w must have v's shape", dict(w=w[..., :8])
    yield "v", "v has 3 heads, not a multiple", dict(v=torch.randn(1, 8, 3, 16), w=torch.randn(1, 8, 3, 16))
    yield "g", "g must be", dict(g=g[..., :8])  # key axis
    yield "b", "b must be", dict(b=torch.rand(1, 8, 3, 16))  # neither H nor HV heads
    yield "q", "q must not be empty", dict(zip("qkvgbw", _ins(K=0)))
    yield "scale", "scale must be a finite number", dict(scale="0.5")
    yield "scale", "scale must be a finite number", dict(scale=float("nan"))
    big = _ins(K=272)
    yield "K", "K=272 exceeds", dict(zip("qkvgbw", big))
    big = _ins(V=264)
    yield "V", "V=264 exceeds", dict(v=big[2], w=big[5])
    yield "cu_seqlens", "cu_seqlens must be a 1-D integer tensor", dict(cu_seqlens=torch.tensor([0.0, 8.0]))
    yield "cu_seqlens", "cu_seqlens must be a 1-D integer tensor \\[N\\+1\\], got list", dict(cu_seqlens=[0, 8])
    yield "cu_seqlens", "cu_seqlens requires batch size 1", dict(zip("qkvgbw", _ins(B=2)),
                                                                 cu_seqlens=torch.tensor([0, 4, 8]))
    yield "cu_seqlens", "at least two offsets", dict(cu_seqlens=torch.tensor([0]))
    yield "cu_seqlens", "end at T", dict(cu_seqlens=torch.tensor([0, 4, 6]))
    yield "cu_seqlens", "strictly increasing", dict(cu_seqlens=torch.tensor([0, 4, 4, 8]))
    yield "initial_state", "initial_state must be float32", dict(
        initial_state=torch.zeros(1, 2, 16, 16, dtype=torch.bfloat16))
    yield "initial_state", "initial_state must have shape", dict(initial_state=torch.zeros(2, 2, 16, 16))
    yield "initial_state", "initial_state must be a tensor or None, got list", dict(
        initial_state=torch.zeros(1, 2, 16, 16).tolist())
    # with cu_seqlens the state has one row per sequence
    yield "initial_state", "initial_state must have shape", dict(cu_seqlens=torch.tensor([0, 3, 8]),
                                                                 initial_state=torch.zeros(1, 2, 16, 16))


BAD = list(_bad_cases())


@pytest.mark.parametrize("arg,msg,override", BAD, ids=[f"{a}-{m}" for a, m, _ in BAD])
def test_bad_input_raises_value_error_naming_the_argument(arg, msg, override):
    kw = dict(zip("qkvgbw", _ins()))
    kw.update(override)
    with pytest.raises(ValueError, match=msg) as info:
        chunk_gdn2(**kw, backend="torch")
    assert arg in str(info.value)


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("op", [chunk_gdn2, fused_recurrent_gdn2], ids=lambda f: f.__name__)
def test_both_entry_points_validate_on_every_backend(op, backend, monkeypatch):
    monkeypatch.setattr(chunk_mod, "chunk_gdn2_triton", lambda *a: pytest.fail("validation must come first"))
    monkeypatch.setattr(recurrent_mod, "fused_recurrent_gdn2_triton", lambda *a: pytest.fail("validation first"))
    q, k, v, g, b, w = _ins()
    with pytest.raises(ValueError, match="k must have q's shape"):
        op(q, k[..., :8], v, g, b, w, backend=backend)


def test_float64_only_on_the_torch_path():
    h0 = torch.zeros(1, 2, 16, 16, dtype=torch.float64)
    chunk_gdn2(*_ins(dtype=torch.float64), initial_state=h0, backend="torch")  # the oracle path accepts it
    with pytest.raises(ValueError, match="initial_state must be float32"):
        chunk_gdn2(*_ins(dtype=torch.float64), initial_state=h0, backend="triton")
    with pytest.raises(ValueError, match="q is torch.float64, which the Triton kernels do not take"):
        chunk_gdn2(*_ins(dtype=torch.float64), backend="triton")


def test_inplace_needs_an_initial_state():
    with pytest.raises(ValueError, match="inplace_final_state=True needs an initial_state"):
        fused_recurrent_gdn2(*_ins(), inplace_final_state=True, backend="torch")


def test_backend_setting_routes_both_entry_points_to_triton(ops_settings, monkeypatch):
    calls = []

    def spy(name, fn):
        def wrapped(*a, **kw):
            calls.append(name)
            return fn(*a, **kw)
        return wrapped

    monkeypatch.setattr(chunk_mod, "chunk_gdn2_triton", spy("chunk", chunk_mod.chunk_gdn2_triton))
    monkeypatch.setattr(recurrent_mod, "fused_recurrent_gdn2_triton",
                        spy("recurrent", recurrent_mod.fused_recurrent_gdn2_triton))
    ops_settings(backend="triton")
    ins = _ins(T=20, H=1)
    ref, ref_s = recurrent_gdn2_reference(*(t.double() for t in ins), None, None, True, True)
    o1, s1 = fused_recurrent_gdn2(*ins, output_final_state=True, use_qk_l2norm_in_kernel=True)
    o2, s2 = chunk_gdn2(*ins, output_final_state=True, use_qk_l2norm_in_kernel=True)  # the inference path
    assert calls == ["recurrent", "chunk"]
    for o, s in [(o1, s1), (o2, s2)]:
        assert o.shape == (1, 20, 1, 16) and s.shape == (1, 1, 16, 16)
        assert rel_err(o, ref) < 1e-4 and rel_err(s, ref_s) < 1e-4


def test_torch_backend_recurrent_updates_the_state_in_place():
    ins = gdn2_inputs(2, 6, 2, 8, 8, torch.float32, seed=2)
    h0 = torch.randn(2, 2, 8, 8)
    o1, s1 = chunk_gdn2(*ins, initial_state=h0, output_final_state=True, backend="torch")
    h = h0.clone()
    o2, s2 = fused_recurrent_gdn2(*ins, initial_state=h, inplace_final_state=True, backend="torch")
    assert s2 is h
    assert rel_err(o2, o1) < 1e-5 and rel_err(h, s1) < 1e-5
