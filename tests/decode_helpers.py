"""Helpers shared by the decoding tests: small float64 models with decisive logits, greedy reference."""

import torch

from gdn2.config import Config
from gdn2.model import GPT

# hybrid with a window shorter than the test sequences, pure GDN-2, full attention
DECODE_MODELS = [("swa_gdn2_tiny", dict(sliding_window=6, gdn2_recurrent_max_len=4)), ("gdn2_tiny", {}),
                 ("transformer_tiny", {})]


def tiny_decoding_model(name, **kw):
    """A 2-layer float64 model (vocab 256) in eval mode; the head is scaled so greedy choices are far
    from ties (a random init is nearly uniform)."""
    torch.manual_seed(0)
    m = GPT(Config.from_name(name, vocab_size=256, n_layer=2, **kw)).double().eval()
    with torch.no_grad():
        m.lm_head.weight.mul_(50.0)
    return m


def greedy_by_full_forward(model, prompt, n):
    """n greedy tokens after ``prompt``, each by a full forward pass over everything so far."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt):]


def assert_compiled_decode_matches_eager(model, compiled_step, weights=None, steps=8):
    """Prefill two prompts into two caches, then decode ``steps`` tokens with the eager and the compiled
    block step: logits and every cache tensor must agree (the window of 6 wraps the ring buffer)."""
    from gdn2.model import InferenceCache

    prompts = [torch.randint(0, 256, (n,)) for n in (5, 9)]
    eager_cache, compiled_cache = InferenceCache(model, 2, max_length=32), InferenceCache(model, 2, max_length=32)
    tokens = torch.tensor([3, 4])
    with torch.no_grad():
        model.prefill(prompts, eager_cache)
        model.prefill(prompts, compiled_cache)
        for _ in range(steps):
            expected = model.decode_step(tokens, eager_cache, weights=weights)
            got = model.decode_step(tokens, compiled_cache, block_step=compiled_step, weights=weights)
            torch.testing.assert_close(got, expected, atol=1e-12, rtol=0)
            tokens = expected.argmax(-1)
    for a, b in zip(eager_cache.layers, compiled_cache.layers):
        for name, t in vars(a).items():
            if torch.is_tensor(t):
                torch.testing.assert_close(getattr(b, name), t, atol=1e-12, rtol=0)
