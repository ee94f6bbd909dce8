"""Triton recurrent GDN-2 (decode / short prefill) against the float64 token recurrence.

CPU: TRITON_INTERPRET=1, fp32 and fp16, small heads; CUDA adds bf16 at K = V = 128. The kernel keeps
the state in fp32 and computes every token in fp32, so fp32 inputs land near 1e-7 and the accuracy
policy's 1e-4 bound applies; for 16-bit inputs only the output rounding remains (o is stored in the input
dtype: bf16 5e-3, fp16 1e-3).
"""

import pytest
import torch

from gdn2.ops import chunk_gdn2, fused_recurrent_gdn2, recurrent_gdn2_reference
from gdn2.ops.gdn2.recurrent import fused_recurrent_gdn2_triton
from gdn2.ops.testing import gdn2_inputs, rel_err

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
TOL = {torch.float32: 1e-4, torch.float16: 1e-3, torch.bfloat16: 5e-3}


def _case(B, T, H, HV, K, V, dtype, cu, with_h0, harsh, gb_heads, seed):
    q, k, v, g, b, w = gdn2_inputs(B, T, H, K, V, dtype=dtype, device=DEVICE, HV=HV, harsh=harsh, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    if gb_heads == "HV" and HV != H:
        # per-value-head gates: perturb the repeated key-head gates so each value head differs
        g = (g.repeat_interleave(HV // H, 2) * (0.5 + torch.rand(B, T, HV, K, generator=gen).to(DEVICE)))
        b = torch.rand(B, T, HV, K, generator=gen).to(device=DEVICE, dtype=dtype)
    N = len(cu) - 1 if cu else B
    h0 = torch.randn(N, HV, K, V, generator=gen).to(DEVICE) if with_h0 else None
    cu_t = torch.tensor(cu, dtype=torch.int32, device=DEVICE) if cu else None
    return [q, k, v, g, b, w], h0, cu_t


# B, T, H, HV, K, V, cu_seqlens, with_h0, harsh, g/b heads, l2 (the kernel has no chunks: short prefills
# cover every path)
CASES = [
    (3, 1, 2, 4, 16, 32, None, True, False, "H", False),      # decode step, grouped value heads
    (2, 1, 1, 2, 32, 16, None, True, True, "HV", True),       # decode, per-value-head gates, L2 norm
    (1, 13, 2, 2, 16, 16, None, False, False, "H", False),    # prefill without an initial state
    (2, 9, 1, 1, 16, 16, None, True, True, "H", False),
    (1, 20, 1, 2, 16, 16, None, True, False, "HV", True),
    (1, 30, 2, 4, 16, 16, [0, 5, 6, 30], True, True, "H", False),  # packed sequences, one of length 1
]


def _id(c):
    return f"B{c[0]}T{c[1]}H{c[2]}HV{c[3]}K{c[4]}V{c[5]}" + ("-varlen" if c[6] else "") + \
        ("-h0" if c[7] else "") + ("-harsh" if c[8] else "") + f"-gb{c[9]}" + ("-l2" if c[10] else "")


PARAMS = ([pytest.param(c, torch.float32, id=_id(c) + "-fp32") for c in CASES]
          + [pytest.param(c, torch.float16, id=_id(c) + "-fp16") for c in CASES[:4]]
          + [pytest.param(c, torch.bfloat16, id=_id(c) + "-bf16", marks=pytest.mark.gpu) for c in CASES])


@pytest.mark.parametrize("case,dtype", PARAMS)
def test_recurrent_matches_oracle(case, dtype):
    B, T, H, HV, K, V, cu, with_h0, harsh, gb, l2 = case
    if dtype == torch.bfloat16:
        K = V = 128
    ins, h0, cu_t = _case(B, T, H, HV, K, V, dtype, cu, with_h0, harsh, gb, seed=T + HV)
    with torch.no_grad():
        o, s = fused_recurrent_gdn2_triton(*ins, K ** -0.5, h0, True, l2, cu_t, False)
    ro, rs = recurrent_gdn2_reference(*(t.double() for t in ins), None,
                                      None if h0 is None else h0.double(), True, l2, cu_t)
    assert o.dtype == ins[0].dtype and s.dtype == torch.float32
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    assert rel_err(o, ro) <= TOL[dtype], rel_err(o, ro)
    assert rel_err(s, rs) <= max(TOL[dtype], 1e-4), rel_err(s, rs)


def test_inplace_final_state_updates_the_cache():
    ins, h0, _ = _case(2, 1, 1, 2, 16, 16, torch.float32, None, True, False, "H", seed=1)
    cache = h0.clone()
    with torch.no_grad():
        o, s = fused_recurrent_gdn2_triton(*ins, 0.25, cache, False, False, None, True)
        ro, rs = fused_recurrent_gdn2_triton(*ins, 0.25, h0, True, False, None, False)
    assert s is cache
    assert rel_err(cache, rs) < 1e-7 and rel_err(o, ro) < 1e-7
    assert rel_err(h0, rs) > 1e-3  # the original state was really replaced


def test_prefill_then_decode_equals_one_pass():
    """Chunked prefill of 20 tokens, then three recurrent decode steps carrying the state in place."""
    ins, h0, _ = _case(1, 23, 1, 1, 16, 16, torch.float32, None, True, False, "H", seed=5)
    with torch.no_grad():
        o_pre, state = chunk_gdn2(*(t[:, :20] for t in ins), initial_state=h0, output_final_state=True,
                                  backend="triton")
        outs = [o_pre]
        for t in range(20, 23):
            o_t, state = fused_recurrent_gdn2(*(x[:, t:t + 1] for x in ins), initial_state=state,
                                              inplace_final_state=True, backend="triton")
            outs.append(o_t)
    ro, rs = recurrent_gdn2_reference(*(t.double() for t in ins), None, h0.double(), True)
    assert rel_err(torch.cat(outs, 1), ro) < 1e-4
    assert rel_err(state, rs) < 1e-4


def test_gradients_route_to_the_chunked_kernels():
    """With autograd on, the recurrent entry point is served by the differentiable chunked path."""
    ins, h0, _ = _case(1, 40, 1, 1, 16, 16, torch.float32, None, True, False, "H", seed=3)
    leaves = [t.clone().requires_grad_() for t in ins]
    o, s = fused_recurrent_gdn2_triton(*leaves, 0.25, h0, True, False, None, False)
    do = torch.randn_like(o)
    grads = torch.autograd.grad((o * do).sum() + s.sum(), leaves)
    rl = [t.double().requires_grad_() for t in ins]
    ro, rs = recurrent_gdn2_reference(*rl, 0.25, h0.double(), True)
    rg = torch.autograd.grad((ro * do.double()).sum() + rs.sum(), rl)
    assert rel_err(o, ro) < 1e-4
    for a, r in zip(grads, rg):
        assert a.shape == r.shape and rel_err(a, r) < 1e-4


def test_inplace_with_gradients_is_refused():
    ins, h0, _ = _case(1, 4, 1, 1, 16, 16, torch.float32, None, True, False, "H", seed=3)
    leaves = [t.clone().requires_grad_() for t in ins]
    with pytest.raises(ValueError, match="inplace_final_state"):
        fused_recurrent_gdn2_triton(*leaves, 0.25, h0, False, False, None, True)
