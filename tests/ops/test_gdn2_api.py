"""The public GDN-2 API: bad input is refused with a ValueError naming the argument, on every backend,
and GDN2_BACKEND=triton really routes both entry points to the Triton kernels."""

import pytest
import torch

import gdn2.ops.chunk as chunk_mod
import gdn2.ops.recurrent as recurrent_mod
from gdn2.ops import chunk_gdn2, fused_recurrent_gdn2
from gdn2.ops.reference import recurrent_gdn2_reference
from gdn2.ops.testing import gdn2_inputs, rel_err

OPS = [chunk_gdn2, fused_recurrent_gdn2]
BACKENDS = ["triton", "torch"]


def _ins(B=1, T=8, H=2, K=16, V=16, HV=None, dtype=torch.float32):
    return gdn2_inputs(B, T, H, K, V, dtype=dtype, HV=HV, seed=0)


def _bad_cases():
    q, k, v, g, b, w = _ins()
    yield "q", "rank 4", dict(q=q[0])
    yield "k", "k must have q's shape", dict(k=k[..., :8])
    yield "v", "not a multiple", dict(v=torch.randn(1, 8, 3, 16), w=torch.randn(1, 8, 3, 16))
    yield "w", "w must have v's shape", dict(w=w[..., :8])
    yield "g", "g must be", dict(g=g[..., :8])
    yield "b", "b must be", dict(b=torch.rand(1, 8, 3, 16))
    yield "v", "batch/length", dict(v=v[:, :4], w=w[:, :4])
    yield "b", "floating", dict(b=(b > 0.5))
    big = _ins(K=272)
    yield "K", "K=272 exceeds", dict(zip("qkvgbw", big))
    big = _ins(V=264)
    yield "V", "V=264 exceeds", dict(v=big[2], w=big[5])
    yield "initial_state", "float32", dict(initial_state=torch.zeros(1, 2, 16, 16, dtype=torch.bfloat16))
    yield "initial_state", "shape", dict(initial_state=torch.zeros(2, 2, 16, 16))
    two = _ins(B=2)
    yield "cu_seqlens", "batch size 1", dict(zip("qkvgbw", two), cu_seqlens=torch.tensor([0, 4, 8]))
    yield "cu_seqlens", "strictly increasing", dict(cu_seqlens=torch.tensor([0, 4, 4, 8]))
    yield "cu_seqlens", "end at T", dict(cu_seqlens=torch.tensor([0, 4, 6]))
    yield "cu_seqlens", "integer", dict(cu_seqlens=torch.tensor([0.0, 8.0]))
    yield "initial_state", "shape", dict(cu_seqlens=torch.tensor([0, 3, 8]),
                                         initial_state=torch.zeros(1, 2, 16, 16))


BAD = list(_bad_cases())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op", OPS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("arg,msg,override", BAD, ids=[f"{a}-{m}" for a, m, _ in BAD])
def test_bad_input_raises_value_error(op, backend, arg, msg, override):
    kw = dict(zip("qkvgbw", _ins()))
    kw.update(override)
    with pytest.raises(ValueError, match=msg) as info:
        op(**kw, backend=backend)
    assert arg.split("=")[0] in str(info.value)


def test_float64_state_only_on_the_torch_path():
    ins = _ins(dtype=torch.float64)
    h0 = torch.zeros(1, 2, 16, 16, dtype=torch.float64)
    chunk_gdn2(*ins, initial_state=h0, backend="torch")  # the oracle path accepts it
    with pytest.raises(ValueError, match="initial_state must be float32"):
        chunk_gdn2(*_ins(), initial_state=h0, backend="triton")


def test_inplace_needs_an_initial_state():
    with pytest.raises(ValueError, match="inplace_final_state"):
        fused_recurrent_gdn2(*_ins(), inplace_final_state=True, backend="triton")


def test_unknown_backend():
    with pytest.raises(ValueError, match="GDN2_BACKEND"):
        chunk_gdn2(*_ins(), backend="cuda")


def test_environment_routes_to_triton(monkeypatch):
    calls = []

    def spy(name, fn):
        def wrapped(*a, **kw):
            calls.append(name)
            return fn(*a, **kw)
        return wrapped

    monkeypatch.setattr(chunk_mod, "chunk_gdn2_triton", spy("chunk", chunk_mod.chunk_gdn2_triton))
    monkeypatch.setattr(recurrent_mod, "fused_recurrent_gdn2_triton",
                        spy("recurrent", recurrent_mod.fused_recurrent_gdn2_triton))
    monkeypatch.setenv("GDN2_BACKEND", "triton")
    ins = _ins(T=20, HV=4)
    ref, ref_s = recurrent_gdn2_reference(*(t.double() for t in ins), None, None, True)
    o1, s1 = fused_recurrent_gdn2(*ins, output_final_state=True)
    o2, s2 = chunk_gdn2(*ins, output_final_state=True)
    assert calls == ["recurrent", "chunk"]
    for o, s in [(o1, s1), (o2, s2)]:
        assert o.shape == (1, 20, 4, 16) and s.shape == (1, 4, 16, 16)
        assert rel_err(o, ref) < 1e-4 and rel_err(s, ref_s) < 1e-4
