"""gdn2/generation/decode.py: every cached path gives the logits of the full forward pass; the fused decode
weights are copies that follow the parameters; the compiled decode step traces whole; the decode steps
with the attention layers on the ring-buffer decode kernel (Triton's interpreter on the CPU)."""

import pytest
import torch

from gdn2.generation.cache import InferenceCache
from gdn2.generation.decode import DecodeWeights, compiled_block_step, decode_step, extend, prefill
from gdn2.layers.attention import AttentionCache
from decode_helpers import tiny_decoding_model

# Windows of 6 keys wrap the ring buffer; GDN-2 inputs of <= 4 tokens take the recurrent kernel, longer
# ones the chunked one; the hybrid's GDN-2 layer has grouped value heads, V != K and the doubled erase
# gate (what the fused layout splits), the transformer grouped KV heads. The gates per head: KDA's and
# Gated DeltaNet's tied ones (the latter with grouped value heads, V != K and the doubled tied gate), and
# the two ablations (a config name, then "/" and a label, for overrides of one config).
CONFIGS = {
    "swa_gdn2_tiny": dict(sliding_window=6, gdn2_recurrent_max_len=4, gdn2_num_v_heads=8, gdn2_expand_v=2.0,
                          allow_neg_eigval=True),
    "gdn2_tiny": dict(gdn2_recurrent_max_len=4),
    "transformer_tiny": dict(n_query_groups=2),
    "kda_tiny": dict(gdn2_recurrent_max_len=4),
    "gdn_tiny": dict(gdn2_recurrent_max_len=4, gdn2_num_v_heads=8, gdn2_expand_v=2.0, allow_neg_eigval=True),
    "gdn2_tiny/erase_head": dict(gdn2_recurrent_max_len=4, gdn2_erase="head"),
    "gdn2_tiny/write_head": dict(gdn2_recurrent_max_len=4, gdn2_write="head"),
}
LENGTHS, STEPS = [5, 13, 1, 9], 8
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _cache_tensors(cache):
    return [t for layer in cache.layers for t in vars(layer).values() if torch.is_tensor(t)]


@pytest.mark.parametrize("variant", ["documents", "decode", "decode_fused", "extend"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_every_path_gives_the_full_forward_logits(name, variant):
    """float64: each sequence's own full forward pass against
    - documents: all sequences in one row, document-masked (``cu_seqlens``);
    - decode(_fused): packed prefill of prompts of different lengths, then one token per row per step
      (right-aligned rows), unfused or on DecodeWeights; every cache write in place;
    - extend: prefill and decoding of aligned rows in pieces of several lengths."""
    model = tiny_decoding_model(name.split("/")[0], **CONFIGS[name])
    seqs = [torch.randint(0, 256, (n + STEPS,)) for n in LENGTHS]
    with torch.no_grad():
        full = [model(s[None])[0] for s in seqs]
        if variant == "documents":
            lengths = torch.tensor([0] + [len(s) for s in seqs])
            out = model(torch.cat(seqs)[None], cu_seqlens=lengths.cumsum(0))[0]
            for s, f, start in zip(seqs, full, lengths.cumsum(0)):
                torch.testing.assert_close(out[start: start + len(s)], f, atol=1e-10, rtol=0)
        elif variant in ("decode", "decode_fused"):
            weights = DecodeWeights(model) if variant == "decode_fused" else None
            cache = InferenceCache(model, len(seqs), max_length=32)
            logits = prefill(model, [s[:n] for s, n in zip(seqs, LENGTHS)], cache)
            pointers = [t.data_ptr() for t in _cache_tensors(cache)]
            for j in range(STEPS + 1):
                for r, n in enumerate(LENGTHS):
                    torch.testing.assert_close(logits[r], full[r][n - 1 + j], atol=1e-9, rtol=0)
                if j < STEPS:
                    logits = decode_step(model, torch.stack([s[n + j] for s, n in zip(seqs, LENGTHS)]), cache, weights)
            assert [t.data_ptr() for t in _cache_tensors(cache)] == pointers  # what a CUDA graph relies on
            assert int(cache.column) == max(LENGTHS) + STEPS
            window = model.config.sliding_window
            for ring in [c for c in cache.layers if isinstance(c, AttentionCache) and window]:
                assert ring.capacity == window  # memory bounded by the window, holding its last columns
                assert sorted(ring.positions.tolist()) == list(range(int(cache.column) - window, int(cache.column)))
        else:
            idx = torch.stack([seqs[1], torch.randint(0, 256, (len(seqs[1]),))])
            whole = model(idx)
            cache = InferenceCache(model, 2, max_length=32)
            cuts = [0, 3, 4, 11, 12, 13, 16, len(seqs[1])]  # 3 and 7 tokens (recurrent / chunked GDN-2)
            pieces = [extend(model, idx[:, a:b], cache) for a, b in zip(cuts, cuts[1:])]
            torch.testing.assert_close(torch.cat(pieces, 1), whole, atol=1e-10, rtol=0)
            assert int(cache.column) == len(seqs[1])


def test_full_attention_cache_overflow_and_ragged_extend_are_errors():
    model = tiny_decoding_model("transformer_tiny")
    cache = InferenceCache(model, 2, max_length=4)
    with torch.no_grad():
        with pytest.raises(ValueError, match="max_length"):
            prefill(model, [torch.zeros(5, dtype=torch.long), torch.zeros(1, dtype=torch.long)], cache)
        with pytest.raises(ValueError, match="max_length"):
            extend(model, torch.zeros(2, 5, dtype=torch.long), cache)
        prefill(model, [torch.zeros(3, dtype=torch.long), torch.zeros(1, dtype=torch.long)], cache)
        with pytest.raises(ValueError, match="different lengths"):
            extend(model, torch.zeros(2, 1, dtype=torch.long), cache)
        with pytest.raises(ValueError, match="empty cache"):
            prefill(model, [torch.zeros(1, dtype=torch.long)] * 2, cache)


def test_fused_layout_is_a_copy_of_the_parameters():
    model = tiny_decoding_model("swa_gdn2_tiny", sliding_window=6)
    names = {k: (v.shape, v.dtype) for k, v in model.state_dict().items()}
    weights = DecodeWeights(model)
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
    assert torch.equal(fused.conv, torch.cat([gdn.q_conv1d.weight, gdn.k_conv1d.weight, gdn.v_conv1d.weight]))
    for block, b in zip(model.transformer.h, weights.blocks):
        assert torch.equal(b.mlp_in, torch.cat([block.mlp.w1.weight, block.mlp.w2.weight]))
    assert weights.blocks[1].mixer is None  # attention: qkv is one matrix already
    assert 0 < weights.nbytes() < sum(p.numel() * p.element_size() for p in model.parameters())


def _continue(model, weights, prompt, steps=4):
    """Greedy logits of ``steps`` decode steps after ``prompt``, fused (``weights``) or not (None)."""
    cache = InferenceCache(model, 1, max_length=32)
    with torch.no_grad():
        out = [prefill(model, [prompt], cache)]
        for _ in range(steps):
            out.append(decode_step(model, out[-1].argmax(-1), cache, weights))
    return torch.stack(out)


def test_decode_weights_follow_the_parameters_through_refresh():
    """Replaced or in-place-written parameters make the copies stale (refused); refresh() copies in
    place, or reallocates after a dtype change; it also undoes writes no check sees (fused optimizer
    steps, p.data)."""
    model = tiny_decoding_model("swa_gdn2_tiny", sliding_window=6)
    weights = DecodeWeights(model)
    buffers = [t.data_ptr() for b in weights.blocks for t in b.tensors()]
    prompt = torch.randint(0, 256, (7,))

    def current():
        torch.testing.assert_close(_continue(model, weights, prompt), _continue(model, None, prompt), atol=1e-10,
                                   rtol=0)

    other = tiny_decoding_model("swa_gdn2_tiny", sliding_window=6)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(0.01 * torch.randn_like(p))
    model.load_state_dict(other.state_dict())
    assert weights.stale_blocks() == [0, 1]
    with pytest.raises(ValueError, match="stale"):
        _continue(model, weights, prompt)
    assert weights.refresh() is False  # same shapes and dtypes: updated in place
    assert [t.data_ptr() for b in weights.blocks for t in b.tensors()] == buffers
    current()

    with torch.no_grad():  # an in-place edit of one block's parameter
        model.transformer.h[1].mlp.w2.weight.mul_(1.5)
    assert weights.stale_blocks() == [1]
    weights.refresh()
    current()

    for kw in (dict(foreach=True), dict(fused=True)):  # fused AdamW leaves the version counters alone
        before = _continue(model, None, prompt)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, **kw)
        model.train()
        model(prompt[None]).logsumexp(-1).mean().backward()
        opt.step()
        model.eval()
        assert weights.stale_blocks() == ([0, 1] if "foreach" in kw else [])
        weights.refresh()
        current()
        assert (_continue(model, None, prompt) - before).abs().max() > 1e-3  # the step did change the model

    model.transformer.h[0].mlp.w1.weight.data.mul_(1.5)  # no version bump either
    weights.refresh()
    current()

    model.float()  # new tensors of another dtype: reallocated
    assert weights.refresh() is True
    assert all(t.dtype == torch.float32 for b in weights.blocks for t in b.tensors())
    torch.testing.assert_close(_continue(model, weights, prompt), _continue(model, None, prompt), atol=1e-4, rtol=0)

    with pytest.raises(ValueError, match="another model"):
        _continue(other, weights, prompt)


@pytest.mark.slow
def test_compiled_decode_step_traces_whole_and_matches_eager():
    """Every compiled piece (inputs, one block step per layer kind, head) traces without graph breaks
    (fullgraph; the cache writes are custom ops with declared mutations) into one graph per piece and
    weight layout, and gives the eager step's logits and cache contents, fused and unfused."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    model = tiny_decoding_model("swa_gdn2_tiny", sliding_window=6)
    torch._dynamo.reset()
    counters.clear()
    compiled = compiled_block_step("aot_eager", fullgraph=True)
    prompts = [torch.randint(0, 256, (n,)) for n in (5, 9)]
    for weights in (DecodeWeights(model), None):
        eager_cache, compiled_cache = InferenceCache(model, 2, max_length=32), InferenceCache(model, 2, max_length=32)
        tokens = torch.tensor([3, 4])
        with torch.no_grad():
            prefill(model, prompts, eager_cache)
            prefill(model, prompts, compiled_cache)
            for _ in range(8):  # the window of 6 wraps the ring buffer
                expected = decode_step(model, tokens, eager_cache, weights)
                got = decode_step(model, tokens, compiled_cache, weights, compiled)
                torch.testing.assert_close(got, expected, atol=1e-12, rtol=0)
                tokens = expected.argmax(-1)
        for a, b in zip(_cache_tensors(eager_cache), _cache_tensors(compiled_cache)):
            torch.testing.assert_close(b, a, atol=1e-12, rtol=0)
    # inputs, gdn2 block, attention block, head; then the two block steps again for unfused weights
    assert counters["stats"]["unique_graphs"] == 6
    torch._dynamo.reset()


@pytest.mark.gpu
def test_captured_decode_step_gives_the_eager_steps_logits():
    """On CUDA, bf16: the fused decode step captured in a CUDA graph runs what the eager step runs (no
    stage takes a Triton kernel eagerly and its torch form under capture), so the logits agree step
    after step far below bf16's rounding noise."""
    from gdn2.config import Config
    from gdn2.generation import CapturedDecodeStep
    from gdn2.model import GPT

    torch.manual_seed(0)
    with torch.device("cuda"):
        model = GPT(Config.from_name("swa_gdn2_tiny")).eval()
    for name, p in model.named_parameters():
        if not name.endswith(("A_log", "dt_bias")):  # the decay parameters stay fp32, as in training
            p.data = p.data.to(torch.bfloat16)
    V = model.config.vocab_size
    prompts = [torch.randint(0, V, (n,), device="cuda") for n in (37, 5)]
    fed = torch.randint(0, V, (6, 2), device="cuda")
    weights = DecodeWeights(model)

    def run(captured: bool) -> list[torch.Tensor]:
        cache = InferenceCache(model, 2, max_length=128)
        step = CapturedDecodeStep(model, cache, weights=weights) if captured else None
        cache.reset()
        with torch.no_grad():
            out = [prefill(model, prompts, cache)]
            for tokens in fed:
                out.append((step(tokens) if captured else decode_step(model, tokens, cache, weights)).clone())
        return out

    for e, g in zip(run(False), run(True)):
        err = ((g.double() - e.double()).norm() / e.double().norm()).item()
        assert err < 1e-3, err


@pytest.mark.parametrize("name,kw", [("swa_gdn2_tiny", dict(sliding_window=6, gdn2_recurrent_max_len=4)),
                                     ("transformer_tiny", dict(n_query_groups=2))])
@pytest.mark.slow
def test_decode_on_the_kernel_equals_the_full_forward(monkeypatch, name, kw):
    """The model's decode steps (fused and not) with the attention layers on the kernel, fp32,
    ragged prompts, a window that wraps the ring: the logits of the full forward pass. Only the decode
    attention op runs on Triton here; the other operators' kernels have tests of their own."""
    import functools

    import gdn2.ops.decode_attention.api as decode_api
    from gdn2.config import Config
    from gdn2.generation import DecodeWeights, InferenceCache, decode_step, prefill
    from gdn2.model import GPT

    monkeypatch.setattr(decode_api, "ring_decode_attention",
                        functools.partial(decode_api.ring_decode_attention, backend="triton"))
    torch.manual_seed(0)
    model = GPT(Config.from_name(name, vocab_size=128, n_layer=2, **kw)).to(DEVICE).eval()
    lengths, steps = [5, 9, 1], 7
    seqs = [torch.randint(0, 128, (n + steps,), device=DEVICE) for n in lengths]
    with torch.no_grad():
        full = [model(s[None])[0] for s in seqs]
        for weights in (None, DecodeWeights(model)):
            cache = InferenceCache(model, len(seqs), max_length=32)
            logits = prefill(model, [s[:n] for s, n in zip(seqs, lengths)], cache)
            for j in range(steps + 1):
                for r, n in enumerate(lengths):
                    torch.testing.assert_close(logits[r], full[r][n - 1 + j], atol=1e-4, rtol=1e-4)
                if j < steps:
                    tokens = torch.stack([s[n + j] for s, n in zip(seqs, lengths)])
                    logits = decode_step(model, tokens, cache, weights)
