"""gdn2/linear.py: grouped projections as one GEMM, and the fp32 weight gradient of bf16 operands on CUDA."""

from __future__ import annotations

import pytest
import torch

from gdn2.linear import project, weight_grad


def test_grouped_projection_is_one_gemm_with_each_linears_values_and_gradients():
    """``project`` with grouped projections on: one autograd node for all the linears, the same outputs,
    input gradient and weight gradients as the separate linears (float64), and under bf16 autocast the
    dtypes nn.Linear gives."""
    torch.manual_seed(3)
    linears = [torch.nn.Linear(12, n, bias=False).double() for n in (5, 7, 3)]
    x = torch.randn(2, 4, 12, dtype=torch.float64, requires_grad=True)
    ups = [torch.randn(2, 4, n, dtype=torch.float64) for n in (5, 7, 3)]

    def run(grouped):
        for lin in linears:
            lin.weight.grad = None
        x.grad = None
        outs = project(x, linears, grouped)
        sum((o * u).sum() for o, u in zip(outs, ups)).backward()
        return outs, x.grad.clone(), [lin.weight.grad.clone() for lin in linears]

    separate = run(False)
    grouped = run(True)
    assert len({o.grad_fn.next_functions[0][0] for o in grouped[0]}) == 1  # views of one GEMM's output
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = project(x.float().detach(), [torch.nn.Linear(12, n, bias=False) for n in (5, 7, 3)], True)
    assert all(t.dtype == torch.bfloat16 for t in y)
    for a, b in zip(grouped[0], separate[0]):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grouped[1], separate[1], rtol=1e-12, atol=1e-12)
    for a, b in zip(grouped[2], separate[2]):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.gpu
def test_weight_grad_on_cuda_is_the_fp32_product_of_bf16_operands():
    """On CUDA the GEMM writes the fp32 weight gradient itself: as close to the float64 product of the
    bf16 operands as fp32 accumulation allows, and closer than the bf16 result autocast casts up."""
    torch.manual_seed(6)
    dy = torch.randn(4, 1024, 384, device="cuda").to(torch.bfloat16)
    x = torch.randn(4, 1024, 256, device="cuda").to(torch.bfloat16)
    exact = dy.double().reshape(-1, 384).t() @ x.double().reshape(-1, 256)
    got = weight_grad(dy, x, torch.float32)
    assert got.dtype == torch.float32
    err = (got.double() - exact).abs().max().item()
    err_bf16 = ((dy.reshape(-1, 384).t() @ x.reshape(-1, 256)).double() - exact).abs().max().item()
    assert err <= 1e-4 * exact.abs().max().item() and err < err_bf16 / 10
