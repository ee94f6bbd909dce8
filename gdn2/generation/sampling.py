"""Picking the next token: greedy, or temperature with top-k / nucleus filtering; when to stop."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

__all__ = ["SamplingParams", "filter_logits", "sample_tokens"]


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop.

    ``temperature == 0`` is greedy decoding; otherwise logits / temperature, then top-k (0 = off)
    and nucleus top-p (1.0 = off) filtering, then a draw from ``torch.Generator`` seeded with ``seed``
    (None: the global generator). A row stops at EOS (``stop_at_eos``), when its text contains one of
    ``stop`` (the text is cut before it), or after ``max_new_tokens``.
    """

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    stop: Sequence[str] = ()
    stop_at_eos: bool = True
    seed: Optional[int] = None

    def __post_init__(self) -> None:
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive int, got {self.max_new_tokens!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0 = off), got {self.top_k!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if isinstance(self.stop, str):
            self.stop = (self.stop,)
        self.stop = tuple(s for s in self.stop if s)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def filter_logits(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Set to -inf every logit outside the top ``top_k`` and outside the smallest set whose probability
    reaches ``top_p`` (the most likely token always stays). logits: float [B, V] -> [B, V]."""
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # drop a token when the tokens ranked above it already reach top_p
        drop_sorted = (probs.cumsum(-1) - probs) >= top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample_tokens(logits: torch.Tensor, params: SamplingParams,
                  generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """Next token per row: logits [B, V] (any float dtype) -> int64 [B]."""
    if params.greedy:
        return logits.argmax(-1)
    scaled = filter_logits(logits.float() / params.temperature, params.top_k, params.top_p)
    probs = torch.softmax(scaled, dim=-1)
    return torch.multinomial(probs, 1, generator=generator)[:, 0]
