"""gdn2/generation/generator.py: greedy generation is the argmax of repeated full forward passes,
whatever the batching; seeded sampling, stop strings, EOS; weights followed between calls."""

import pytest
import torch

from gdn2.generation import Generator
from gdn2.generation.decode import compiled_block_step
from decode_helpers import greedy_by_full_forward, tiny_decoding_model


class CharTokenizer:
    """Token t is the character chr(32 + t % 95): texts grow by one character per token."""

    vocab_size, eos_id, path = 256, 2, "chars"

    def encode(self, text):
        return [ord(c) - 32 for c in text]

    def decode(self, ids):
        return "".join(chr(32 + t % 95) for t in ids)


@pytest.fixture
def model():
    return tiny_decoding_model("swa_gdn2_tiny", sliding_window=6)


def test_greedy_is_the_full_forward_argmax_whatever_the_batching(model):
    prompts = [torch.randint(0, 256, (n,)).tolist() for n in (3, 11, 1, 7)]
    gen = Generator(model, max_batch_size=3)  # two slices: 3 prompts (right-aligned), then 1
    assert gen.fused and not gen.compile  # the defaults on a CPU
    batched = gen.generate(prompts, max_new_tokens=8)
    for p, c in zip(prompts, batched):
        assert c.tokens == greedy_by_full_forward(model, p, 8)
        assert c.finish_reason == "length" and c.text is None
    assert [gen.generate([p], max_new_tokens=8)[0].tokens for p in prompts] == [c.tokens for c in batched]
    plain = Generator(model, max_batch_size=4, fused=False)
    assert [c.tokens for c in plain.generate(prompts, max_new_tokens=8)] == [c.tokens for c in batched]
    assert plain._weights is None and gen._weights is not None
    gen.release()
    assert gen._weights is None and gen._cache is None


def test_seeded_sampling_is_reproducible_and_top_k_1_is_greedy(model):
    prompts = [[5, 6, 7], [9]]
    gen = Generator(model, max_batch_size=2)
    kw = dict(max_new_tokens=8, temperature=1.5, top_p=0.9, seed=11)
    a, b = gen.generate(prompts, **kw), gen.generate(prompts, **kw)
    assert [c.tokens for c in a] == [c.tokens for c in b]
    c = gen.generate(prompts, max_new_tokens=8, temperature=1.5, seed=12)
    assert [x.tokens for x in c] != [x.tokens for x in a]
    top1 = gen.generate(prompts, max_new_tokens=8, temperature=2.0, top_k=1, seed=3)
    assert [x.tokens for x in top1] == [x.tokens for x in gen.generate(prompts, max_new_tokens=8)]


def test_stop_strings_and_eos(model):
    gen = Generator(model, CharTokenizer(), max_batch_size=2)
    free = gen.generate(["The river", "A map"], max_new_tokens=12)
    assert free[0].text == CharTokenizer().decode(free[0].tokens)
    # stop at a string the free run produced: the text ends right before it
    text = free[0].text
    stop = text[len(text) // 2: len(text) // 2 + 2]
    cut = gen.generate(["The river", "A map"], max_new_tokens=12, stop=[stop])
    assert cut[0].finish_reason == "stop" and cut[0].text == text[: text.find(stop)]
    # force EOS after the first token: generation ends there, EOS not included
    calls = []

    def eos_from_second_call(module, inputs, out):
        calls.append(1)
        if len(calls) > 1:
            out = out.clone()
            out[..., CharTokenizer.eos_id] = 1e9
        return out

    handle = model.lm_head.register_forward_hook(eos_from_second_call)
    try:
        ended = gen.generate(["The river"], max_new_tokens=12)[0]
    finally:
        handle.remove()
    assert ended.finish_reason == "eos" and ended.tokens == free[0].tokens[:1]


def test_generator_follows_weight_changes_between_calls(model):
    """A Generator kept across (fused) optimizer steps and checkpoint loads decodes the current weights."""
    gen = Generator(model, max_batch_size=2)
    prompts = [[5, 6, 7, 8], [9, 10]]
    first = gen.generate(prompts, max_new_tokens=6)
    kept = gen._weights

    opt = torch.optim.AdamW(model.parameters(), lr=0.05, fused=True)
    for _ in range(3):
        model.train()
        idx = torch.randint(0, 256, (2, 12))
        torch.nn.functional.cross_entropy(model(idx[:, :-1]).flatten(0, 1), idx[:, 1:].flatten()).backward()
        opt.step()
        opt.zero_grad()
    model.eval()
    trained = gen.generate(prompts, max_new_tokens=6)
    assert [c.tokens for c in trained] == [greedy_by_full_forward(model, p, 6) for p in prompts]
    assert [c.tokens for c in trained] != [c.tokens for c in first]

    other = tiny_decoding_model("swa_gdn2_tiny", sliding_window=6)
    with torch.no_grad():
        for p in other.parameters():
            p.copy_(torch.randn_like(p) * p.std().clamp_min(1e-3) + p.mean())
    model.load_state_dict(other.state_dict())
    loaded = gen.generate(prompts, max_new_tokens=6)
    assert [c.tokens for c in loaded] == [greedy_by_full_forward(other, p, 6) for p in prompts]
    assert gen._weights is kept  # refreshed in place, not rebuilt


# importing inductor (torch.compile's default backend) warns about torch.jit internals it uses
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
def test_bad_arguments_are_value_errors_and_compile_is_shared(model):
    with pytest.raises(ValueError, match="empty"):
        Generator(model).generate([[]])
    with pytest.raises(ValueError, match="tokenizer"):
        Generator(model).generate(["text"])
    with pytest.raises(ValueError, match="tokenizer"):
        Generator(model).generate([[1]], stop=["x"])
    full = tiny_decoding_model("transformer_tiny")
    with pytest.raises(ValueError, match="max_length"):
        Generator(full, max_batch_size=1, max_length=16).generate([[1] * 10], max_new_tokens=8)
    assert Generator(model, compile=True)._block_step is compiled_block_step()  # one per process


def test_completion_text_is_what_follows_the_prompt_text_with_its_leading_space(artifacts):
    """SentencePiece decodes a leading word-boundary piece without its space; the completion's text
    keeps it (a real tokenizer), also when cut at a stop string during generation."""
    from gdn2.checkpoint.load import load_model

    folder, tok, _ = artifacts
    loaded = load_model(folder / "model.pt", device="cpu", dtype="float32")
    forced = tok.encode("of the same")  # pieces "\u2581of", ...: each starts a word
    assert tok.processor.IdToPiece(forced[0]).startswith("\u2581") and not tok.decode(forced).startswith(" ")
    calls = []

    def force_next(module, inputs, out):  # the t-th lm_head call picks forced[t] (then EOS)
        out = torch.full_like(out, -1e9)
        out[..., forced[len(calls)] if len(calls) < len(forced) else tok.eos_id] = 1e9
        calls.append(1)
        return out

    handle = loaded.model.lm_head.register_forward_hook(force_next)
    try:
        gen = Generator(loaded.model, loaded.tokenizer, max_batch_size=1)
        free = gen.generate(["In the beginning"], max_new_tokens=6)[0]
        calls.clear()
        cut = gen.generate(["In the beginning"], max_new_tokens=6, stop=[" the"])[0]
    finally:
        handle.remove()
    assert free.tokens == forced and free.finish_reason == "eos"
    assert "In the beginning" + free.text == "In the beginning of the same"
    assert cut.text == " of" and cut.finish_reason == "stop"
