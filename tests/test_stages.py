"""gdn2/stages.py, the model's elementwise stages: right values, and traceable as one graph each.

On the GPU the trainer runs them through torch.compile (``train.compile``); here each stage is traced
with the ``aot_eager`` backend and ``fullgraph=True``, which fails on a graph break and runs the
traced forward and backward, so that values and gradients can be compared with the eager function.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gdn2 import stages
from gdn2.options import ModelOptions, apply_options


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
    got = stages.causal_conv_silu(x, weight, tail, pos)
    _close(got, _conv_reference(x, weight, tail, pos), 1e-12)


def _stage_cases():
    torch.manual_seed(0)
    B, T, H, D, C = 2, 5, 3, 8, 24
    f32 = dict(dtype=torch.float32)
    return {
        "rms_norm": (stages.rms_norm, [torch.randn(B, T, C, **f32), torch.rand(C, **f32) + 0.5], [1e-5]),
        "add_rms_norm": (stages.add_rms_norm, [torch.randn(B, T, C, **f32), torch.randn(B, T, C, **f32),
                                              torch.rand(C, **f32) + 0.5], [1e-5]),
        "gated_rms_norm": (stages.gated_rms_norm, [torch.randn(B, T, H, D, **f32), torch.randn(B, T, H, D, **f32),
                                                  torch.rand(D, **f32) + 0.5], [1e-5]),
        "causal_conv_silu": (stages.causal_conv_silu, [torch.randn(B, T, C, **f32), torch.randn(C, 1, 4, **f32)], []),
        "causal_conv_silu_tail_docs": (stages.causal_conv_silu, [torch.randn(B, T, C, **f32),
                                                                torch.randn(C, 1, 4, **f32),
                                                                torch.randn(B, 3, C, **f32)],
                                       [torch.tensor([0, 1, 0, 1, 2])]),
        "gdn2_gates": (stages.gdn2_gates, [torch.randn(B, T, H * D, **f32), torch.randn(B, T, H * D, **f32),
                                          torch.randn(B, T, H * D, **f32), torch.randn(H, **f32),
                                          torch.randn(H * D, **f32)], [2.0]),
        "gdn2_gates_per_head": (stages.gdn2_gates, [torch.randn(B, T, H, **f32), torch.randn(B, T, H, **f32),
                                                   torch.randn(B, T, H, **f32), torch.randn(H, **f32),
                                                   torch.randn(H, **f32)], [2.0, (D, D, 2 * D)]),
        "swiglu": (stages.swiglu, [torch.randn(B, T, C, **f32), torch.randn(B, T, C, **f32)], []),
        "swiglu_joined": (stages.swiglu_joined_stage, [torch.randn(B, T, 2 * C, **f32)], []),
        "apply_rope": (stages.apply_rope, [torch.randn(B, T, H, D, **f32), torch.randn(T, D, **f32),
                                          torch.randn(T, D, **f32)], []),
        "rope_qkv": (stages.rope_qkv_stage, [torch.randn(B, T, (H + 2) * D, **f32), torch.randn(T, D, **f32),
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
    s, n = stages.add_rms_norm(x, d, w, 1e-5)
    torch.testing.assert_close(s, x + d)
    ref = (x + d) / ((x + d).square().mean(-1, keepdim=True) + 1e-5).sqrt() * w
    torch.testing.assert_close(n, ref)


def test_switch_leaves_cpu_calls_eager():
    captured = torch._dynamo.utils.counters["stats"]["calls_captured"]
    stages.set_compiled(True)
    try:
        x = torch.randn(2, 3, 8)
        torch.testing.assert_close(stages.swiglu(x, x), F.silu(x) * x)
    finally:
        stages.set_compiled(False)
    assert torch._dynamo.utils.counters["stats"]["calls_captured"] == captured
    assert not stages.compiled_enabled()


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
    apply_options(model, ModelOptions(compile=True, compile_devices=("cpu",), compile_backend="aot_eager"))
    try:
        loss_c, grads_c = loss_and_grads()
    finally:
        apply_options(model, ModelOptions())
    assert torch._dynamo.utils.counters["stats"]["calls_captured"] > captured  # the stages really were traced
    torch.testing.assert_close(loss_c, loss_e, rtol=1e-5, atol=1e-6)
    for n, g in grads_e.items():
        torch.testing.assert_close(grads_c[n], g, rtol=1e-4, atol=1e-6, msg=lambda m: f"{n}: {m}")


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["swa_gdn2_tiny", "transformer_tiny"])
def test_model_with_inductor_stages_on_cuda_matches_eager(name):
    """The tiny models on CUDA under bf16 autocast, grouped projections on, every stage compiled by
    inductor (what ``train.compile`` runs): the eager loss and gradients within bf16 rounding."""
    from gdn2.config import Config
    from gdn2.model import GPT

    torch.manual_seed(7)
    model = GPT(Config.from_name(name)).cuda().train()
    apply_options(model, ModelOptions(grouped_projections=True))
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
    apply_options(model, ModelOptions(grouped_projections=True, compile=True))
    try:
        loss_c, grads_c = loss_and_grads()
    finally:
        apply_options(model, ModelOptions())
    torch.testing.assert_close(loss_c, loss_e, rtol=1e-2, atol=1e-2)
    for n, g in grads_e.items():
        cos = F.cosine_similarity(grads_c[n].flatten().double(), g.flatten().double(), dim=0).item()
        assert cos > 0.99, f"{n}: gradient cosine {cos:.4f}"
