"""Generator on the fused decode-time weights: the same tokens as the unfused path and as repeated
full forward passes, also after the model's weights change between calls; the compile switch."""

import pytest
import torch

from gdn2.generate import Generator, main
from gdn2.model import compiled_block_step
from decode_helpers import (DECODE_MODELS, assert_compiled_decode_matches_eager, greedy_by_full_forward,
                            tiny_decoding_model)

MODELS = DECODE_MODELS


@pytest.mark.parametrize("name,kw", MODELS)
def test_fused_and_unfused_generators_agree_with_the_full_forward(name, kw):
    model = tiny_decoding_model(name, **kw)
    prompts = [torch.randint(0, 256, (n,)).tolist() for n in (3, 11, 1, 7)]
    fused = Generator(model, max_batch_size=4)
    plain = Generator(model, max_batch_size=4, fused=False)
    assert fused.fused and not plain.fused and not fused.compile  # CPU: not compiled by default
    got = fused.generate(prompts, max_new_tokens=6)
    assert [c.tokens for c in got] == [c.tokens for c in plain.generate(prompts, max_new_tokens=6)]
    assert [c.tokens for c in got] == [greedy_by_full_forward(model, p, 6) for p in prompts]
    assert plain._weights is None and fused._weights is not None
    fused.release()
    assert fused._weights is None


def test_generator_follows_weight_changes_between_calls():
    """A Generator kept across training steps and checkpoint loads decodes with the current weights."""
    model = tiny_decoding_model("swa_gdn2_tiny", sliding_window=6)
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


def test_compiled_fused_step_traces_whole_and_matches_eager():
    """Every compiled piece (inputs, one block step per layer kind, head) traces without graph breaks
    (fullgraph) into one graph per piece at a batch size, and gives the eager fused step's logits."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    model = tiny_decoding_model("swa_gdn2_tiny", sliding_window=6)
    weights = model.prepare_decoding()
    torch._dynamo.reset()
    counters.clear()
    compiled = compiled_block_step("aot_eager", fullgraph=True)
    assert_compiled_decode_matches_eager(model, compiled, weights)
    assert counters["stats"]["unique_graphs"] == 4  # inputs, gdn2 block, attention block, head
    torch._dynamo.reset()


# importing inductor (torch.compile's default backend) warns about torch.jit internals it uses
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
def test_compile_switch_and_cli_flags(monkeypatch):
    model = tiny_decoding_model("gdn2_tiny")
    assert Generator(model).compile is False  # CPU decoding stays uncompiled by default
    gen = Generator(model, compile=True)
    assert gen.compile and gen._block_step is compiled_block_step()
    seen = {}

    class Recorder(Generator):
        def __init__(self, *args, **kwargs):
            seen.update(kwargs)
            raise SystemExit(0)

    import gdn2.generate as module

    monkeypatch.setattr(module, "Generator", Recorder)
    monkeypatch.setattr(module, "load_model", lambda *a, **k: type("L", (), {"model": model, "tokenizer": None})())
    for argv, expected in ((["--no-compile", "--no-fused"], (False, False)), (["--compile"], (True, True)),
                           ([], (None, True))):
        seen.clear()
        with pytest.raises(SystemExit):
            main(["--checkpoint", "x", "--prompt", "p"] + argv)
        assert (seen["compile"], seen["fused"]) == expected
