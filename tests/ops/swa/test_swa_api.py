"""The sliding-window attention entry point: bad input is refused with a ValueError naming the argument,
and each backend gives the oracle's attention (scale and packed documents passed through)."""

import pytest
import torch

import gdn2.ops.swa.attention as attention_mod
from gdn2.ops import sliding_window_attention, sliding_window_attention_reference
from gdn2.ops.testing import rel_err


def _bad_cases():
    q, kv = torch.zeros(1, 4, 2, 8), torch.zeros(1, 4, 1, 8)
    yield "q must have rank 4 \\[B, T, H, D\\], got shape \\(4, 2, 8\\)", dict(q=q[0])
    yield "k must be a tensor, got ndarray", dict(k=kv.numpy())
    yield "k and v must have the same shape", dict(v=kv[..., :4])
    yield "k must be \\[B=1, T=4, Hkv, D=8\\]", dict(k=kv[:, :2], v=kv[:, :2])
    yield "q heads \\(2\\) must be a multiple of k/v heads \\(3\\)", dict(k=torch.zeros(1, 4, 3, 8),
                                                                            v=torch.zeros(1, 4, 3, 8))
    yield "window must be a positive int", dict(window=0)
    yield "window must be a positive int .* got True", dict(window=True)
    yield "q must be a floating tensor, got torch.int64", dict(q=q.long())
    yield "q, k and v must share a dtype", dict(k=kv.half(), v=kv.half())
    yield "q must not be empty", dict(k=kv[..., :0], v=kv[..., :0], q=q[..., :0])
    yield "scale must be a finite number or None, got '1'", dict(scale="1")
    yield "cu_seqlens must be a 1-D integer tensor", dict(cu_seqlens=torch.tensor([0.0, 4.0]))
    yield "q is torch.float64, which the Triton kernels do not take", dict(q=q.double(), k=kv.double(),
                                                                          v=kv.double())
    yield "cu_seqlens requires batch size 1", dict(q=q.expand(2, -1, -1, -1), k=kv.expand(2, -1, -1, -1),
                                                   v=kv.expand(2, -1, -1, -1), cu_seqlens=torch.tensor([0, 4]))
    yield "cu_seqlens must be strictly increasing", dict(cu_seqlens=torch.tensor([0, 2, 2, 4]))


BAD = list(_bad_cases())


@pytest.mark.parametrize("msg,override", BAD, ids=[m for m, _ in BAD])
def test_bad_input_raises_value_error(msg, override, monkeypatch):
    monkeypatch.setattr(attention_mod, "sliding_window_attention_triton", lambda *a: pytest.fail("validate first"))
    kw = dict(q=torch.zeros(1, 4, 2, 8), k=torch.zeros(1, 4, 1, 8), v=torch.zeros(1, 4, 1, 8), window=2)
    kw.update(override)
    with pytest.raises(ValueError, match=msg):
        sliding_window_attention(**kw, backend="triton")


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_backends_match_the_oracle(backend):
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(1, 40, 2, 16, generator=gen)
    k, v = (torch.randn(1, 40, 1, 16, generator=gen) for _ in range(2))
    cu = torch.tensor([0, 17, 40], dtype=torch.int32)
    ours = sliding_window_attention(q, k, v, 6, scale=0.5, cu_seqlens=cu, backend=backend)
    ref = sliding_window_attention_reference(q.double(), k.double(), v.double(), 6, 0.5, cu)
    assert ours.dtype == q.dtype and rel_err(ours, ref) < 1e-5
