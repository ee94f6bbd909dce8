"""Generation: packed prefill + static decode step against repeated full forward passes."""

import pytest
import torch

from gdn2.generate import Generator, SamplingParams, filter_logits, sample_tokens
from gdn2.model import GPT, InferenceCache
from decode_helpers import (DECODE_MODELS, assert_compiled_decode_matches_eager, greedy_by_full_forward,
                            tiny_decoding_model)


MODELS = DECODE_MODELS


@pytest.mark.parametrize("name,kw", MODELS)
def test_ragged_prefill_and_decode_step_equal_full_forward(name, kw):
    model = tiny_decoding_model(name, **kw)
    lengths = [5, 13, 1, 9]
    seqs = [torch.randint(0, 256, (n + 8,)) for n in lengths]
    cache = InferenceCache(model, 4, max_length=32)
    with torch.no_grad():
        steps = [model.prefill([s[:n] for s, n in zip(seqs, lengths)], cache)]
        pointers = [t.data_ptr() for layer in cache.layers for t in vars(layer).values() if torch.is_tensor(t)]
        for j in range(8):
            steps.append(model.decode_step(torch.stack([s[n + j] for s, n in zip(seqs, lengths)]), cache))
        # every cache update happened in place (what a captured CUDA graph relies on)
        assert pointers == [t.data_ptr() for layer in cache.layers for t in vars(layer).values() if torch.is_tensor(t)]
        assert int(cache.column) == max(lengths) + 8
        for r, (s, n) in enumerate(zip(seqs, lengths)):
            full = model(s[None])[0]
            for j in range(9):
                torch.testing.assert_close(steps[j][r], full[n - 1 + j], atol=1e-9, rtol=0)


@pytest.mark.parametrize("name,kw", MODELS)
def test_greedy_equals_argmax_of_full_forward_and_batching_changes_nothing(name, kw):
    model = tiny_decoding_model(name, **kw)
    prompts = [torch.randint(0, 256, (n,)).tolist() for n in (3, 11, 1, 7)]
    gen = Generator(model, max_batch_size=3)  # two slices: 3 prompts, then 1
    batched = gen.generate(prompts, max_new_tokens=8)
    for p, c in zip(prompts, batched):
        assert c.tokens == greedy_by_full_forward(model, p, 8)
        assert c.finish_reason == "length" and c.text is None
    assert [gen.generate([p], max_new_tokens=8)[0].tokens for p in prompts] == [c.tokens for c in batched]


def test_sliding_window_generation_runs_past_the_window():
    model = tiny_decoding_model("swa_gdn2_tiny", sliding_window=4)
    prompt = torch.randint(0, 256, (6,)).tolist()
    out = Generator(model, max_batch_size=1).generate([prompt], max_new_tokens=12)[0]
    assert out.tokens == greedy_by_full_forward(model, prompt, 12)


def test_full_attention_overflow_is_an_error():
    model = tiny_decoding_model("transformer_tiny")
    gen = Generator(model, max_batch_size=1, max_length=16)
    with pytest.raises(ValueError, match="max_length"):
        gen.generate([[1] * 10], max_new_tokens=8)


def test_seeded_sampling_is_reproducible_and_top_k_1_is_greedy():
    model = tiny_decoding_model("swa_gdn2_tiny", sliding_window=6)
    prompts = [[5, 6, 7], [9]]
    gen = Generator(model, max_batch_size=2)
    kw = dict(max_new_tokens=8, temperature=1.5, top_p=0.9, seed=11)
    a, b = gen.generate(prompts, **kw), gen.generate(prompts, **kw)
    assert [c.tokens for c in a] == [c.tokens for c in b]
    c = gen.generate(prompts, max_new_tokens=8, temperature=1.5, seed=12)
    assert [x.tokens for x in c] != [x.tokens for x in a]
    top1 = gen.generate(prompts, max_new_tokens=8, temperature=2.0, top_k=1, seed=3)
    assert [x.tokens for x in top1] == [x.tokens for x in gen.generate(prompts, max_new_tokens=8)]


def test_filter_logits_top_k_and_top_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    kept = lambda t: torch.isfinite(t)[0].tolist()  # noqa: E731
    assert kept(filter_logits(logits, top_k=2)) == [True, True, False, False]
    assert kept(filter_logits(logits, top_p=0.5)) == [True, False, False, False]
    assert kept(filter_logits(logits, top_p=0.8)) == [True, True, False, False]
    assert kept(filter_logits(logits, top_p=0.81)) == [True, True, True, False]
    g = torch.Generator().manual_seed(0)
    draws = {int(sample_tokens(logits, SamplingParams(temperature=1.0, top_k=2), g)) for _ in range(50)}
    assert draws == {0, 1}


def test_stop_strings_and_eos(artifacts):
    _, tok, cfg = artifacts
    torch.manual_seed(0)
    model = GPT(cfg).double().eval()
    gen = Generator(model, tok, max_batch_size=2)
    free = gen.generate(["The river", "A map"], max_new_tokens=12)
    # stop at a string the free run produced: the text ends right before it
    text = free[0].text
    stop = text[len(text) // 2: len(text) // 2 + 2]
    cut = gen.generate(["The river", "A map"], max_new_tokens=12, stop=[stop])
    assert cut[0].finish_reason == "stop" and cut[0].text == text[: text.find(stop)]
    assert stop not in cut[0].text
    # force EOS after the first token: generation ends there, EOS not included
    calls = []

    def eos_from_second_call(module, inputs, out):
        calls.append(1)
        if len(calls) > 1:
            out = out.clone()
            out[..., tok.eos_id] = 1e9
        return out

    handle = model.lm_head.register_forward_hook(eos_from_second_call)
    try:
        ended = gen.generate(["The river"], max_new_tokens=12)[0]
    finally:
        handle.remove()
    assert ended.finish_reason == "eos" and ended.tokens == free[0].tokens[:1]


def test_bad_arguments_are_value_errors():
    with pytest.raises(ValueError, match="max_new_tokens"):
        SamplingParams(max_new_tokens=0)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    model = tiny_decoding_model("gdn2_tiny")
    with pytest.raises(ValueError, match="empty"):
        Generator(model).generate([[]])
    with pytest.raises(ValueError, match="tokenizer"):
        Generator(model).generate(["text"])


def test_decode_step_compiles_to_one_graph_per_layer_kind():
    """The cache writes are custom ops with declared mutations: torch.compile traces a whole block
    without graph breaks, and the compiled step updates the cache exactly like the eager one."""
    import torch._dynamo

    from gdn2.model import block_decode_step

    model = tiny_decoding_model("swa_gdn2_tiny", sliding_window=6)
    torch._dynamo.reset()
    compiled = torch.compile(block_decode_step, backend="aot_eager", fullgraph=True, dynamic=False)
    assert_compiled_decode_matches_eager(model, compiled)
    torch._dynamo.reset()
