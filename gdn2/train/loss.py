"""The loss of a micro-batch; the cross-entropy functions themselves live in ``gdn2.loss``."""

from __future__ import annotations

import torch


def to_device(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def forward_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor], chunk_tokens: int) -> torch.Tensor:
    """Mean next-token loss of one micro-batch (``input_ids``, ``labels``, optional ``cu_seqlens``),
    computed by the model (``GPT.forward`` with labels)."""
    return model(batch["input_ids"], cu_seqlens=batch.get("cu_seqlens"), labels=batch["labels"],
                 loss_chunk_tokens=chunk_tokens)
