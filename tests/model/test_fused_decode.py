"""The fused decode-time weight layout: the same logits and cache as the unfused step and the full
forward, parameters untouched, and the copies follow (or refuse) later weight changes."""

import pytest
import torch

from gdn2.model import InferenceCache
from decode_helpers import tiny_decoding_model

# the GDN-2 variant covers grouped value heads (HV != H), V != K and the doubled erase gate
MODELS = [("gdn2_tiny", dict(gdn2_num_v_heads=8, gdn2_expand_v=2.0, allow_neg_eigval=True)),
          ("swa_gdn2_tiny", dict(sliding_window=6, gdn2_recurrent_max_len=4)),
          ("transformer_tiny", {})]


def _cache_tensors(cache):
    return [t for layer in cache.layers for t in vars(layer).values() if torch.is_tensor(t)]


def _decode(model, seqs, lengths, steps, weights=None):
    """Ragged prefill, then ``steps`` decode steps feeding the known continuation. Returns the
    logits of every step [steps + 1] x [B, V] and the cache."""
    cache = InferenceCache(model, len(seqs), max_length=32)
    with torch.no_grad():
        out = [model.prefill([s[:n] for s, n in zip(seqs, lengths)], cache)]
        pointers = [t.data_ptr() for t in _cache_tensors(cache)]
        for j in range(steps):
            tokens = torch.stack([s[n + j] for s, n in zip(seqs, lengths)])
            out.append(model.decode_step(tokens, cache, weights=weights))
    assert pointers == [t.data_ptr() for t in _cache_tensors(cache)], "a cache update was not in place"
    return out, cache


@pytest.mark.parametrize("name,kw", MODELS)
def test_fused_step_equals_unfused_step_and_full_forward(name, kw):
    model = tiny_decoding_model(name, **kw)
    lengths = [5, 13, 1, 9]
    seqs = [torch.randint(0, 256, (n + 8,)) for n in lengths]
    weights = model.prepare_decoding()
    fused, fused_cache = _decode(model, seqs, lengths, 8, weights)
    plain, plain_cache = _decode(model, seqs, lengths, 8)
    for a, b in zip(fused, plain):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=0)
    for a, b in zip(_cache_tensors(fused_cache), _cache_tensors(plain_cache)):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=0)
    with torch.no_grad():
        for r, (s, n) in enumerate(zip(seqs, lengths)):
            full = model(s[None])[0]
            for j in range(9):
                torch.testing.assert_close(fused[j][r], full[n - 1 + j], atol=1e-9, rtol=0)


def test_fused_layout_is_a_copy_of_the_parameters():
    model = tiny_decoding_model("swa_gdn2_tiny", sliding_window=6)
    names = {k: (v.shape, v.dtype) for k, v in model.state_dict().items()}
    weights = model.prepare_decoding()
    assert {k: (v.shape, v.dtype) for k, v in model.state_dict().items()} == names  # nothing added or changed
    gdn, fused = model.transformer.h[0].mixer, weights.blocks[0].mixer
    rows = [gdn.q_proj, gdn.k_proj, gdn.v_proj, gdn.b_proj, gdn.w_proj, gdn.f_proj[0], gdn.g_proj[0]]
    assert torch.equal(fused.in_proj, torch.cat([lin.weight for lin in rows]))
    assert fused.in_proj.data_ptr() != gdn.q_proj.weight.data_ptr()
    Kd, r = gdn.key_dim, gdn.f_proj[0].out_features
    assert torch.equal(fused.low_rank[:Kd, :r], gdn.f_proj[1].weight)
    assert torch.equal(fused.low_rank[Kd:, r:], gdn.g_proj[1].weight)
    assert not fused.low_rank[:Kd, r:].any() and not fused.low_rank[Kd:, :r].any()
    assert torch.equal(fused.low_rank_bias[Kd:], gdn.g_proj[1].bias) and not fused.low_rank_bias[:Kd].any()
    for block, b in zip(model.transformer.h, weights.blocks):
        assert torch.equal(b.mlp_in, torch.cat([block.mlp.w1.weight, block.mlp.w2.weight]))
    assert weights.blocks[1].mixer is None  # attention: qkv is one matrix already
    assert 0 < weights.nbytes() < sum(p.numel() * p.element_size() for p in model.parameters())


def _continue(model, weights, prompt, steps=4):
    """Greedy logits of ``steps`` decode steps after ``prompt``, fused (``weights``) or not (None)."""
    cache = InferenceCache(model, 1, max_length=32)
    with torch.no_grad():
        logits = model.prefill([prompt], cache)
        out = [logits]
        for _ in range(steps):
            logits = model.decode_step(logits.argmax(-1), cache, weights=weights)
            out.append(logits)
    return torch.stack(out)


@pytest.mark.parametrize("optimizer", ["foreach", "fused"])
def test_stale_weights_after_an_optimizer_step_are_refused_then_refreshed_in_place(optimizer):
    model = tiny_decoding_model("swa_gdn2_tiny", sliding_window=6)
    weights = model.prepare_decoding()
    buffers = [t.data_ptr() for b in weights.blocks for t in b.tensors()]
    prompt = torch.randint(0, 256, (7,))
    before = _continue(model, weights, prompt)
    # fused AdamW leaves the version counters alone: the optimizer-step count catches it
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, **{optimizer: True})
    model.train()
    model(prompt[None]).logsumexp(-1).mean().backward()
    opt.step()
    model.eval()
    assert not weights.is_current()
    with pytest.raises(ValueError, match="stale"):
        _continue(model, weights, prompt)
    assert weights.refresh() is False  # same shapes and dtypes: updated in place
    assert [t.data_ptr() for b in weights.blocks for t in b.tensors()] == buffers
    assert weights.is_current()
    after = _continue(model, weights, prompt)
    torch.testing.assert_close(after, _continue(model, None, prompt), atol=1e-10, rtol=0)
    assert (after - before).abs().max() > 1e-3  # the step did change the model


def test_refresh_follows_load_state_dict_in_place_edits_and_dtype_changes():
    model = tiny_decoding_model("gdn2_tiny")
    other = tiny_decoding_model("gdn2_tiny")
    with torch.no_grad():
        for p in other.parameters():
            p.add_(0.01 * torch.randn_like(p))
    weights = model.prepare_decoding()
    prompt = torch.randint(0, 256, (5,))

    model.load_state_dict(other.state_dict())
    assert weights.stale_blocks() == [0, 1]
    weights.refresh()
    torch.testing.assert_close(_continue(model, weights, prompt), _continue(other, None, prompt), atol=1e-10, rtol=0)

    with torch.no_grad():  # an in-place edit of one block's parameter
        model.transformer.h[1].mixer.A_log.add_(0.5)
    assert weights.stale_blocks() == [1]
    weights.refresh()
    torch.testing.assert_close(_continue(model, weights, prompt), _continue(model, None, prompt), atol=1e-10, rtol=0)

    # a write through .data bypasses the version counter: refresh(force=True) is the documented remedy
    model.transformer.h[0].mlp.w1.weight.data.mul_(1.5)
    assert weights.is_current()
    weights.refresh(force=True)
    torch.testing.assert_close(_continue(model, weights, prompt), _continue(model, None, prompt), atol=1e-10, rtol=0)

    model.float()  # new tensors of another dtype: reallocated
    assert weights.refresh() is True
    assert all(t.dtype in (torch.float32,) for b in weights.blocks for t in b.tensors())
    torch.testing.assert_close(_continue(model, weights, prompt), _continue(model, None, prompt), atol=1e-5, rtol=0)


def test_weights_of_another_model_are_refused():
    a, b = tiny_decoding_model("transformer_tiny"), tiny_decoding_model("transformer_tiny")
    cache = InferenceCache(a, 1, max_length=8)
    with torch.no_grad(), pytest.raises(ValueError, match="another model"):
        a.decode_step(torch.tensor([1]), cache, weights=b.prepare_decoding())
