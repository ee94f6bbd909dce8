"""gdn2/model.py: the training forward (document offsets checked, every parameter trained) and the
reference initialisation. Cached paths and document masking: tests/test_inference.py."""

import pytest
import torch
import torch.nn.functional as F

from gdn2.config import Config
from gdn2.model import GPT

TINY = ["gdn2_tiny", "swa_gdn2_tiny", "transformer_tiny"]


def test_cu_seqlens_must_include_row_starts():
    m = GPT(Config.from_name("gdn2_tiny"))
    with pytest.raises(ValueError, match="row start"):
        m(torch.zeros(2, 8, dtype=torch.long), cu_seqlens=torch.tensor([0, 3, 16]))


@pytest.mark.parametrize("name", TINY)
def test_training_step_all_parameters_get_gradients(name):
    torch.manual_seed(0)
    m = GPT(Config.from_name(name)).train()
    idx = torch.randint(0, m.config.vocab_size, (2, 65))
    logits = m(idx[:, :-1])
    loss = F.cross_entropy(logits.flatten(0, 1).float(), idx[:, 1:].flatten())
    assert torch.isfinite(loss)
    assert abs(loss.item() - torch.log(torch.tensor(m.config.vocab_size)).item()) < 0.5  # near-uniform at init
    loss.backward()
    for n, p in m.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), n
        assert p.grad.abs().sum() > 0, f"no gradient reaches {n}"


def test_initialisation_follows_reference():
    torch.manual_seed(0)
    c = Config.from_name("swa_gdn2_tiny")
    m = GPT(c)
    gdn = m.transformer.h[0].mixer
    a = gdn.A_log.exp()
    assert (a >= 1).all() and (a <= 16).all()
    dt = torch.nn.functional.softplus(gdn.dt_bias)  # softplus(dt_bias) recovers dt
    assert (dt >= 1e-4 - 1e-7).all() and (dt <= 0.1 + 1e-6).all()
    assert getattr(gdn.A_log, "_no_weight_decay", False) and getattr(gdn.dt_bias, "_no_weight_decay", False)
    assert abs(m.transformer.wte.weight.std().item() - 0.02) < 2e-3
    w3 = m.transformer.h[0].mlp.w3.weight
    assert abs(w3.std().item() - 0.02 / (2 * c.n_layer) ** 0.5) < 2e-3
    assert gdn.g_proj[1].bias is not None and gdn.g_proj[1].bias.abs().sum() == 0
    # meta construction + reset_parameters gives the same values as eager construction
    with torch.device("meta"):
        mm = GPT(c)
    mm.to_empty(device="cpu")
    torch.manual_seed(0)
    for mod in mm.modules():
        if hasattr(mod, "reset_parameters") and any(True for _ in mod.parameters(recurse=False)):
            mod.reset_parameters()
    assert all(torch.isfinite(p).all() for p in mm.parameters())
    assert (mm.transformer.h[0].mixer.A_log.exp() >= 1).all()
