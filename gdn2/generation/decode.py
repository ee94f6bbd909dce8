"""Cached inference on a :class:`gdn2.model.GPT`: prefill, cached steps and the decode weights.

Every path runs the model's own blocks and layers (``Block.branches``), each layer's forward taking
its part of an :class:`gdn2.generation.cache.InferenceCache`:

- :func:`prefill`: prompts of any lengths packed into one row and run as separate documents, their
  states written to one cache row each, right-aligned (all prompts end in the same column);
- :func:`extend`: more tokens for every row of a cache whose rows are aligned (continued prefill);
- :func:`decode_step`: one token per row, every update in place and no host synchronisation, so a
  CUDA graph can capture it; optionally on :class:`DecodeWeights` (the blocks' decode layouts:
  fused weight copies) and with its pieces compiled (:func:`compiled_block_step`).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any, Callable, Optional

import torch

from gdn2.generation.cache import InferenceCache
from gdn2.layers.attention import AttentionCache
from gdn2.layers.gdn2 import GDN2Cache
from gdn2.layout import PackedPrompts, TokenLayout
from gdn2.model import GPT, Block, BlockWeights

__all__ = ["prefill", "extend", "decode_step", "DecodeWeights", "DecodePieces", "compiled_block_step"]


def _head(model: GPT, x: torch.Tensor) -> torch.Tensor:
    return model.lm_head(model.transformer.ln_f(x))


@torch.no_grad()
def prefill(model: GPT, prompts: list[torch.Tensor], cache: InferenceCache) -> torch.Tensor:
    """Run prompts of any lengths through the model in one packed pass and fill an empty ``cache``.

    prompts: ``cache.batch_size`` int64 1-D tensors (>= 1 token each). They are concatenated and
    processed as separate documents (``cu_seqlens``), so each prompt sees exactly what it would
    alone, with no padding; their states then go to cache row ``i``, right-aligned (see
    :class:`InferenceCache`). Returns the logits of each prompt's last token [B, vocab_size].
    """
    if len(prompts) != cache.batch_size:
        raise ValueError(f"prefill: got {len(prompts)} prompts for a cache of {cache.batch_size} rows")
    if int(cache.column) != 0:
        raise ValueError("prefill needs an empty cache (call cache.reset())")
    device = model.lm_head.weight.device
    packed = PackedPrompts.from_lengths([int(p.numel()) for p in prompts], device)
    if cache.full_attention() and packed.num_columns > cache.max_length:
        raise ValueError(f"prompt of {packed.num_columns} tokens exceeds the cache's max_length {cache.max_length}")
    idx = torch.cat([p.reshape(-1) for p in prompts]).to(device=device, dtype=torch.long)[None]
    x = model.transformer.wte(idx)
    layout = TokenLayout.of_prefill(packed)
    for block, layer in zip(model.transformer.h, cache.layers):
        x, delta = block.branches(x, layout, cache=layer)
        x = x + delta
    cache.column.fill_(packed.num_columns)
    cache.offsets.copy_(packed.offsets)
    cache.ragged = min(int(p.numel()) for p in prompts) != packed.num_columns
    return _head(model, x[0, packed.last])


def extend(model: GPT, idx: torch.Tensor, cache: InferenceCache) -> torch.Tensor:
    """idx int64 [B,T]: T more tokens for every row, after what ``cache`` holds (updated in place).
    Returns logits [B,T,vocab_size]. The rows must be aligned (an empty cache, or prompts of one
    length); a ragged cache continues with :func:`decode_step`."""
    B, T = idx.shape
    if cache.ragged:
        raise ValueError("this cache holds prompts of different lengths: continue with decode_step")
    start = int(cache.column)
    if cache.full_attention() and start + T > cache.max_length:
        raise ValueError(f"sequence of {start + T} tokens exceeds the cache's max_length {cache.max_length}")
    positions = torch.arange(start, start + T, device=idx.device)
    x = model.transformer.wte(idx)
    layout = TokenLayout(positions)
    for block, layer in zip(model.transformer.h, cache.layers):
        x, delta = block.branches(x, layout, cache=layer)
        x = x + delta
    cache.column.add_(T)
    return _head(model, x)


# --------------------------------------------------------------------------------------------------
# Decode weights: the blocks' decode layouts, kept up to date
# --------------------------------------------------------------------------------------------------

def _signature(tensors: list[torch.Tensor]) -> tuple:
    """Per tensor its layout (dtype, shape, device: what the fused buffers depend on), then what changes
    when it is written in place (version counter) or replaced (identity, memory)."""
    return tuple(((t.dtype, t.shape, t.device), id(t), t.data_ptr(), t._version) for t in tensors)


class DecodeWeights:
    """Decode-time copies of a GPT's weights in a fused layout: per GDN-2 block a :class:`FusedGDN2`,
    per MLP one [w1 | w2] matrix. The parameters (names, shapes, the training forward) are untouched;
    the copies (``nbytes``: about 0.55x the weight bytes of ``swa_gdn2_1.3B``) are freed with this object.

    The copies are a snapshot. :meth:`refresh` copies the parameters again, into the same buffers
    when shapes and dtypes still match (so captured CUDA graphs stay valid); the Generator does so at
    the start of every ``generate`` call. Between refreshes, :func:`decode_step` refuses copies whose
    source parameters were replaced or written in place (their identities and version counters,
    :meth:`stale_blocks`); writes that leave no trace there (fused optimizer steps, ``p.data``) are
    seen by no check, only undone by :meth:`refresh`.
    """

    def __init__(self, model: GPT) -> None:
        self.model = model
        blocks = list(model.transformer.h)
        self.blocks: list[BlockWeights] = [b.decode_weights() for b in blocks]
        self._signatures = [_signature(BlockWeights.sources(b)) for b in blocks]

    def stale_blocks(self) -> list[int]:
        """Indices of the blocks whose source parameters were replaced or written in place since the
        last copy (see the class doc for the writes this cannot see)."""
        blocks = list(self.model.transformer.h)
        if len(blocks) != len(self.blocks):
            raise ValueError(f"the model has {len(blocks)} blocks, these decode weights {len(self.blocks)}: "
                             "make them again with DecodeWeights(model)")
        return [i for i, b in enumerate(blocks) if _signature(BlockWeights.sources(b)) != self._signatures[i]]

    def refresh(self) -> bool:
        """Copy every block again, into its old buffers while its parameters keep their shapes, dtypes
        and devices. Returns True when some block had to be reallocated: steps captured over the old
        tensors, e.g. CUDA graphs, must then be captured again."""
        reallocated = False
        for i, block in enumerate(self.model.transformer.h):
            signature = _signature(BlockWeights.sources(block))
            if [s[0] for s in signature] == [s[0] for s in self._signatures[i]]:
                self.blocks[i].copy_from(block)
            else:
                self.blocks[i] = block.decode_weights()
                reallocated = True
            self._signatures[i] = signature
        return reallocated

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for b in self.blocks for t in b.tensors())


# --------------------------------------------------------------------------------------------------
# The decode step
# --------------------------------------------------------------------------------------------------

def _decode_layout(model: GPT, cache: InferenceCache) -> TokenLayout:
    """A decode step's layout: each row's position, and what every attention layer shares (they have one
    window, head size and ring layout, and their slot positions are always equal), computed once."""
    positions = cache.column - cache.offsets
    for block, layer in zip(model.transformer.h, cache.layers):
        if isinstance(layer, AttentionCache):
            return TokenLayout(positions, step=block.mixer.step_values(layer, cache.column, cache.offsets))
    return TokenLayout(positions)


def decode_inputs(model: GPT, tokens: torch.Tensor, cache: InferenceCache
                  ) -> tuple[torch.Tensor, torch.Tensor, TokenLayout]:
    """The start of a decode step: token embeddings x [B,1,d] as the residual pair (x, 0) that the
    blocks pass on (see :meth:`Block.branches`), and the step's layout."""
    x = model.transformer.wte(tokens)[:, None]
    return x, torch.zeros_like(x), _decode_layout(model, cache)


def decode_head(model: GPT, x: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """The end of a decode step: final norm and head of x + delta [B,1,d] -> logits [B, vocab_size]."""
    return _head(model, x + delta)[:, 0]


# One function per layer kind: torch.compile keeps its graphs per function (code object), and each
# function may hold at most ``torch._dynamo.config.recompile_limit`` (8) of them, one per batch size.
def _gdn2_block_step(block: Block, x: torch.Tensor, delta: torch.Tensor, layout: TokenLayout, cache: GDN2Cache,
                     fused: Optional[BlockWeights]) -> tuple[torch.Tensor, torch.Tensor]:
    return block.branches(x + delta, layout, cache=cache, fused=fused)


def _attention_block_step(block: Block, x: torch.Tensor, delta: torch.Tensor, layout: TokenLayout,
                          cache: AttentionCache, fused: Optional[BlockWeights]) -> tuple[torch.Tensor, torch.Tensor]:
    return block.branches(x + delta, layout, cache=cache, fused=fused)


class DecodePieces:
    """The pieces of :func:`decode_step`: ``inputs`` (:func:`decode_inputs`), one block step per layer
    kind (calling the object runs one block on the residual pair) and ``head`` (:func:`decode_head`),
    each passed through ``wrap`` (``torch.compile`` in :func:`compiled_block_step`)."""

    def __init__(self, wrap: Callable[[Callable[..., Any]], Callable[..., Any]] = lambda fn: fn) -> None:
        self.blocks = {"gdn2": wrap(_gdn2_block_step), "attention": wrap(_attention_block_step)}
        self.inputs = wrap(decode_inputs)
        self.head = wrap(decode_head)

    def __call__(self, block: Block, x: torch.Tensor, delta: torch.Tensor, layout: TokenLayout, cache: Any,
                 fused: Optional[BlockWeights] = None) -> tuple[torch.Tensor, torch.Tensor]:
        return self.blocks[block.kind](block, x, delta, layout, cache, fused)


EAGER = DecodePieces()


@lru_cache(maxsize=None)
def compiled_block_step(backend: str = "inductor", fullgraph: bool = False) -> DecodePieces:
    """The process-wide compiled :class:`DecodePieces` for ``backend`` (static shapes): every caller
    shares its graphs, so each (piece, batch size) compiles once per process, in seconds. Up to 8
    batch sizes per function stay compiled (dynamo's recompile limit); beyond that dynamo warns and
    runs the extra ones eagerly."""
    return DecodePieces(lambda fn: torch.compile(fn, backend=backend, fullgraph=fullgraph, dynamic=False))


def decode_step(model: GPT, tokens: torch.Tensor, cache: InferenceCache, weights: Optional[DecodeWeights] = None,
                block_step: Optional[DecodePieces] = None) -> torch.Tensor:
    """One token per row: tokens int64 [B] -> logits [B, vocab_size].

    Every cache update happens in place and nothing waits for the host, so a CUDA graph can capture
    this call and replay it. The token goes to column ``cache.column``, advanced here on the device;
    the caller checks that a full-attention cache has room. ``weights``: run on these fused copies
    (the same logits, fewer kernels); stale ones are a ValueError (``weights.refresh()`` updates
    them). ``block_step``: the pieces to run (default eager; :func:`compiled_block_step`).
    """
    if weights is not None and not torch.compiler.is_compiling():
        if weights.model is not model:
            raise ValueError("weights were prepared for another model")
        stale = weights.stale_blocks()
        if stale:
            raise ValueError(f"decode weights of blocks {stale} are stale (the parameters changed after they "
                             "were copied): call weights.refresh()")
    pieces = block_step or EAGER
    fused = weights.blocks if weights is not None else [None] * len(cache.layers)
    x, delta, layout = pieces.inputs(model, tokens, cache)
    for block, layer, layer_fused in zip(model.transformer.h, cache.layers, fused):
        x, delta = pieces(block, x, delta, layout, layer, layer_fused)
    logits = pieces.head(model, x, delta)
    cache.column.add_(1)
    return logits
