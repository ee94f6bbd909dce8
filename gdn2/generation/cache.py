"""The decoding state of a whole model: per layer its cache, and the columns the rows have reached."""

from __future__ import annotations

from typing import Optional, Union

import torch

from gdn2.layers.attention import AttentionCache
from gdn2.layers.gdn2 import GDN2Cache
from gdn2.model import GPT

__all__ = ["InferenceCache"]


class InferenceCache:
    """Per-layer decoding state: GDN-2 recurrent state + conv tails, attention ring buffers.

    ``column`` (a 0-d device tensor, which a captured decode step advances by itself) counts the
    columns already processed, i.e. it is the column of the next token. ``offsets`` [B] is the first
    column of each row: rows whose prompt is shorter than the longest one of the batch start later
    (:func:`prefill`), so row ``r`` holds position ``c - offsets[r]`` in column ``c``. All zeros
    unless prompts of different lengths were prefilled together (``ragged``).
    """

    def __init__(self, model: GPT, batch_size: int, device: Optional[torch.device] = None,
                 dtype: Optional[torch.dtype] = None, max_length: Optional[int] = None) -> None:
        p = next(model.parameters())
        device = device or p.device
        dtype = dtype or p.dtype
        self.max_length = max_length or model.config.block_size
        self.batch_size = batch_size
        self.layers: list[Union[GDN2Cache, AttentionCache]] = []
        for block in model.transformer.h:
            if block.kind == "gdn2":
                self.layers.append(block.mixer.init_cache(batch_size, device, dtype))
            else:
                self.layers.append(block.mixer.init_cache(batch_size, device, dtype, self.max_length))
        self.column = torch.zeros((), dtype=torch.long, device=device)
        self.offsets = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.ragged = False  # True once rows start in different columns

    def reset(self) -> None:
        """Empty every layer in place: tensors a CUDA graph captured remain the ones in use."""
        for layer in self.layers:
            layer.reset()
        self.column.zero_()
        self.offsets.zero_()
        self.ragged = False

    def rows(self, n: int) -> "InferenceCache":
        """A cache over the first ``n`` rows sharing this one's memory (column counter included)."""
        if not 1 <= n <= self.batch_size:
            raise ValueError(f"rows: n must be in [1, {self.batch_size}], got {n}")
        view = object.__new__(InferenceCache)
        view.max_length, view.batch_size = self.max_length, n
        view.layers = [layer.rows(n) for layer in self.layers]
        view.column, view.offsets, view.ragged = self.column, self.offsets[:n], self.ragged
        return view

    def full_attention(self) -> bool:
        return any(isinstance(c, AttentionCache) and c.full_attention for c in self.layers)
