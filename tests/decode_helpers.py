"""Helpers shared by the decoding tests: small float64 models with decisive logits, greedy reference."""

import torch

from gdn2.config import Config
from gdn2.model import GPT


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
