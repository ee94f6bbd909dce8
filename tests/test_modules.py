"""gdn2/modules.py: the modules that carry their own initialisation, under autocast."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gdn2 import stages
from gdn2.modules import Linear, RMSNorm


def test_norm_under_autocast_returns_the_matmul_dtype_with_the_cast_values_and_gradients():
    """Under autocast an RMSNorm hands its reader (a projection) autocast's dtype: the same values and
    gradients as the fp32 norm followed by the cast the projection would make, the residual sum fp32."""
    torch.manual_seed(3)
    norm = RMSNorm(16)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x, d = torch.randn(3, 4, 16, requires_grad=True), torch.randn(3, 4, 16)
    up = torch.randn(3, 4, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        s, n = norm.add_forward(x, d)
        m = norm(x)
    assert (s.dtype, n.dtype, m.dtype) == (torch.float32, torch.bfloat16, torch.bfloat16)
    (n.float() * up).sum().backward()
    got = x.grad.clone()
    x.grad = None
    ref = stages.rms_norm(x + d, norm.weight, norm.eps)
    assert torch.equal(n, ref.to(torch.bfloat16))
    assert torch.equal(m, stages.rms_norm(x, norm.weight, norm.eps).to(torch.bfloat16))
    (ref.to(torch.bfloat16).float() * up).sum().backward()
    assert torch.equal(got, x.grad)


@pytest.mark.parametrize("bias", [False, True])
def test_linear_under_autocast_is_autocasts_linear_with_gradients_in_the_parameters_dtype(bias):
    """The model's linears under bf16 autocast: the output and input gradient of autocast's own
    ``F.linear``, bit for bit; the weight and bias gradients fp32, the weight's the same GEMM's values
    (on the CPU it still runs in bf16; on CUDA the GEMM writes fp32: ``test_weight_grad_on_cuda...``),
    the bias's summed in fp32."""
    torch.manual_seed(5)
    lin = Linear(24, 40, bias=bias)
    if bias:
        torch.nn.init.normal_(lin.bias)
    x = torch.randn(3, 7, 24, requires_grad=True)
    up = torch.randn(3, 7, 40)

    def run(forward):
        lin.zero_grad(set_to_none=True)
        x.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = forward(x)
        (y.float() * up).sum().backward()
        return y, x.grad, lin.weight.grad, None if lin.bias is None else lin.bias.grad

    y, dx, dw, db = run(lin)
    assert type(y.grad_fn).__name__ == "_AutocastLinearBackward"
    y_ref, dx_ref, dw_ref, db_ref = run(lambda t: F.linear(t, lin.weight, lin.bias))
    assert y.dtype == y_ref.dtype == torch.bfloat16 and dx.dtype == torch.float32
    assert torch.equal(y, y_ref) and torch.equal(dx, dx_ref)
    assert dw.dtype == torch.float32 and torch.equal(dw, dw_ref)
    if bias:
        exact = (up.to(torch.bfloat16).float()).reshape(-1, 40).sum(0)  # dy is up, rounded to bf16
        assert db.dtype == torch.float32
        assert (db - exact).abs().max() <= (db_ref - exact).abs().max() + 1e-6
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(lin(x), y_ref)  # without gradients: autocast's linear itself
