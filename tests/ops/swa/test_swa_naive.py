"""The sliding-window attention oracles: the explicit-mask oracle against a loop over every query, and
the SDPA-based CPU path against the oracle."""

import pytest
import torch

from gdn2.ops import sliding_window_attention_reference
from gdn2.ops.swa.naive import sliding_window_attention_torch


@pytest.mark.parametrize("window,hkv,cu", [(1, 2, None), (5, 1, None), (None, 2, None), (1000, 2, None),
                                           (4, 2, [0, 7, 20])])
def test_oracle_matches_explicit_loop_and_the_torch_path_matches_it(window, hkv, cu):
    B, T, H, D = 1, 20, 4, 8
    q = torch.randn(B, T, H, D, dtype=torch.float64)
    k, v = (torch.randn(B, T, hkv, D, dtype=torch.float64) for _ in range(2))
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
    assert torch.equal(sliding_window_attention_torch(q, k, v, window, cu_seqlens=cu_t), o)  # float64: the oracle


def test_cache_positions_and_empty_slots():
    """Decoding against a cache: absolute positions per row, a key position < 0 marks an empty slot, and
    a query that sees no key gets zeros."""
    q = torch.randn(2, 1, 2, 8, dtype=torch.float64)
    k, v = (torch.randn(2, 4, 1, 8, dtype=torch.float64) for _ in range(2))
    kpos = torch.tensor([[5, 6, 7, -1], [-1, -1, -1, -1]])
    qpos = torch.tensor([[7], [7]])
    o = sliding_window_attention_reference(q, k, v, 2, q_positions=qpos, k_positions=kpos)
    want = sliding_window_attention_reference(q[:1], k[:1, 1:3], v[:1, 1:3], None,
                                              q_positions=torch.tensor([1]), k_positions=torch.tensor([0, 1]))
    assert torch.allclose(o[:1], want) and torch.equal(o[1], torch.zeros_like(o[1]))
