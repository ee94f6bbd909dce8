"""Schedules counted in optimizer steps: the learning rate, and when a periodic job (validation,
lm-eval, checkpoint) runs."""

from __future__ import annotations

import math


def cosine_with_warmup(step: int, max_lr: float, warmup_steps: int, total_steps: int, min_lr: float) -> float:
    """Learning rate of optimizer step ``step`` (0-based).

    Linear warmup over ``warmup_steps`` (step 0 gets ``max_lr / warmup_steps``, step ``warmup_steps - 1``
    gets ``max_lr``), then a half cosine from ``max_lr`` down to ``min_lr`` at ``total_steps``; after
    that, ``min_lr``.
    """
    if total_steps <= 0:
        raise ValueError(f"total_steps must be positive, got {total_steps}")
    if not 0 <= warmup_steps <= total_steps:
        raise ValueError(f"warmup_steps must be in [0, total_steps={total_steps}], got {warmup_steps}")
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if step < warmup_steps:
        return max_lr * (step + 1) / warmup_steps
    if step >= total_steps:
        return min_lr
    decay_steps = total_steps - warmup_steps
    progress = (step - warmup_steps) / decay_steps
    return min_lr + 0.5 * (max_lr - min_lr) * (1.0 + math.cos(math.pi * progress))


def due(interval: int, at_end: bool, step: int, max_steps: int, end: bool) -> bool:
    """The schedule of every periodic job: every ``interval`` steps during training (``interval`` 0:
    never), leaving the last step to the end-of-training run when ``at_end`` is on; at the end
    (``end``), when ``at_end``."""
    if end:
        return at_end
    return bool(interval) and step % interval == 0 and not (step == max_steps and at_end)
