"""FSDP builds the model on the meta device and materialises it unit by unit, calling
``reset_parameters()`` on every module that owns parameters (recurse=False). This replays that
procedure on CPU: every parameter must be re-initialised by its own module, with the eager init's scale."""

from collections import deque

import torch

from gdn2.config import Config
from gdn2.model import GPT

CONFIG = dict(block_size=64, vocab_size=512, n_layer=2, n_embd=128, n_head=4, intermediate_size=256,
              gdn2_per_layer=2, sliding_window=32, gdn2_num_heads=4, gdn2_head_dim=32, gdn2_gate_rank=16)


def materialise_like_fsdp(model: torch.nn.Module) -> None:
    queue = deque([model])
    with torch.no_grad():
        while queue:  # breadth first, as FSDP's _get_modules_to_materialize
            module = queue.popleft()
            queue.extend(module.children())
            own = list(module.parameters(recurse=False)) + list(module.buffers(recurse=False))
            if own:
                module.to_empty(device="cpu", recurse=False)
                for p in module.parameters(recurse=False):
                    p.fill_(float("nan"))  # anything reset_parameters leaves alone stays NaN
                module.reset_parameters()


def test_meta_materialisation_initialises_every_parameter_like_eager():
    torch.manual_seed(0)
    eager = dict(GPT(Config(**CONFIG)).named_parameters())
    with torch.device("meta"):
        model = GPT(Config(**CONFIG))
    materialise_like_fsdp(model)
    for name, p in model.named_parameters():
        ref = eager[name]
        assert p.shape == ref.shape and p.dtype == ref.dtype, name
        assert torch.isfinite(p).all(), f"{name} was not re-initialised by its module's reset_parameters()"
        if ref.min() == ref.max():  # constants (norm weights, zero biases)
            assert torch.equal(p, ref), name
        elif ref.numel() >= 512:
            assert abs(p.std().item() / ref.std().item() - 1) < 0.15, name
            assert abs(p.mean().item() - ref.mean().item()) < 4 * ref.std().item() / ref.numel() ** 0.5 + 1e-6, name
        else:
            lo, hi = ref.min().item(), ref.max().item()
            span = hi - lo
            assert lo - span <= p.min().item() and p.max().item() <= hi + span, name
