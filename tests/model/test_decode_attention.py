"""The model's decode step with the attention layers on the ring-buffer decode kernel (Triton's
interpreter on the CPU) against the full forward pass."""

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


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
