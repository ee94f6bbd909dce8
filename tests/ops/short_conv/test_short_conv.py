"""The short-convolution kernels against their float64 oracle (Triton's interpreter on the CPU, fp32 and
fp16; bf16 on the GPU), the entry point's contract, and the GDN-2 layer running on them."""

import pytest
import torch

from gdn2.ops import short_conv_silu, short_conv_silu_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def _documents(T: int, starts: list[int]) -> torch.Tensor:
    bounds = [0, *starts, T]
    return torch.cat([torch.arange(b - a) for a, b in zip(bounds[:-1], bounds[1:])]).to(DEVICE)


def _case(B, T, C, ks, dtype, docs, seed=0):
    """x as a slice of a wider tensor (rows strided, as q, k and v are of the grouped projection)."""
    gen = torch.Generator().manual_seed(seed)
    wide = torch.randn(B, T, C + 24, generator=gen).to(DEVICE, dtype)
    weight = (0.5 * torch.randn(C, 1, ks, generator=gen)).to(DEVICE)
    up = torch.randn(B, T, C, generator=gen).to(DEVICE)
    pos = _documents(T, docs) if docs else None
    return wide, weight, up, pos


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else []))
@pytest.mark.parametrize("B,T,C,ks,docs", [
    (2, 37, 48, 4, []),  # T and C not tile multiples
    (1, 70, 130, 4, [1, 20, 21, 69]),  # documents of one token, a start at the tile edge, two channel tiles
    (2, 66, 16, 2, [64]),
])
def test_kernel_matches_the_float64_oracle_with_gradients(B, T, C, ks, docs, dtype):
    wide, weight, up, pos = _case(B, T, C, ks, dtype, docs)
    wide.requires_grad_(True)
    weight.requires_grad_(True)
    y = short_conv_silu(wide[..., 8:8 + C], weight, pos, backend="triton")
    assert y.dtype == dtype and y.shape == (B, T, C) and y.is_contiguous()
    (y.float() * up).sum().backward()

    wide64 = wide.detach().double().requires_grad_(True)
    weight64 = weight.detach().double().requires_grad_(True)
    ref = short_conv_silu_reference(wide64[..., 8:8 + C], weight64.to(dtype).double(), None, pos)
    (ref * up.double()).sum().backward()
    tol = TOL[dtype]
    scale = ref.abs().max().item()
    assert (y.double() - ref).abs().max().item() <= tol * max(scale, 1.0)
    assert wide.grad[..., :8].abs().max() == 0 and wide.grad[..., 8 + C:].abs().max() == 0
    torch.testing.assert_close(wide.grad.double(), wide64.grad, rtol=tol, atol=tol * wide64.grad.abs().max().item())
    torch.testing.assert_close(weight.grad.double(), weight64.grad, rtol=tol,
                               atol=tol * weight64.grad.abs().max().item())


def test_other_tiles_give_the_same_results(monkeypatch):
    """The tile shape is a launch choice only: small tiles (several row and channel programs, the weight
    gradient summed over more partials) give the oracle's values too."""
    from gdn2.ops.short_conv import conv

    monkeypatch.setattr(conv, "FWD_TILE", (16, 32, 2))
    monkeypatch.setattr(conv, "BWD_TILE", (16, 32, 2))
    test_kernel_matches_the_float64_oracle_with_gradients(1, 70, 40, 4, [1, 20, 21, 69], torch.float32)


def test_documents_do_not_see_each_other():
    """With pos_in_doc, the output of a document does not depend on the tokens before its start."""
    wide, weight, _, _ = _case(1, 40, 8, 4, torch.float32, [])
    x = wide[..., :8].contiguous()
    pos = _documents(40, [17])
    a = short_conv_silu(x, weight, pos, backend="triton")
    x2 = x.clone()
    x2[:, :17] = torch.randn_like(x2[:, :17])
    b = short_conv_silu(x2, weight, pos, backend="triton")
    assert torch.equal(a[:, 17:], b[:, 17:]) and not torch.equal(a[:, :17], b[:, :17])


def test_contract_is_checked_by_name():
    x, w = torch.randn(2, 5, 8), torch.randn(8, 1, 4)
    with pytest.raises(ValueError, match="weight must be \\[C, 1, kernel_size\\] with C=8"):
        short_conv_silu(x, torch.randn(6, 1, 4))
    with pytest.raises(ValueError, match="x must have contiguous channels"):
        short_conv_silu(torch.randn(2, 8, 5).transpose(1, 2), w)
    with pytest.raises(ValueError, match="pos_in_doc must be an integer tensor \\[T\\] = \\[5\\]"):
        short_conv_silu(x, w, torch.zeros(5))
    with pytest.raises(ValueError, match="pos_in_doc must be an integer tensor"):
        short_conv_silu(x, w, [0, 1, 2, 3, 4])
    with pytest.raises(ValueError, match="x must have rank 3"):
        short_conv_silu(torch.randn(5, 8), w)
    with pytest.raises(ValueError, match="float64, which the Triton kernels do not take"):
        short_conv_silu(x.double(), w, backend="triton")
    assert torch.equal(short_conv_silu(x, w), short_conv_silu_reference(x, w))  # the CPU default


def test_gdn2_layer_on_the_kernel_equals_the_torch_stage(monkeypatch):
    """The layer's convolutions through the kernel (grouped projections, so q, k, v are slices of one
    GEMM's output), with and without document starts: same output and gradients as the torch stage."""
    import gdn2.layers.gdn2 as layer_mod
    import gdn2.ops.short_conv.api as conv_api
    import gdn2.ops.short_conv.conv as conv_kernels
    from gdn2.config import Config
    from gdn2.layout import TokenLayout
    from gdn2.ops import select_backend

    torch.manual_seed(0)
    layer = layer_mod.GatedDeltaNet2(Config.from_name("gdn2_tiny")).to(DEVICE)
    layer.grouped_projections = True
    x = torch.randn(1, 24, layer.q_proj.in_features, device=DEVICE)
    cu = torch.tensor([0, 9, 24], device=DEVICE, dtype=torch.int32)
    calls = []
    kernel = conv_kernels.short_conv_silu_triton

    def counted(*args, **kwargs):
        calls.append(1)
        return kernel(*args, **kwargs)

    monkeypatch.setattr(conv_kernels, "short_conv_silu_triton", counted)

    def run(conv_backend: str, **kw):
        monkeypatch.setattr(conv_api, "select_backend",
                            lambda op, device, backend=None, dtype=None: conv_backend if op == "short_conv"
                            else select_backend(op, device, backend, dtype))
        layer.zero_grad(set_to_none=True)
        out = layer(x, **kw)
        out.square().sum().backward()
        return out.detach(), {n: p.grad.clone() for n, p in layer.named_parameters()}

    documents = TokenLayout(_documents(24, [9]), cu, _documents(24, [9]))
    for kw in ({}, {"layout": documents}):
        calls.clear()
        out_t, grads_t = run("torch", **kw)
        assert not calls
        out_k, grads_k = run("triton", **kw)
        assert len(calls) == 3
        torch.testing.assert_close(out_k, out_t, rtol=1e-5, atol=1e-6)
        for n, g in grads_t.items():
            torch.testing.assert_close(grads_k[n], g, rtol=1e-4, atol=1e-6, msg=lambda m: f"{n}: {m}")
