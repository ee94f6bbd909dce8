"""The model on the torch path: decoding equals the full forward, document masking, training step."""

import pytest
import torch
import torch.nn.functional as F

from gdn2.config import Config
from gdn2.model import GPT, InferenceCache

TINY = ["gdn2_tiny", "swa_gdn2_tiny", "transformer_tiny"]


def _tiny(name, **kw):
    torch.manual_seed(0)
    return GPT(Config.from_name(name, **kw)).double().eval()


@pytest.mark.parametrize("name", TINY)
def test_prefill_then_decode_equals_full_forward(name):
    # window 8 < sequence length 45, recurrent kernel used for inputs of <= 4 tokens, chunked above
    m = _tiny(name, sliding_window=8 if name != "transformer_tiny" else None, gdn2_recurrent_max_len=4)
    idx = torch.randint(0, m.config.vocab_size, (2, 45))
    with torch.no_grad():
        full = m(idx)
        cache = InferenceCache(m, batch_size=2, max_length=64)
        pieces = [m(idx[:, :13], cache=cache)]
        pieces += [m(idx[:, t:t + 1], cache=cache) for t in range(13, 20)]
        pieces.append(m(idx[:, 20:30], cache=cache))  # continued prefill (chunked path)
        pieces.append(m(idx[:, 30:33], cache=cache))  # short continued input (recurrent path)
        pieces += [m(idx[:, t:t + 1], cache=cache) for t in range(33, 45)]
    assert cache.seen == 45
    assert torch.allclose(torch.cat(pieces, 1), full, atol=1e-10, rtol=0)


def test_gdn2_layer_decode_equals_full_forward():
    m = _tiny("gdn2_tiny", gdn2_recurrent_max_len=1)
    layer = m.transformer.h[0].mixer
    x = torch.randn(3, 30, m.config.n_embd, dtype=torch.float64)
    with torch.no_grad():
        full = layer(x)
        cache = layer.init_cache(3, x.device, x.dtype)
        inc = torch.cat([layer(x[:, :7], cache=cache)] + [layer(x[:, t:t + 1], cache=cache) for t in range(7, 30)], 1)
    assert torch.allclose(inc, full, atol=1e-12, rtol=0)


def test_attention_cache_memory_is_bounded_by_window():
    m = _tiny("swa_gdn2_tiny", sliding_window=8)
    cache = InferenceCache(m, batch_size=1, max_length=10_000)
    assert cache.layers[1].k.shape[1] == 8
    with torch.no_grad():
        for t in range(20):
            m(torch.tensor([[t % 7]]), cache=cache)
    assert sorted(cache.layers[1].positions.tolist()) == list(range(12, 20))


def test_full_attention_cache_overflow_is_an_error():
    m = _tiny("transformer_tiny")
    cache = InferenceCache(m, batch_size=1, max_length=4)
    with torch.no_grad(), pytest.raises(ValueError, match="max_length"):
        m(torch.zeros(1, 5, dtype=torch.long), cache=cache)


@pytest.mark.parametrize("name", TINY)
def test_document_masking_equals_separate_documents(name):
    m = _tiny(name, sliding_window=6 if name != "transformer_tiny" else None)
    idx = torch.randint(0, m.config.vocab_size, (2, 24))
    # documents: row 0 = [0,10) [10,24); row 1 = [24,30) [30,48)
    cu = torch.tensor([0, 10, 24, 30, 48], dtype=torch.int32)
    with torch.no_grad():
        out = m(idx, cu_seqlens=cu).reshape(1, 48, -1)
        flat = idx.reshape(1, 48)
        for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
            assert torch.allclose(out[:, a:b], m(flat[:, a:b]), atol=1e-10, rtol=0)


def test_cu_seqlens_must_include_row_starts():
    m = _tiny("gdn2_tiny")
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
