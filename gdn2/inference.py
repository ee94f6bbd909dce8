"""Inference on a :class:`gdn2.model.GPT`: the cache, prefill, cached steps and the fused decode weights.

Every path runs the model's own blocks and layers (``Block.branches``), each layer's forward taking
the optional cache:

- :func:`prefill`: prompts of any lengths packed into one row and run as separate documents, their
  states written to one cache row each, right-aligned (all prompts end in the same column);
- :func:`extend`: more tokens for every row of a cache whose rows are aligned (continued prefill);
- :func:`decode_step`: one token per row, every update in place and no host synchronisation, so a
  CUDA graph can capture it; optionally on :class:`DecodeWeights` (fused weight copies) and with its
  pieces compiled (:func:`compiled_block_step`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Callable, Optional, Union

import torch
import torch.nn.functional as F

from gdn2.layers.attention import AttentionCache, rope_tables
from gdn2.layers.decoding import DecodeContext
from gdn2.layers.gdn2 import GatedDeltaNet2, GDN2Cache
from gdn2.layers.packed import PackedPrompts
from gdn2.model import GPT, Block

__all__ = ["InferenceCache", "prefill", "extend", "decode_step", "DecodeWeights", "BlockWeights", "FusedGDN2",
           "DecodePieces", "compiled_block_step"]


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
    for block, layer in zip(model.transformer.h, cache.layers):
        x, delta = block.branches(x, packed.pos_in_doc, packed.cu_seqlens, packed.pos_in_doc, cache=layer,
                                  packed=packed)
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
    for block, layer in zip(model.transformer.h, cache.layers):
        x, delta = block.branches(x, positions, cache=layer)
        x = x + delta
    cache.column.add_(T)
    return _head(model, x)


# --------------------------------------------------------------------------------------------------
# Fused decode weights
# --------------------------------------------------------------------------------------------------

def _first_stage(layer: GatedDeltaNet2) -> list[torch.nn.Linear]:
    """The projections of the layer input, in the row order of ``FusedGDN2.in_proj``."""
    return [layer.q_proj, layer.k_proj, layer.v_proj, layer.b_proj, layer.w_proj, layer.f_proj[0], layer.g_proj[0]]


@dataclass
class FusedGDN2:
    """Copies of one GDN-2 layer's input projections in a layout for few-token steps: the seven input
    projections as one GEMM, the two low-rank second stages as one, the three short convs as one."""

    # [2*key_dim + value_dim + key_dim + value_dim + 2*rank, d]: the rows of q_proj | k_proj | v_proj |
    # b_proj | w_proj | f_proj[0] | g_proj[0]
    in_proj: torch.Tensor
    # [key_dim + value_dim, 2*rank] block diagonal: f_proj[1] on the decay's hidden units, g_proj[1] on
    # the gate's; ``low_rank_bias`` is 0 | g_proj[1].bias
    low_rank: torch.Tensor
    low_rank_bias: torch.Tensor
    conv: torch.Tensor  # [2*key_dim + value_dim, 1, conv_size]: taps of q | k | v, GDN2Cache.conv's order
    key_dim: int
    value_dim: int

    @classmethod
    def of(cls, layer: GatedDeltaNet2) -> "FusedGDN2":
        """New buffers in this layout, filled from ``layer``'s parameters (in their dtype and device)."""
        ref, first = layer.q_proj.weight, _first_stage(layer)
        names = ("q_proj", "k_proj", "v_proj", "b_proj", "w_proj", "f_proj.0", "g_proj.0", "f_proj.1", "g_proj.1")
        for name, lin in zip(names, first + [layer.f_proj[1], layer.g_proj[1]]):
            if lin.weight.dtype != ref.dtype or lin.weight.device != ref.device:
                raise ValueError(f"layer {layer.layer_idx}: {name}.weight is {lin.weight.dtype} on "
                                 f"{lin.weight.device}, q_proj.weight {ref.dtype} on {ref.device}: the fused "
                                 "decode projections need one dtype and device")
            if lin in first and lin.bias is not None:
                raise ValueError(f"layer {layer.layer_idx}: {name} has a bias, which the fused input GEMM omits")
        Kd, Vd, r = layer.key_dim, layer.value_dim, layer.f_proj[1].in_features
        fused = cls(ref.new_empty(3 * Kd + 2 * Vd + 2 * r, ref.shape[1]), ref.new_zeros(Kd + Vd, 2 * r),
                    ref.new_zeros(Kd + Vd), ref.new_empty(2 * Kd + Vd, 1, layer.conv_size), Kd, Vd)
        fused.copy_from(layer)
        return fused

    @torch.no_grad()
    def copy_from(self, layer: GatedDeltaNet2) -> None:
        """Copy ``layer``'s parameters into these buffers (the zero blocks stay zero)."""
        f1, g1 = layer.f_proj[1], layer.g_proj[1]
        Kd, r = self.key_dim, f1.in_features
        torch.cat([lin.weight for lin in _first_stage(layer)], dim=0, out=self.in_proj)
        self.low_rank[:Kd, :r].copy_(f1.weight)
        self.low_rank[Kd:, r:].copy_(g1.weight)
        for bias, part in ((f1.bias, self.low_rank_bias[:Kd]), (g1.bias, self.low_rank_bias[Kd:])):
            if bias is not None:
                part.copy_(bias)
        for conv, part in zip((layer.q_conv1d, layer.k_conv1d, layer.v_conv1d),
                              self.conv.split([Kd, Kd, self.value_dim])):
            part.copy_(conv.weight)

    @staticmethod
    def sources(layer: GatedDeltaNet2) -> list[torch.Tensor]:
        """The parameters :meth:`copy_from` copies."""
        linears = _first_stage(layer) + [layer.f_proj[1], layer.g_proj[1]]
        return ([p for lin in linears for p in (lin.weight, lin.bias) if p is not None]
                + [layer.q_conv1d.weight, layer.k_conv1d.weight, layer.v_conv1d.weight])

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x [B,T,d] -> the pre-conv q | k | v [B,T,2*key_dim+value_dim] and the pre-activation f,
        b, w and output gate, as the layer's own projections give them."""
        B, T, _ = x.shape
        Kd, Vd = self.key_dim, self.value_dim
        qkv, bw, hidden = F.linear(x, self.in_proj).split([2 * Kd + Vd, Kd + Vd, self.low_rank.shape[1]], dim=-1)
        # The bias is added apart from the GEMM, so that the compiler folds it into the kernels that
        # read f and the gate. A non-finite hidden unit would leak into the other stage through the
        # zero blocks, but it already makes this layer's output non-finite unfused.
        low = F.linear(hidden.reshape(B * T, -1), self.low_rank) + self.low_rank_bias
        f, gate = low.reshape(B, T, Kd + Vd).split([Kd, Vd], dim=-1)
        b, w = bw.split([Kd, Vd], dim=-1)
        return qkv, f, b, w, gate

    def tensors(self) -> list[torch.Tensor]:
        return [self.in_proj, self.low_rank, self.low_rank_bias, self.conv]


@dataclass
class BlockWeights:
    """One block's fused decode-time tensors (see :class:`DecodeWeights`)."""

    mlp_in: torch.Tensor  # [2 * intermediate_size, d]: the rows of w1 | w2
    mixer: Optional[FusedGDN2] = None  # GDN-2 blocks; attention's qkv is one matrix already

    @classmethod
    def of(cls, block: Block) -> "BlockWeights":
        w1, w2 = block.mlp.w1.weight, block.mlp.w2.weight
        if w1.dtype != w2.dtype or w1.device != w2.device:
            raise ValueError(f"mlp: w1.weight ({w1.dtype}, {w1.device}) and w2.weight ({w2.dtype}, {w2.device}) "
                             "differ in dtype or device")
        fused = cls(w1.new_empty(w1.shape[0] + w2.shape[0], w1.shape[1]),
                    FusedGDN2.of(block.mixer) if block.kind == "gdn2" else None)
        fused.copy_from(block)
        return fused

    @torch.no_grad()
    def copy_from(self, block: Block) -> None:
        torch.cat([block.mlp.w1.weight, block.mlp.w2.weight], dim=0, out=self.mlp_in)
        if self.mixer is not None:
            self.mixer.copy_from(block.mixer)

    @staticmethod
    def sources(block: Block) -> list[torch.Tensor]:
        """The parameters :meth:`copy_from` copies."""
        mixer = FusedGDN2.sources(block.mixer) if block.kind == "gdn2" else []
        return mixer + [block.mlp.w1.weight, block.mlp.w2.weight]

    def tensors(self) -> list[torch.Tensor]:
        return [self.mlp_in] + ([] if self.mixer is None else self.mixer.tensors())


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
        self.blocks: list[BlockWeights] = [BlockWeights.of(b) for b in blocks]
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
                self.blocks[i] = BlockWeights.of(block)
                reallocated = True
            self._signatures[i] = signature
        return reallocated

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for b in self.blocks for t in b.tensors())


# --------------------------------------------------------------------------------------------------
# The decode step
# --------------------------------------------------------------------------------------------------

def _decode_context(model: GPT, cache: InferenceCache) -> DecodeContext:
    """Per-step values shared by all attention layers: they have one window, head size and ring
    layout, and their slot positions are always equal."""
    positions = cache.column - cache.offsets
    attn = next((c for c in cache.layers if isinstance(c, AttentionCache)), None)
    if attn is None:
        return DecodeContext(positions, cache.column)
    c = model.config
    slot = torch.remainder(cache.column, attn.capacity).reshape(1)
    kpos = attn.positions.index_copy(0, slot, cache.column.reshape(1))  # as after this step's write
    # every stored column is <= the current one; empty slots hold -1 < any offset
    visible = kpos[None, :] >= cache.offsets[:, None]
    if c.sliding_window is not None:
        visible = visible & (cache.column - kpos < c.sliding_window)[None, :]
    cos, sin = rope_tables(positions, c.head_size, c.rope_base)
    return DecodeContext(positions, cache.column, slot, visible, cos, sin)


def decode_inputs(model: GPT, tokens: torch.Tensor, cache: InferenceCache
                  ) -> tuple[torch.Tensor, torch.Tensor, DecodeContext]:
    """The start of a decode step: token embeddings x [B,1,d] as the residual pair (x, 0) that the
    blocks pass on (see :meth:`Block.branches`), and the step's DecodeContext."""
    x = model.transformer.wte(tokens)[:, None]
    return x, torch.zeros_like(x), _decode_context(model, cache)


def decode_head(model: GPT, x: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """The end of a decode step: final norm and head of x + delta [B,1,d] -> logits [B, vocab_size]."""
    return _head(model, x + delta)[:, 0]


# One function per layer kind: torch.compile keeps its graphs per function (code object), and each
# function may hold at most ``torch._dynamo.config.recompile_limit`` (8) of them, one per batch size.
def _gdn2_block_step(block: Block, x: torch.Tensor, delta: torch.Tensor, ctx: DecodeContext, cache: GDN2Cache,
                     fused: Optional[BlockWeights]) -> tuple[torch.Tensor, torch.Tensor]:
    return block.branches(x + delta, ctx.positions, cache=cache, step=ctx, fused=fused)


def _attention_block_step(block: Block, x: torch.Tensor, delta: torch.Tensor, ctx: DecodeContext,
                          cache: AttentionCache, fused: Optional[BlockWeights]) -> tuple[torch.Tensor, torch.Tensor]:
    return block.branches(x + delta, ctx.positions, cache=cache, step=ctx, fused=fused)


class DecodePieces:
    """The pieces of :func:`decode_step`: ``inputs`` (:func:`decode_inputs`), one block step per layer
    kind (calling the object runs one block on the residual pair) and ``head`` (:func:`decode_head`),
    each passed through ``wrap`` (``torch.compile`` in :func:`compiled_block_step`)."""

    def __init__(self, wrap: Callable[[Callable[..., Any]], Callable[..., Any]] = lambda fn: fn) -> None:
        self.blocks = {"gdn2": wrap(_gdn2_block_step), "attention": wrap(_attention_block_step)}
        self.inputs = wrap(decode_inputs)
        self.head = wrap(decode_head)

    def __call__(self, block: Block, x: torch.Tensor, delta: torch.Tensor, ctx: DecodeContext, cache: Any,
                 fused: Optional[BlockWeights] = None) -> tuple[torch.Tensor, torch.Tensor]:
        return self.blocks[block.kind](block, x, delta, ctx, cache, fused)


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
    x, delta, ctx = pieces.inputs(model, tokens, cache)
    for block, layer, layer_fused in zip(model.transformer.h, cache.layers, fused):
        x, delta = pieces(block, x, delta, ctx, layer, layer_fused)
    logits = pieces.head(model, x, delta)
    cache.column.add_(1)
    return logits
