"""The fp32 cross-entropy from logits and from the hidden states and the head's weight (the logits
never whole): the loss and every gradient equal torch's, ignored labels included; the model computes
its loss either way to the same values."""

import pytest
import torch
import torch.nn.functional as F

from gdn2.config import Config
from gdn2.loss import cross_entropy_fp32, linear_cross_entropy
from gdn2.options import ModelOptions, apply_options
from gdn2.model import GPT


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_cross_entropy_matches_torch(dtype):
    torch.manual_seed(0)
    logits = (torch.randn(3, 37, 101) * 4).to(dtype).requires_grad_(True)
    labels = torch.randint(0, 101, (3, 37))
    labels[0, :5] = -100  # ignored positions
    ours = cross_entropy_fp32(logits, labels, chunk_tokens=16)
    ours.backward()
    ref_logits = logits.detach().float().requires_grad_(True)
    ref = F.cross_entropy(ref_logits.reshape(-1, 101), labels.reshape(-1), ignore_index=-100)
    ref.backward()
    assert ours.dtype == torch.float32
    assert ours.item() == pytest.approx(ref.item(), rel=1e-6)
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(logits.grad.float(), ref_logits.grad, atol=tol * ref_logits.grad.abs().max(), rtol=0)
    with torch.no_grad():
        assert cross_entropy_fp32(logits, labels).item() == pytest.approx(ref.item(), rel=1e-6)


def test_slice_stage_traces_as_one_graph_with_the_eager_values():
    """The slice's loss and gradient, as ``train.compile`` runs them (one traced graph), equal eager."""
    from gdn2.loss import slice_loss_and_grad

    torch.manual_seed(4)
    logits = (torch.randn(9, 50) * 3).to(torch.bfloat16)
    target, ok = torch.randint(0, 50, (9,)), torch.rand(9) > 0.3
    count = ok.sum().float()
    torch._dynamo.reset()
    traced = torch.compile(slice_loss_and_grad.eager, backend="aot_eager", fullgraph=True)
    for want_grad in (True, False):
        (t_e, g_e), (t_c, g_c) = (fn(logits, target, ok, count, want_grad)
                                  for fn in (slice_loss_and_grad.eager, traced))
        torch.testing.assert_close(t_c, t_e)
        assert (g_e is None) == (g_c is None) == (not want_grad)
        if want_grad:
            assert g_c.dtype == torch.bfloat16 and torch.equal(g_c, g_e) and g_e[~ok].abs().max() == 0


def test_chunked_cross_entropy_scales_with_upstream_gradient():
    logits = torch.randn(10, 7, requires_grad=True)
    labels = torch.randint(0, 7, (10,))
    (cross_entropy_fp32(logits, labels, chunk_tokens=3) * 2.5).backward()
    ref = logits.detach().clone().requires_grad_(True)
    (F.cross_entropy(ref, labels) * 2.5).backward()
    torch.testing.assert_close(logits.grad, ref.grad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_linear_cross_entropy_matches_the_head_then_torch(dtype):
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(2, 23, 16, generator=gen, dtype=dtype).requires_grad_(True)
    weight = (torch.randn(41, 16, generator=gen, dtype=dtype) * 0.5).requires_grad_(True)
    labels = torch.randint(0, 41, (2, 23), generator=gen)
    labels[1, 3:9] = -100
    (linear_cross_entropy(hidden, weight, labels, chunk_tokens=7) * 1.5).backward()
    h, w = (t.detach().clone().requires_grad_(True) for t in (hidden, weight))
    ref = F.cross_entropy((h @ w.t()).reshape(-1, 41).double(), labels.reshape(-1), ignore_index=-100)
    (ref * 1.5).backward()
    tol = 1e-6 if dtype == torch.float32 else 1e-12
    torch.testing.assert_close(hidden.grad, h.grad, atol=tol, rtol=tol)
    torch.testing.assert_close(weight.grad, w.grad, atol=tol, rtol=tol)
    assert hidden.grad.dtype == dtype and weight.grad.dtype == dtype
    with torch.no_grad():
        assert linear_cross_entropy(hidden, weight, labels).item() == pytest.approx(ref.item(), rel=1e-6)


def test_linear_cross_entropy_under_autocast_runs_its_gemms_in_bf16():
    gen = torch.Generator().manual_seed(2)
    hidden = torch.randn(40, 32, generator=gen).requires_grad_(True)
    weight = (torch.randn(50, 32, generator=gen) * 0.2).requires_grad_(True)
    labels = torch.randint(0, 50, (40,), generator=gen)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours = linear_cross_entropy(hidden, weight, labels, chunk_tokens=16)
        ref = cross_entropy_fp32(F.linear(hidden, weight), labels)
    assert ours.dtype == torch.float32 and ours.item() == pytest.approx(ref.item(), rel=2e-3)
    g_ours = torch.autograd.grad(ours, (hidden, weight))
    g_ref = torch.autograd.grad(ref, (hidden, weight))
    for a, b in zip(g_ours, g_ref):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a, b, atol=2e-2 * b.abs().max(), rtol=0)


def test_bad_shapes_name_what_does_not_match():
    with pytest.raises(ValueError, match="labels shape \\(3,\\) does not match \\(4,\\)"):
        linear_cross_entropy(torch.zeros(4, 8), torch.zeros(5, 8), torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="weight must be \\[V, 8\\]"):
        linear_cross_entropy(torch.zeros(4, 8), torch.zeros(5, 7), torch.zeros(4, dtype=torch.long))


@pytest.mark.parametrize("name", ["swa_gdn2_tiny", "transformer_tiny"])
def test_the_models_fused_loss_equals_its_logits_loss(name):
    torch.manual_seed(0)
    model = GPT(Config.from_name(name, vocab_size=97, block_size=32)).double()
    idx = torch.randint(0, 97, (2, 32))
    labels = torch.randint(0, 97, (2, 32))
    labels[0, :4] = -100
    cu = torch.tensor([0, 10, 32, 50, 64])
    grads = []
    for fused in (False, True):
        apply_options(model, ModelOptions(fused_loss=fused))
        model.zero_grad()
        loss = model(idx, cu_seqlens=cu, labels=labels, loss_chunk_tokens=24)
        loss.backward()
        grads.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
    (l0, g0), (l1, g1) = grads
    torch.testing.assert_close(l1, l0, atol=1e-12, rtol=1e-12)
    for a, b in zip(g1, g0):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-9)
