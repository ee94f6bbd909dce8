"""AdamW with two parameter groups: decayed matrices / embeddings, and everything exempt from decay.

Exempt: 1-D parameters (norm weights, biases) and parameters marked ``_no_weight_decay`` (GDN-2's
``A_log``, ``dt_bias``). The decision is taken on the unwrapped model, by name: FSDP flattens and
re-creates parameters, which loses both their shapes and their attributes.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn as nn

from gdn2.checkpoint.format import bare_parameter_name
from gdn2.train.recipe import OptimizerConfig

def no_weight_decay_names(model: nn.Module) -> set[str]:
    """Names (in the bare ``model``) of the parameters exempt from weight decay."""
    return {bare_parameter_name(n) for n, p in model.named_parameters()
            if p.ndim < 2 or getattr(p, "_no_weight_decay", False)}


def parameter_groups(named_parameters: Iterable[tuple[str, nn.Parameter]], no_decay: set[str],
                     weight_decay: float, decay_all: bool = False) -> list[dict]:
    """Two AdamW groups, ``decay`` then ``no_decay`` (empty ones dropped), in parameter order.

    ``decay_all`` gives the no-decay group the same weight decay (the reference's behaviour) while
    keeping the group layout, so the optimizer state stays compatible either way.
    """
    decay, exempt = [], []
    seen = set()
    for name, p in named_parameters:
        if not p.requires_grad:
            continue
        clean = bare_parameter_name(name)
        seen.add(clean)
        (exempt if clean in no_decay else decay).append(p)
    missing = no_decay - seen
    if missing:
        raise ValueError(f"no_decay names not found among the model's parameters: {sorted(missing)[:5]}")
    groups = [
        {"params": decay, "weight_decay": weight_decay, "name": "decay"},
        {"params": exempt, "weight_decay": weight_decay if decay_all else 0.0, "name": "no_decay"},
    ]
    return [g for g in groups if g["params"]]


def build_optimizer(model: nn.Module, no_decay: set[str], cfg: OptimizerConfig, device_type: str) -> torch.optim.AdamW:
    """AdamW over ``model`` (possibly wrapped) with the groups of :func:`parameter_groups`."""
    fused = cfg.fused if cfg.fused is not None else device_type == "cuda"
    groups = parameter_groups(model.named_parameters(), no_decay, cfg.weight_decay, cfg.decay_all)
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, fused=fused or None)
