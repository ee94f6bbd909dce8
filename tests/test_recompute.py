"""gdn2/recompute.py, and the GDN-2 layers' use of it (``ModelOptions.recompute``): named tensors are
let go in the forward, rebuilt once for the backward, and the gradients stay exactly those of keeping
them."""

from __future__ import annotations

import dataclasses
import weakref

import pytest
import torch

from gdn2.config import Config
from gdn2.layers.gdn2 import GatedDeltaNet2
from gdn2.model import GPT
from gdn2.options import ModelOptions, apply_options
from gdn2.recompute import RecomputeScope


def _graph(x: torch.Tensor, scoped: bool, rebuilds: list, sliced: bool = False):
    """exp(x) saved three ways (by exp as its output and by sin before the ``recompute`` call, by a
    product through a transposed view after it); returns the loss and a weak reference to exp(x)."""
    with RecomputeScope() as scope:
        e = torch.exp(x)
        named = e[:, :3] if sliced else e
        s = torch.sin(named)
        if scoped:
            def again():
                rebuilds.append(1)
                out = torch.exp(x)
                return [out[:, :3].clone() if sliced else out]

            scope.recompute([named], again)
        m = named.t() * s.t()
    return m.sum(), weakref.ref(e)


def test_named_tensor_is_let_go_and_rebuilt_once_for_identical_gradients():
    x = torch.randn(6, 5, dtype=torch.float64, requires_grad=True)
    rebuilds: list = []
    loss, _ = _graph(x, False, rebuilds)
    (want,) = torch.autograd.grad(loss, x)
    loss, e = _graph(x, True, rebuilds)
    assert e() is None  # nothing keeps exp(x) between the forward and the backward
    (got,) = torch.autograd.grad(loss, x, retain_graph=True)
    assert len(rebuilds) == 1  # three saved handles, one rebuild
    assert torch.equal(got, want)
    (again,) = torch.autograd.grad(loss, x)  # a retained graph rebuilds what it freed
    assert torch.equal(again, want) and len(rebuilds) == 2


def test_rebuilt_tensor_may_sit_inside_a_larger_buffer():
    """The rebuild may hand back a view at an offset of its own storage (as a compiled graph can): each
    handle's view is taken relative to it."""
    x = torch.randn(6, 5, dtype=torch.float64, requires_grad=True)
    want = torch.autograd.grad(_graph(x, False, [])[0], x)[0]
    with RecomputeScope() as scope:
        e = torch.exp(x)
        s = torch.sin(e)

        def again():
            buf = torch.zeros(7 + x.numel(), dtype=x.dtype)
            buf[7:].view_as(x).copy_(torch.exp(x))
            return [buf[7:].view_as(x)]

        scope.recompute([e], again)
        loss = (e.t() * s.t()).sum()
    assert torch.equal(torch.autograd.grad(loss, x)[0], want)


def test_view_of_a_larger_buffer_is_kept_as_saved():
    x = torch.randn(6, 5, dtype=torch.float64, requires_grad=True)
    rebuilds: list = []
    loss, e = _graph(x, True, rebuilds, sliced=True)
    assert e() is not None
    (got,) = torch.autograd.grad(loss, x)
    want = torch.zeros_like(x)
    ex = x.detach().exp()[:, :3]
    want[:, :3] = ex * (torch.sin(ex) + ex * torch.cos(ex))
    assert not rebuilds
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def _loss_and_grads(model, idx, cu, autocast):
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = model(idx[:, :-1], labels=idx[:, 1:], cu_seqlens=cu)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("case", ["float64", "bf16_autocast_traced"])
def test_model_with_recompute_has_the_same_loss_and_gradients(case, monkeypatch):
    """The tiny hybrid, grouped projections on, document masking: the GDN-2 layers rebuild their
    intermediates (one rebuild each for the operator's inputs and one for the gated output) and the
    loss and every gradient are bit-identical to keeping them, in float64 and under bf16 autocast with
    the stages traced."""
    torch.manual_seed(0)
    model = GPT(Config.from_name("swa_gdn2_tiny")).train()
    if case == "float64":
        model = model.double()
    idx = torch.randint(0, model.config.vocab_size, (1, 49))
    cu = torch.tensor([0, 20, 48], dtype=torch.int32)
    autocast = case != "float64"
    options = ModelOptions(grouped_projections=True)
    if autocast:
        torch._dynamo.reset()
        options = ModelOptions(grouped_projections=True, compile=True, compile_devices=("cpu",), compile_backend="aot_eager")
    apply_options(model, options)
    calls = []
    inputs = GatedDeltaNet2._operator_inputs
    monkeypatch.setattr(GatedDeltaNet2, "_operator_inputs",
                        lambda *a, **k: (calls.append(torch.is_grad_enabled()), inputs(*a, **k))[1])
    try:
        loss_k, grads_k = _loss_and_grads(model, idx, cu, autocast)
        kept_calls = len(calls)
        apply_options(model, dataclasses.replace(options, recompute=True))
        loss_r, grads_r = _loss_and_grads(model, idx, cu, autocast)
    finally:
        apply_options(model, ModelOptions())
    n_gdn2 = sum(isinstance(m, GatedDeltaNet2) for m in model.modules())
    assert kept_calls == n_gdn2 and calls[kept_calls:].count(False) == n_gdn2  # one rebuild per layer
    assert torch.equal(loss_r, loss_k)
    for n, g in grads_k.items():
        assert torch.equal(grads_r[n], g), n


@pytest.mark.gpu
def test_recompute_on_cuda_frees_the_intermediates_and_keeps_the_gradients():
    """On CUDA (Triton operators, inductor stages, bf16 autocast) the activation memory held after the
    forward drops by at least the bytes of what the GDN-2 layers let go, and the gradients match."""
    torch.manual_seed(1)
    model = GPT(Config.from_name("swa_gdn2_tiny")).cuda().train()
    idx = torch.randint(0, model.config.vocab_size, (4, 1025), device="cuda")
    apply_options(model, ModelOptions(grouped_projections=True, compile=True))

    def step():
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(idx[:, :-1], labels=idx[:, 1:])
        held = torch.cuda.memory_allocated() - before
        loss.backward()
        return held, loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    try:
        step()  # compile outside the measurement
        held_k, loss_k, grads_k = step()
        apply_options(model, ModelOptions(grouped_projections=True, compile=True, recompute=True))
        step()
        held_r, loss_r, grads_r = step()
    finally:
        apply_options(model, ModelOptions())
    layers = [m for m in model.modules() if isinstance(m, GatedDeltaNet2)]
    kd, vd = layers[0].key_dim, layers[0].value_dim
    # at least the operator's inputs: q, k, v, b, w in bf16, g in fp32 (f, the output gate and the
    # gated norm too where the compiled stages would have kept them), and the operator's own Aqk, A
    # (64 per head each) and R (value_dim) in bf16
    heads = layers[0].num_v_heads
    per_token = 2 * (2 * kd + vd) + 4 * kd + 2 * kd + 2 * vd + 2 * (2 * 64 * heads + vd)
    expected = len(layers) * idx[:, :-1].numel() * per_token
    assert held_k - held_r >= 0.9 * expected, (held_k, held_r, expected)
    torch.testing.assert_close(loss_r, loss_k, rtol=0, atol=0)
    for n, g in grads_k.items():
        torch.testing.assert_close(grads_r[n], g, rtol=1e-2, atol=1e-3, msg=lambda m: f"{n}: {m}")


@pytest.mark.slow
def test_layer_on_the_triton_operators_lets_the_operator_keep_only_its_inputs(monkeypatch):
    """With the operators on their Triton kernels (interpreted on the CPU, fp32), a GDN-2 layer under
    recompute also asks the GDN-2 operator to keep only its inputs (``chunk_gdn2(..., recompute=True)``),
    and its output and gradients equal keeping everything, bit for bit."""
    import gdn2.layers.gdn2 as layer_mod
    from gdn2.ops.backend import override

    cfg = Config.from_name("swa_gdn2_tiny")
    layer = GatedDeltaNet2(cfg).train()
    x = torch.randn(1, 40, cfg.n_embd, requires_grad=True)
    dy = torch.randn(1, 40, cfg.n_embd)
    asked = []
    operator = layer_mod.chunk_gdn2
    monkeypatch.setattr(layer_mod, "chunk_gdn2", lambda *a, **k: (asked.append(k["recompute"]), operator(*a, **k))[1])

    def run():
        out = layer(x)
        return out.detach(), torch.autograd.grad((out * dy).sum(), [x, *layer.parameters()])

    with override(backend="triton"):
        want = run()
        layer.recompute = True
        got = run()
    assert asked == [False, True]
    assert torch.equal(got[0], want[0])
    for (name, _), a, b in zip([("x", x), *layer.named_parameters()], got[1], want[1]):
        assert torch.equal(a, b), name
