"""gdn2/options.py: the one function that sets how a model computes."""

from __future__ import annotations

import pytest
import torch

from gdn2.config import Config
from gdn2.model import GPT
from gdn2.options import ModelOptions, apply_options


@pytest.mark.parametrize("name", ["swa_gdn2_tiny", "transformer_tiny"])
def test_model_with_grouped_projections_matches_separate(name):
    torch.manual_seed(0)
    model = GPT(Config.from_name(name)).double()
    idx = torch.randint(0, model.config.vocab_size, (2, 17))

    def loss_and_grads():
        model.zero_grad(set_to_none=True)
        loss = model(idx[:, :-1], labels=idx[:, 1:])
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    loss_s, grads_s = loss_and_grads()
    apply_options(model, ModelOptions(grouped_projections=True))
    assert model.transformer.h[0].mlp.grouped_projections
    loss_g, grads_g = loss_and_grads()
    torch.testing.assert_close(loss_g, loss_s, rtol=1e-12, atol=1e-12)
    for n, g in grads_s.items():
        torch.testing.assert_close(grads_g[n], g, rtol=1e-9, atol=1e-12, msg=lambda m: f"{n}: {m}")


def test_apply_options_sets_and_replaces_every_choice_in_one_call():
    """One call sets every option on every module that has it; the next call replaces all of them (a bare
    model, and ModelOptions(), have them all off); a wrapped model is refused."""
    model = GPT(Config.from_name("swa_gdn2_tiny"))
    flagged = [m for m in model.modules() if hasattr(m, "grouped_projections")]
    assert flagged and not any(m.grouped_projections for m in flagged) and not model.fused_loss
    apply_options(model, ModelOptions(fused_loss=True, grouped_projections=True, recompute=True))
    assert model.fused_loss and all(m.grouped_projections for m in flagged)
    assert all(m.recompute for m in model.modules() if hasattr(m, "recompute"))
    apply_options(model, ModelOptions())
    assert not model.fused_loss and not any(m.grouped_projections for m in flagged)
    assert not any(m.recompute for m in model.modules() if hasattr(m, "recompute"))
    with pytest.raises(TypeError, match="bare GPT"):
        apply_options(torch.nn.Sequential(model), ModelOptions())
