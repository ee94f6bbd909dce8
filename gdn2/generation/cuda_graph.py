"""One decode step captured in a CUDA graph: a token costs one graph launch."""

from __future__ import annotations

from typing import Any, Optional

import torch

from gdn2.generation.cache import InferenceCache
from gdn2.generation.decode import DecodePieces, DecodeWeights, decode_step
from gdn2.model import GPT

__all__ = ["CapturedDecodeStep"]


class CapturedDecodeStep:
    """:func:`gdn2.generation.decode.decode_step` for one cache, captured in a CUDA graph: static token input,
    static logits.

    ``block_step`` and ``weights`` are passed on to ``decode_step``; the graph reads ``weights``'
    tensors where they are, so an in-place ``weights.refresh()`` reaches it, a reallocation does not.
    The cache is scribbled on while warming up; it must be reset before use (Generator does).
    """

    def __init__(self, model: GPT, cache: InferenceCache, pool: Optional[Any] = None,
                 block_step: Optional[DecodePieces] = None, weights: Optional[DecodeWeights] = None) -> None:
        device = cache.column.device
        self.tokens = torch.zeros(cache.batch_size, dtype=torch.long, device=device)
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side), torch.no_grad():
            for _ in range(3):  # compilation, autotuning and lazy initialisation stay out of the capture
                decode_step(model, self.tokens, cache, weights, block_step)
        torch.cuda.current_stream(device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool), torch.no_grad():
            self.logits = decode_step(model, self.tokens, cache, weights, block_step)

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        self.tokens.copy_(tokens)
        self.graph.replay()
        return self.logits
