"""The row-wise kernels (RoPE over the joint q | k | v projection, SwiGLU over the joint gate | up
projection) against their float64 oracles, gradients included (Triton's interpreter on the CPU, fp32
and fp16; bf16 on the GPU), the oracles against the stages they join, and the contracts."""

import pytest
import torch

from gdn2.layers.attention import rope_tables
from gdn2.ops import rope_qkv, rope_qkv_reference, swiglu_joined, swiglu_joined_reference
from gdn2.ops.pointwise.naive import apply_rope_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def _rope_case(B, T, H, Hkv, D, dtype, extra=0, seed=0):
    """qkv as a slice of a wider tensor when ``extra`` (rows strided, as a view of a larger projection)."""
    gen = torch.Generator().manual_seed(seed)
    C = (H + 2 * Hkv) * D
    wide = torch.randn(B, T, C + extra, generator=gen).to(DEVICE, dtype)
    cos, sin = rope_tables(torch.arange(T, device=DEVICE) + 3, D, 10000.0)
    ups = [torch.randn(B, T, n, D, generator=gen).to(DEVICE) for n in (H, Hkv, Hkv)]
    return wide, cos, sin, ups


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("B,T,H,Hkv,D,extra", [
    (2, 37, 3, 3, 16, 0),  # T not a tile multiple
    (1, 70, 4, 2, 12, 8),  # grouped KV heads, half-head 6 (masked lanes), rows strided
    (2, 5, 2, 1, 128, 0),
])
def test_rope_kernel_matches_the_float64_oracle_with_gradients(B, T, H, Hkv, D, extra, dtype):
    wide, cos, sin, ups = _rope_case(B, T, H, Hkv, D, dtype, extra)
    C = (H + 2 * Hkv) * D
    wide.requires_grad_(True)
    outs = rope_qkv(wide[..., :C], cos, sin, H, Hkv, backend="triton")
    assert [o.shape for o in outs] == [(B, T, H, D), (B, T, Hkv, D), (B, T, Hkv, D)]
    assert all(o.dtype == dtype and o.is_contiguous() for o in outs)
    sum((o.float() * u).sum() for o, u in zip(outs, ups)).backward()
    wide64 = wide.detach().double().requires_grad_(True)
    refs = rope_qkv_reference(wide64[..., :C], cos.double(), sin.double(), H, Hkv)
    sum((r * u.double()).sum() for r, u in zip(refs, ups)).backward()
    tol = TOL[dtype]
    for o, r in zip(outs, refs):
        assert (o.double() - r).abs().max().item() <= tol * max(r.abs().max().item(), 1.0)
    if extra:
        assert wide.grad[..., C:].abs().max() == 0
    torch.testing.assert_close(wide.grad.double(), wide64.grad, rtol=tol, atol=tol * wide64.grad.abs().max().item())


def test_rope_kernel_without_a_gradient_for_v():
    """A piece that gets no gradient (v unused) leaves zeros in its columns of the joint gradient."""
    wide, cos, sin, ups = _rope_case(1, 9, 2, 1, 8, torch.float32)
    wide.requires_grad_(True)
    q, k, _ = rope_qkv(wide, cos, sin, 2, 1, backend="triton")
    ((q * ups[0]).sum() + (k * ups[1]).sum()).backward()
    assert wide.grad[..., 24:].abs().max() == 0 and wide.grad[..., :24].abs().max() > 0


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(2, 7, 2 * 300), (33, 2 * 8), (1, 3, 5, 2 * 256)])
def test_swiglu_kernel_matches_the_float64_oracle_with_gradients(shape, dtype):
    gen = torch.Generator().manual_seed(1)
    gu = (2 * torch.randn(*shape, generator=gen)).to(DEVICE, dtype).requires_grad_(True)
    up = torch.randn(*shape[:-1], shape[-1] // 2, generator=gen).to(DEVICE)
    h = swiglu_joined(gu, backend="triton")
    assert h.shape == up.shape and h.dtype == dtype
    (h.float() * up).sum().backward()
    gu64 = gu.detach().double().requires_grad_(True)
    ref = swiglu_joined_reference(gu64)
    (ref * up.double()).sum().backward()
    tol = TOL[dtype]
    assert (h.double() - ref).abs().max().item() <= tol * max(ref.abs().max().item(), 1.0)
    torch.testing.assert_close(gu.grad.double(), gu64.grad, rtol=tol, atol=tol * gu64.grad.abs().max().item())


def test_oracles_are_the_stages_they_join():
    """``rope_qkv_reference`` is the rotation of the q and k slices and the v slice as it is;
    ``swiglu_joined_reference`` is silu of the first half times the second."""
    B, T, H, Hkv, D = 2, 5, 4, 2, 8
    qkv = torch.randn(B, T, (H + 2 * Hkv) * D)
    cos, sin = rope_tables(torch.arange(T), D, 10000.0)
    q, k, v = rope_qkv_reference(qkv, cos, sin, H, Hkv)
    q0, k0, v0 = qkv.split([H * D, Hkv * D, Hkv * D], dim=-1)
    assert torch.equal(q, apply_rope_reference(q0.reshape(B, T, H, D), cos, sin))
    assert torch.equal(k, apply_rope_reference(k0.reshape(B, T, Hkv, D), cos, sin))
    assert torch.equal(v, v0.reshape(B, T, Hkv, D)) and v.is_contiguous()
    y = torch.randn(3, 16)
    assert torch.equal(swiglu_joined_reference(y), torch.nn.functional.silu(y[:, :8]) * y[:, 8:])


def test_contracts_are_checked_by_name():
    qkv, cos = torch.randn(2, 5, 48), torch.randn(5, 8)
    with pytest.raises(ValueError, match=r"qkv's last axis \(48\) must be \(n_head \+ 2 n_kv\) = 5 heads"):
        rope_qkv(qkv, cos, cos, 3, 1)
    with pytest.raises(ValueError, match=r"cos must be a \[T, D\] = \[5, 8\] table, got \(4, 8\)"):
        rope_qkv(qkv, torch.randn(4, 8), cos, 4, 1)
    with pytest.raises(ValueError, match="n_kv must be a positive int"):
        rope_qkv(qkv, cos, cos, 6, 0)
    with pytest.raises(ValueError, match=r"gate_up must be a tensor \[..., 2F\]"):
        swiglu_joined(torch.randn(3, 5))


@pytest.mark.parametrize("name", ["transformer_tiny", "swa_gdn2_tiny"])
def test_model_on_the_kernels_matches_the_torch_stages(name, monkeypatch):
    """The tiny models with grouped projections, their attention and MLP stages on these kernels (as on
    CUDA), the rest on the torch path: the torch stages' loss and gradients (fp32)."""
    import torch.nn.functional as F

    import gdn2.ops.pointwise.api as pointwise_api
    from gdn2.config import Config
    from gdn2.model import GPT
    from gdn2.options import ModelOptions, apply_options

    torch.manual_seed(0)
    model = GPT(Config.from_name(name)).to(DEVICE).float()
    apply_options(model, ModelOptions(grouped_projections=True))
    idx = torch.randint(0, model.config.vocab_size, (2, 21), device=DEVICE)

    def loss_and_grads():
        model.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(idx[:, :-1]).flatten(0, 1), idx[:, 1:].flatten())
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    monkeypatch.setattr(pointwise_api, "_triton", lambda x, backend: False)
    loss_t, grads_t = loss_and_grads()
    monkeypatch.setattr(pointwise_api, "_triton", lambda x, backend: True)
    loss_k, grads_k = loss_and_grads()
    torch.testing.assert_close(loss_k, loss_t, rtol=1e-6, atol=1e-6)
    for n, g in grads_t.items():
        torch.testing.assert_close(grads_k[n], g, rtol=1e-4, atol=1e-6, msg=lambda m: f"{n}: {m}")
