"""gdn2/layers/fused.py, the model's elementwise stages: right values, and traceable as one graph each.

On the GPU the trainer runs them through torch.compile (``train.compile``); here each stage is traced
with the ``aot_eager`` backend and ``fullgraph=True``, which fails on a graph break and runs the
traced forward and backward, so that values and gradients can be compared with the eager function.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gdn2.layers import fused


def _close(a, b, tol):
    assert (a - b).abs().max().item() <= tol * max(1.0, b.abs().max().item())


def _conv_reference(x, weight, tail, pos_in_doc):
    """silu(causal depthwise conv1d) via F.conv1d per document, float64."""
    B, T, C = x.shape
    ks = weight.shape[-1]
    full = torch.cat([tail if tail is not None else x.new_zeros(B, ks - 1, C), x], dim=1).double()
    if pos_in_doc is not None:  # zero every input that precedes the token's document start
        out = torch.empty(B, T, C, dtype=torch.float64)
        for t in range(T):
            start = t - int(pos_in_doc[t])  # document start in x coordinates
            window = full[:, t: t + ks].clone()  # inputs x_{t-ks+1} .. x_t
            for s in range(ks):
                if t - (ks - 1) + s < start:
                    window[:, s] = 0
            out[:, t] = (window * weight[:, 0, :].double().t()[None]).sum(1)
        return F.silu(out)
    return F.silu(F.conv1d(full.transpose(1, 2), weight.double(), groups=C).transpose(1, 2))


@pytest.mark.parametrize("T", [1, 2, 9])
@pytest.mark.parametrize("with_tail", [False, True])
@pytest.mark.parametrize("masked", [False, True])
def test_causal_conv_silu_is_the_causal_depthwise_conv(T, with_tail, masked):
    torch.manual_seed(T)
    B, C, ks = 2, 6, 4
    x = torch.randn(B, T, C, dtype=torch.float64)
    weight = torch.randn(C, 1, ks, dtype=torch.float64)
    tail = torch.randn(B, ks - 1, C, dtype=torch.float64) if with_tail else None
    pos = None
    if masked:  # documents of lengths 2, 3, ... restarting inside x
        pos = torch.tensor([t % 3 if t < 5 else t - 5 for t in range(T)])
    got = fused.causal_conv_silu(x, weight, tail, pos)
    _close(got, _conv_reference(x, weight, tail, pos), 1e-12)


def _stage_cases():
    torch.manual_seed(0)
    B, T, H, D, C = 2, 5, 3, 8, 24
    f32 = dict(dtype=torch.float32)
    return {
        "rms_norm": (fused.rms_norm, [torch.randn(B, T, C, **f32), torch.rand(C, **f32) + 0.5], [1e-5]),
        "add_rms_norm": (fused.add_rms_norm, [torch.randn(B, T, C, **f32), torch.randn(B, T, C, **f32),
                                              torch.rand(C, **f32) + 0.5], [1e-5]),
        "gated_rms_norm": (fused.gated_rms_norm, [torch.randn(B, T, H, D, **f32), torch.randn(B, T, H, D, **f32),
                                                  torch.rand(D, **f32) + 0.5], [1e-5]),
        "causal_conv_silu": (fused.causal_conv_silu, [torch.randn(B, T, C, **f32), torch.randn(C, 1, 4, **f32)], []),
        "causal_conv_silu_tail_docs": (fused.causal_conv_silu, [torch.randn(B, T, C, **f32),
                                                                torch.randn(C, 1, 4, **f32),
                                                                torch.randn(B, 3, C, **f32)],
                                       [torch.tensor([0, 1, 0, 1, 2])]),
        "gdn2_gates": (fused.gdn2_gates, [torch.randn(B, T, H * D, **f32), torch.randn(B, T, H * D, **f32),
                                          torch.randn(B, T, H * D, **f32), torch.randn(H, **f32),
                                          torch.randn(H * D, **f32)], [D, 2.0]),
        "swiglu": (fused.swiglu, [torch.randn(B, T, C, **f32), torch.randn(B, T, C, **f32)], []),
        "swiglu_joined": (fused.swiglu_joined_stage, [torch.randn(B, T, 2 * C, **f32)], []),
        "apply_rope": (fused.apply_rope, [torch.randn(B, T, H, D, **f32), torch.randn(T, D, **f32),
                                          torch.randn(T, D, **f32)], []),
        "rope_qkv": (fused.rope_qkv_stage, [torch.randn(B, T, (H + 2) * D, **f32), torch.randn(T, D, **f32),
                                      torch.randn(T, D, **f32)], [H, 1]),
    }


@pytest.mark.parametrize("name", list(_stage_cases()))
def test_stage_traces_as_one_graph_with_the_same_values_and_gradients(name):
    fn, tensors, consts = _stage_cases()[name]
    eager_in = [t.clone().requires_grad_(True) for t in tensors]
    traced_in = [t.clone().requires_grad_(True) for t in tensors]
    torch._dynamo.reset()
    traced = torch.compile(fn.eager, backend="aot_eager", fullgraph=True)
    outs_e = fn.eager(*eager_in, *consts)
    outs_t = traced(*traced_in, *consts)
    outs_e = outs_e if isinstance(outs_e, tuple) else (outs_e,)
    outs_t = outs_t if isinstance(outs_t, tuple) else (outs_t,)
    torch.manual_seed(1)
    weights = [torch.randn_like(o) for o in outs_e]
    sum((o * w).sum() for o, w in zip(outs_e, weights)).backward()
    sum((o * w).sum() for o, w in zip(outs_t, weights)).backward()
    for a, b in zip(outs_t, outs_e):
        _close(a, b, 1e-6)
    for a, b in zip(traced_in, eager_in):
        assert b.grad is not None, f"{name}: no gradient reaches an input"
        _close(a.grad, b.grad, 1e-5)


def test_add_rms_norm_is_the_residual_add_then_the_norm():
    torch.manual_seed(2)
    x, d, w = torch.randn(3, 4, 16), torch.randn(3, 4, 16), torch.rand(16) + 0.5
    s, n = fused.add_rms_norm(x, d, w, 1e-5)
    torch.testing.assert_close(s, x + d)
    ref = (x + d) / ((x + d).square().mean(-1, keepdim=True) + 1e-5).sqrt() * w
    torch.testing.assert_close(n, ref)


def test_norm_under_autocast_returns_the_matmul_dtype_with_the_cast_values_and_gradients():
    """Under autocast an RMSNorm hands its reader (a projection) autocast's dtype: the same values and
    gradients as the fp32 norm followed by the cast the projection would make, the residual sum fp32."""
    from gdn2.layers.init import RMSNorm

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
    ref = fused.rms_norm(x + d, norm.weight, norm.eps)
    assert torch.equal(n, ref.to(torch.bfloat16))
    assert torch.equal(m, fused.rms_norm(x, norm.weight, norm.eps).to(torch.bfloat16))
    (ref.to(torch.bfloat16).float() * up).sum().backward()
    assert torch.equal(got, x.grad)


@pytest.mark.parametrize("bias", [False, True])
def test_linear_under_autocast_is_autocasts_linear_with_gradients_in_the_parameters_dtype(bias):
    """The model's linears under bf16 autocast: the output and input gradient of autocast's own
    ``F.linear``, bit for bit; the weight and bias gradients fp32, the weight's the same GEMM's values
    (on the CPU it still runs in bf16; on CUDA the GEMM writes fp32: ``test_weight_grad_on_cuda...``),
    the bias's summed in fp32."""
    from gdn2.layers.init import Linear

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


def test_switch_leaves_cpu_calls_eager():
    captured = torch._dynamo.utils.counters["stats"]["calls_captured"]
    fused.set_compiled(True)
    try:
        x = torch.randn(2, 3, 8)
        torch.testing.assert_close(fused.swiglu(x, x), F.silu(x) * x)
    finally:
        fused.set_compiled(False)
    assert torch._dynamo.utils.counters["stats"]["calls_captured"] == captured
    assert not fused.compiled_enabled()


def test_model_with_compiled_stages_matches_eager():
    """The tiny hybrid model with every stage traced (as ``train.compile`` does on CUDA), under activation
    checkpointing and document masking: same loss and gradients as eager."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

    from gdn2.config import Config
    from gdn2.model import GPT, Block

    torch.manual_seed(0)
    model = GPT(Config.from_name("swa_gdn2_tiny")).train()
    apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, Block))
    idx = torch.randint(0, model.config.vocab_size, (1, 33))
    cu = torch.tensor([0, 12, 32], dtype=torch.int32)

    def loss_and_grads():
        model.zero_grad(set_to_none=True)
        logits = model(idx[:, :-1], cu_seqlens=cu)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), idx[:, 1:].flatten())
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    loss_e, grads_e = loss_and_grads()
    torch._dynamo.reset()
    captured = torch._dynamo.utils.counters["stats"]["calls_captured"]
    fused.set_compiled(True, devices=("cpu",), backend="aot_eager")
    try:
        loss_c, grads_c = loss_and_grads()
    finally:
        fused.set_compiled(False)
    assert torch._dynamo.utils.counters["stats"]["calls_captured"] > captured  # the stages really were traced
    torch.testing.assert_close(loss_c, loss_e, rtol=1e-5, atol=1e-6)
    for n, g in grads_e.items():
        torch.testing.assert_close(grads_c[n], g, rtol=1e-4, atol=1e-6, msg=lambda m: f"{n}: {m}")


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
        outs = fused.project(x, linears, grouped)
        sum((o * u).sum() for o, u in zip(outs, ups)).backward()
        return outs, x.grad.clone(), [lin.weight.grad.clone() for lin in linears]

    separate = run(False)
    grouped = run(True)
    assert len({o.grad_fn.next_functions[0][0] for o in grouped[0]}) == 1  # views of one GEMM's output
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = fused.project(x.float().detach(), [torch.nn.Linear(12, n, bias=False) for n in (5, 7, 3)], True)
    assert all(t.dtype == torch.bfloat16 for t in y)
    for a, b in zip(grouped[0], separate[0]):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grouped[1], separate[1], rtol=1e-12, atol=1e-12)
    for a, b in zip(grouped[2], separate[2]):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", ["swa_gdn2_tiny", "transformer_tiny"])
def test_model_with_grouped_projections_matches_separate(name):
    from gdn2.config import Config
    from gdn2.model import GPT

    torch.manual_seed(0)
    model = GPT(Config.from_name(name)).double()
    idx = torch.randint(0, model.config.vocab_size, (2, 17))

    def loss_and_grads():
        model.zero_grad(set_to_none=True)
        loss = model(idx[:, :-1], labels=idx[:, 1:])
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    loss_s, grads_s = loss_and_grads()
    model.set_grouped_projections(True)
    assert model.transformer.h[0].mlp.grouped_projections
    loss_g, grads_g = loss_and_grads()
    torch.testing.assert_close(loss_g, loss_s, rtol=1e-12, atol=1e-12)
    for n, g in grads_s.items():
        torch.testing.assert_close(grads_g[n], g, rtol=1e-9, atol=1e-12, msg=lambda m: f"{n}: {m}")


@pytest.mark.gpu
def test_weight_grad_on_cuda_is_the_fp32_product_of_bf16_operands():
    """On CUDA the GEMM writes the fp32 weight gradient itself: as close to the float64 product of the
    bf16 operands as fp32 accumulation allows, and closer than the bf16 result autocast casts up."""
    torch.manual_seed(6)
    dy = torch.randn(4, 1024, 384, device="cuda").to(torch.bfloat16)
    x = torch.randn(4, 1024, 256, device="cuda").to(torch.bfloat16)
    exact = dy.double().reshape(-1, 384).t() @ x.double().reshape(-1, 256)
    got = fused.weight_grad(dy, x, torch.float32)
    assert got.dtype == torch.float32
    err = (got.double() - exact).abs().max().item()
    err_bf16 = ((dy.reshape(-1, 384).t() @ x.reshape(-1, 256)).double() - exact).abs().max().item()
    assert err <= 1e-4 * exact.abs().max().item() and err < err_bf16 / 10


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["swa_gdn2_tiny", "transformer_tiny"])
def test_model_with_inductor_stages_on_cuda_matches_eager(name):
    """The tiny models on CUDA under bf16 autocast, grouped projections on, every stage compiled by
    inductor (what ``train.compile`` runs): the eager loss and gradients within bf16 rounding."""
    from gdn2.config import Config
    from gdn2.model import GPT

    torch.manual_seed(7)
    model = GPT(Config.from_name(name)).cuda().train()
    model.set_grouped_projections(True)
    idx = torch.randint(0, model.config.vocab_size, (2, 257), device="cuda")

    def loss_and_grads():
        model.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(idx[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), idx[:, 1:].flatten())
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    loss_e, grads_e = loss_and_grads()
    torch._dynamo.reset()
    fused.set_compiled(True)
    try:
        loss_c, grads_c = loss_and_grads()
    finally:
        fused.set_compiled(False)
    torch.testing.assert_close(loss_c, loss_e, rtol=1e-2, atol=1e-2)
    for n, g in grads_e.items():
        cos = F.cosine_similarity(grads_c[n].flatten().double(), g.flatten().double(), dim=0).item()
        assert cos > 0.99, f"{n}: gradient cosine {cos:.4f}"
