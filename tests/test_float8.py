"""train.float8: the blocks' projections through torchao's float8 GEMMs (emulated here, on the CPU:
the same casts and scales in ordinary matmuls), close to the full-precision model, the head, the
low-rank gate projections and the gates per head left as they were; bad settings named by their key."""

import importlib.util

import pytest
import torch

from gdn2.config import Config
from gdn2.float8 import check_device, float8_spec
from gdn2.options import ModelOptions, apply_options
from gdn2.model import GPT

# torchao comes with the float8 extra (pip install -e ".[dev,float8]"), not with dev
HAVE_TORCHAO = importlib.util.find_spec("torchao") is not None
needs_torchao = pytest.mark.skipif(not HAVE_TORCHAO, reason="torchao is not installed (the float8 extra)")


def _loss_and_grads(model, idx):
    model.zero_grad(set_to_none=True)
    loss = model(idx[:, :-1], labels=idx[:, 1:])
    loss.backward()
    return loss.detach(), torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def _tiny_float8_hybrid():
    """The tiny hybrid with the fused loss, grouped projections and emulated tensorwise float8, and a
    batch of token ids for it."""
    torch.manual_seed(1)
    model = GPT(Config.from_name("swa_gdn2_tiny")).train()
    apply_options(model, ModelOptions(fused_loss=True, grouped_projections=True,
                                      float8=float8_spec("tensorwise", emulate=True)))
    return model, torch.randint(0, model.config.vocab_size, (2, 33))


@needs_torchao
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("grouped", [True, False])
def test_float8_model_is_close_to_full_precision_and_marks_the_right_projections(recipe, grouped):
    torch.manual_seed(0)
    model = GPT(Config.from_name("swa_gdn2_tiny")).train()
    apply_options(model, ModelOptions(fused_loss=True, grouped_projections=grouped))
    idx = torch.randint(0, model.config.vocab_size, (2, 65))
    ref_loss, ref_grads = _loss_and_grads(model, idx)

    apply_options(model, ModelOptions(fused_loss=True, grouped_projections=grouped,
                                      float8=float8_spec(recipe, emulate=True)))
    marked = {name for name, m in model.named_modules() if getattr(m, "float8", None) is not None}
    gdn = model.transformer.h[0].mixer
    assert "lm_head" not in marked and gdn.f_proj[1].float8 is None and gdn.g_proj[1].float8 is None
    assert gdn.q_proj.float8 is not None and gdn.o_proj.float8 is not None
    assert model.transformer.h[1].mixer.qkv.float8 is not None and model.transformer.h[1].mlp.w3.float8 is not None
    loss, grads = _loss_and_grads(model, idx)
    assert loss != ref_loss  # the float8 GEMMs did run
    assert abs(loss - ref_loss) <= 2e-2 * ref_loss
    assert torch.nn.functional.cosine_similarity(grads, ref_grads, dim=0) > 0.99

    apply_options(model, ModelOptions(fused_loss=True, grouped_projections=grouped))
    assert _loss_and_grads(model, idx)[0] == ref_loss


@needs_torchao
def test_gates_per_head_stay_out_of_float8_in_a_gemm_of_their_own():
    """A gate per head (a GEMM of a few columns) is exempt; the grouped input projections then run as
    one float8 GEMM and one for the exempt gate, which gives that gate exactly its plain projection."""
    from gdn2.linear import project

    model = GPT(Config.from_name("kda_tiny")).train()
    apply_options(model, ModelOptions(grouped_projections=True, float8=float8_spec("tensorwise", emulate=True)))
    gdn = model.transformer.h[0].mixer
    linears = [gdn.q_proj, gdn.k_proj, gdn.b_proj, gdn.f_proj[0]]
    assert gdn.b_proj.float8 is None and all(lin.float8 is not None for lin in linears if lin is not gdn.b_proj)
    x = torch.randn(2, 5, model.config.n_embd)
    q, _, b, _ = project(x, linears, grouped=True)
    assert torch.equal(b, torch.nn.functional.linear(x, gdn.b_proj.weight))
    assert not torch.equal(q, torch.nn.functional.linear(x, gdn.q_proj.weight))  # float8 there


def test_bad_float8_settings_are_named():
    from gdn2.train.recipe import load_recipe

    with pytest.raises(ValueError, match="train.float8: must be one of tensorwise, rowwise, rowwise_with_gw_hp"):
        load_recipe("swa_gdn2_tiny", {"train.float8": "e4m3"})
    if not HAVE_TORCHAO:  # the recipe names the extra to install
        with pytest.raises(ValueError, match=r"train.float8 needs torchao: pip install 'gdn2\[float8\]'"):
            load_recipe("swa_gdn2_tiny", {"train.float8": "rowwise"})
        return
    with pytest.raises(ValueError, match="train.float8=rowwise needs a CUDA GPU of compute capability 8.9"):
        check_device(float8_spec("rowwise"), torch.device("cpu"))
@needs_torchao
def test_float8_stage_traces_without_graph_breaks_to_the_eager_values(caplog):
    """As ``train.compile`` runs it (each float8 GEMM one traced stage): no graph break, same loss and
    gradients as eager, and a validation forward after training still traced (each projection shape
    with and without gradients is more graphs than torch's default recompile limit)."""
    model, idx = _tiny_float8_hybrid()
    loss_e, grads_e = _loss_and_grads(model, idx)
    torch._dynamo.reset()
    breaks = sum(torch._dynamo.utils.counters["graph_break"].values())
    with torch.no_grad():
        val_e = model(idx[:, :-1], labels=idx[:, 1:])
    spec = float8_spec("tensorwise", emulate=True)
    apply_options(model, ModelOptions(fused_loss=True, grouped_projections=True, float8=spec, compile=True, compile_devices=("cpu",), compile_backend="aot_eager"))
    try:
        loss_c, grads_c = _loss_and_grads(model, idx)
        with torch.no_grad():
            val_c = model(idx[:, :-1], labels=idx[:, 1:])
    finally:
        apply_options(model, ModelOptions())
    assert sum(torch._dynamo.utils.counters["graph_break"].values()) == breaks
    assert "recompile_limit" not in caplog.text
    torch.testing.assert_close(val_c, val_e)
    torch.testing.assert_close(loss_c, loss_e)
    torch.testing.assert_close(grads_c, grads_e, rtol=1e-5, atol=1e-6)
@needs_torchao
def test_recompute_with_float8_gives_the_same_loss_and_gradients(monkeypatch):
    """``train.recompute`` over float8 projections (the rebuilt operator inputs come from the float8
    grouped projection's output), eager and with the stages traced: one rebuild per GDN-2 layer, and
    bit-identical to keeping them."""
    from gdn2.layers.gdn2 import GatedDeltaNet2

    rebuilds = []
    inputs = GatedDeltaNet2._operator_inputs
    monkeypatch.setattr(GatedDeltaNet2, "_operator_inputs",
                        lambda *a, **k: (rebuilds.append(not torch.is_grad_enabled()), inputs(*a, **k))[1])
    model, idx = _tiny_float8_hybrid()
    spec = float8_spec("tensorwise", emulate=True)
    try:
        for traced in (False, True):
            compiled = dict(compile=True, compile_devices=("cpu",), compile_backend="aot_eager") if traced else {}
            if traced:
                torch._dynamo.reset()
            apply_options(model, ModelOptions(fused_loss=True, grouped_projections=True, float8=spec, **compiled))
            loss_k, grads_k = _loss_and_grads(model, idx)
            apply_options(model, ModelOptions(fused_loss=True, grouped_projections=True, float8=spec, recompute=True,
                                              **compiled))
            rebuilds.clear()
            loss_r, grads_r = _loss_and_grads(model, idx)
            assert sum(rebuilds) == sum(isinstance(m, GatedDeltaNet2) for m in model.modules()), traced
            assert torch.equal(loss_r, loss_k) and torch.equal(grads_r, grads_k), traced
    finally:
        apply_options(model, ModelOptions())
