"""The GPT: token embedding, pre-norm blocks (GDN-2 or attention mixer + SwiGLU MLP), final norm, head.

lit-gpt naming: ``transformer.wte``, ``transformer.h``, ``transformer.ln_f``, ``lm_head``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Callable, Optional, Union

import torch
import torch.nn as nn
import torch.nn.functional as F

from gdn2.config import Config
from gdn2.layers.attention import AttentionCache, CausalSelfAttention, rope_tables
from gdn2.layers.decoding import DecodeContext, optimizer_step_count
from gdn2.layers.gdn2 import GatedDeltaNet2, GDN2Cache, GDN2DecodeWeights
from gdn2.layers.fused import swiglu
from gdn2.layers.init import Embedding, Linear, RMSNorm
from gdn2.layers.packed import PackedPrompts

__all__ = ["GPT", "Block", "MLP", "RMSNorm", "InferenceCache", "PackedPrompts", "block_decode_step",
           "compiled_block_step", "CompiledBlockStep", "decode_inputs", "decode_head", "DecodeWeights",
           "BlockDecodeWeights", "flops_per_token", "positions_in_documents"]


class MLP(nn.Module):
    """SwiGLU: ``w3(silu(w1 x) * w2 x)``, no bias."""

    def __init__(self, config: Config) -> None:
        super().__init__()
        d, i = config.n_embd, config.intermediate_size
        self.w1 = Linear(d, i, std=0.02)
        self.w2 = Linear(d, i, std=0.02)
        self.w3 = Linear(i, d, std=0.02 / math.sqrt(2 * config.n_layer))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w3(swiglu(self.w1(x), self.w2(x)))

    @torch.no_grad()
    def decode_weights(self) -> torch.Tensor:
        """[2 * intermediate_size, d]: the rows of w1 then w2, for one GEMM in the decode step."""
        if self.w1.weight.dtype != self.w2.weight.dtype or self.w1.weight.device != self.w2.weight.device:
            raise ValueError(f"mlp: w1.weight ({self.w1.weight.dtype}, {self.w1.weight.device}) and w2.weight "
                             f"({self.w2.weight.dtype}, {self.w2.weight.device}) differ in dtype or device")
        return torch.cat([self.w1.weight, self.w2.weight], dim=0)


class Block(nn.Module):
    """``x = x + mixer(norm_1(x)); x = x + mlp(norm_2(x))``."""

    def __init__(self, config: Config, layer_idx: int) -> None:
        super().__init__()
        self.kind = "gdn2" if config.is_gdn2_layer(layer_idx) else "attention"
        self.norm_1 = RMSNorm(config.n_embd, eps=config.norm_eps)
        self.mixer: Union[GatedDeltaNet2, CausalSelfAttention] = (
            GatedDeltaNet2(config, layer_idx) if self.kind == "gdn2" else CausalSelfAttention(config, layer_idx))
        self.norm_2 = RMSNorm(config.n_embd, eps=config.norm_eps)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cu_seqlens: Optional[torch.Tensor] = None,
                pos_in_doc: Optional[torch.Tensor] = None,
                cache: Optional[Union[GDN2Cache, AttentionCache]] = None,
                packed: Optional[PackedPrompts] = None) -> torch.Tensor:
        h = self.norm_1(x)
        if self.kind == "gdn2":
            h = self.mixer(h, cu_seqlens=cu_seqlens, pos_in_doc=pos_in_doc, cache=cache, packed=packed is not None)
        else:
            h = self.mixer(h, positions, cu_seqlens=cu_seqlens, cache=cache, packed=packed)
        x, h = self.norm_2.add_forward(x, h)
        return x + self.mlp(h)

    def decode_step(self, x: Any, ctx: DecodeContext, cache: Union[GDN2Cache, AttentionCache],
                    weights: Optional["BlockDecodeWeights"] = None) -> Any:
        """x: [B,1,d] -> [B,1,d]; see :meth:`GPT.decode_step`. With ``weights`` (this block's part of a
        :class:`DecodeWeights`) the fused step runs: the same values, fewer kernels; its input and
        output are then pairs ``(x, delta)`` of [B,1,d] tensors standing for ``x + delta`` (see
        :meth:`_fused_decode_step`)."""
        if weights is not None:
            return self._fused_decode_step(x, ctx, cache, weights)
        h = self.norm_1(x)
        h = self.mixer.decode_step(h, cache) if self.kind == "gdn2" else self.mixer.decode_step(h, ctx, cache)
        x = x + h
        return x + self.mlp(self.norm_2(x))

    def _fused_decode_step(self, x: tuple[torch.Tensor, torch.Tensor], ctx: DecodeContext,
                           cache: Union[GDN2Cache, AttentionCache],
                           weights: "BlockDecodeWeights") -> tuple[torch.Tensor, torch.Tensor]:
        """(x, delta) -> (x', delta'): the block maps x + delta to x' + delta'.

        Each residual add happens inside the RMSNorm that reads its sum (compiled, one kernel): the
        mixer's output projection is added in ``norm_2``; the MLP's, returned as ``delta'``, in the next
        block's ``norm_1`` (or the final norm). The GEMMs then write fresh outputs; a GEMM that adds
        into a residual (``addmm``) copies the residual first at batch 1, one more kernel each."""
        x, delta = x
        x = x + delta
        h = self.norm_1(x)
        if self.kind == "gdn2":
            heads, out = self.mixer.fused_decode_mix(h, cache, weights.mixer), self.mixer.o_proj
        else:
            heads, out = self.mixer.decode_attend(h, ctx, cache), self.mixer.proj
        x = x + F.linear(heads, out.weight)
        gate, up = F.linear(self.norm_2(x), weights.mlp_in).chunk(2, dim=-1)
        return x, F.linear(F.silu(gate) * up, self.mlp.w3.weight)

    def decode_weight_sources(self) -> list[torch.Tensor]:
        """The parameters this block's fused decode weights are copied from."""
        mixer = self.mixer.decode_weight_sources() if self.kind == "gdn2" else []
        return mixer + [self.mlp.w1.weight, self.mlp.w2.weight]

    def decode_weights(self) -> "BlockDecodeWeights":
        """Fresh fused copies of this block's weights (see :class:`DecodeWeights`)."""
        out = self.mixer.o_proj if self.kind == "gdn2" else self.mixer.proj
        for name, lin in (("mixer output projection", out), ("mlp.w3", self.mlp.w3)):
            if lin.bias is not None:  # the fused step adds the residual as the GEMM's addend instead
                raise ValueError(f"{name} has a bias, which the fused decode step does not add")
        return BlockDecodeWeights(self.mlp.decode_weights(),
                                  self.mixer.decode_weights() if self.kind == "gdn2" else None)


@dataclass
class BlockDecodeWeights:
    """One block's fused decode-time tensors (see :class:`DecodeWeights`)."""

    mlp_in: torch.Tensor  # [2 * intermediate_size, d]: w1 | w2
    mixer: Optional[GDN2DecodeWeights] = None  # GDN-2 blocks; attention's qkv is one matrix already

    def tensors(self) -> list[torch.Tensor]:
        mixer = [] if self.mixer is None else [self.mixer.in_proj, self.mixer.low_rank, self.mixer.low_rank_bias,
                                               self.mixer.conv, self.mixer.decay_rate]
        return [self.mlp_in] + mixer


def _signature(tensors: list[torch.Tensor]) -> tuple:
    """What changes when a tensor is written in place (version counter) or replaced (identity, memory)."""
    return tuple((id(t), t.data_ptr(), t._version, t.dtype, t.shape, t.device) for t in tensors)


class DecodeWeights:
    """Decode-time copies of a GPT's weights in a fused layout, built by :meth:`GPT.prepare_decoding`.

    Per GDN-2 block one matrix [q | k | v | b | w | f_proj[0] | g_proj[0]] (one GEMM for the seven
    input projections), the two low-rank second stages as one block-diagonal GEMM, the three conv
    taps side by side and the decay rate precomputed; per MLP one [w1 | w2] matrix. The parameters
    (names, shapes, the training forward) are untouched: these are copies (``nbytes``: 0.55x the
    weight bytes of ``swa_gdn2_1.3B``, 1.5 GiB in bf16; 0.67x for ``gdn2_1.3B``), freed with this object.

    Keeping up with the parameters: the copies are stale when a source parameter was written in place
    (its version counter: ``load_state_dict``, a torch.optim step with ``foreach``, ``with
    torch.no_grad(): p.mul_(...)``), replaced (``p.data = ...``, ``load_state_dict(assign=True)``,
    ``model.to(dtype)``), or when any ``torch.optim`` optimizer stepped since the copies were made
    (fused optimizers do not bump version counters). :meth:`refresh` re-copies stale blocks (into the
    same buffers when shapes and dtypes still match, so captured CUDA graphs stay valid);
    :meth:`GPT.decode_step` refuses stale copies with a ValueError; :class:`gdn2.generate.Generator`
    refreshes at the start of every ``generate`` call. Writes through ``p.data`` are invisible to
    all of this: call ``refresh(force=True)`` after them.
    """

    def __init__(self, model: "GPT") -> None:
        self.model = model
        blocks = list(model.transformer.h)
        self.blocks: list[BlockDecodeWeights] = [b.decode_weights() for b in blocks]
        self._signatures = [_signature(b.decode_weight_sources()) for b in blocks]
        self._optimizer_steps = optimizer_step_count()

    def stale_blocks(self) -> list[int]:
        """Indices of the blocks whose copies no longer match their parameters (see the class doc)."""
        blocks = list(self.model.transformer.h)
        if len(blocks) != len(self.blocks):
            raise ValueError(f"the model has {len(blocks)} blocks, these decode weights {len(self.blocks)}: "
                             "prepare them again with model.prepare_decoding()")
        if optimizer_step_count() != self._optimizer_steps:
            return list(range(len(blocks)))
        return [i for i, b in enumerate(blocks) if _signature(b.decode_weight_sources()) != self._signatures[i]]

    def is_current(self) -> bool:
        return not self.stale_blocks()

    @torch.no_grad()
    def refresh(self, force: bool = False) -> bool:
        """Re-copy the stale blocks (all of them with ``force``). Returns True when some tensor had to
        be reallocated (its shape, dtype or device changed): steps captured over the old tensors,
        e.g. CUDA graphs, must then be captured again. Returns False when everything was current or
        was updated in place."""
        stale = range(len(self.blocks)) if force else self.stale_blocks()
        reallocated = False
        blocks = list(self.model.transformer.h)
        for i in stale:
            fresh = blocks[i].decode_weights()
            old = self.blocks[i].tensors()
            new = fresh.tensors()
            if len(old) == len(new) and all(a.shape == b.shape and a.dtype == b.dtype and a.device == b.device
                                             for a, b in zip(old, new)):
                for a, b in zip(old, new):
                    a.copy_(b)
            else:
                self.blocks[i] = fresh
                reallocated = True
            self._signatures[i] = _signature(blocks[i].decode_weight_sources())
        self._optimizer_steps = optimizer_step_count()
        return reallocated

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for b in self.blocks for t in b.tensors())


class InferenceCache:
    """Per-layer decoding state: GDN-2 recurrent state + conv tails, attention ring buffers.

    ``seen`` counts the columns already processed, i.e. the column of the next token; ``column`` is
    the same count as a 0-d device tensor, which a captured decode step advances by itself.
    ``offsets`` [B] is the first column of each row: rows whose prompt is shorter than the longest
    one of the batch start later (:meth:`GPT.prefill`), so row ``r`` holds position ``c - offsets[r]``
    in column ``c``. All zeros unless prompts of different lengths were prefilled together.
    """

    def __init__(self, model: "GPT", batch_size: int, device: Optional[torch.device] = None,
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
        self.seen = 0
        self.column = torch.zeros((), dtype=torch.long, device=device)
        self.offsets = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.ragged = False  # True once rows start in different columns

    def reset(self) -> None:
        """Empty every layer in place: tensors a CUDA graph captured remain the ones in use."""
        for layer in self.layers:
            layer.reset()
        self.seen = 0
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
        view.seen, view.column, view.offsets, view.ragged = self.seen, self.column, self.offsets[:n], self.ragged
        return view

    def full_attention(self) -> bool:
        return any(isinstance(c, AttentionCache) and c.full_attention for c in self.layers)


def block_decode_step(block: Block, x: Any, ctx: DecodeContext, cache: Union[GDN2Cache, AttentionCache],
                      weights: Optional[BlockDecodeWeights] = None) -> Any:
    """``block.decode_step(x, ctx, cache, weights)`` as a free function: compiling it once serves every
    block of a kind (torch.compile treats the module as an input, not as a constant)."""
    return block.decode_step(x, ctx, cache, weights)


def decode_inputs(model: "GPT", tokens: torch.Tensor, cache: InferenceCache,
                  fused: bool = False) -> tuple[Any, DecodeContext]:
    """The start of :meth:`GPT.decode_step`: token embeddings [B,1,d] and the step's DecodeContext.
    ``fused``: the embeddings as the pair (x, 0) that the fused block steps pass on."""
    x = model.transformer.wte(tokens)[:, None]
    return ((x, torch.zeros_like(x)) if fused else x), model._decode_context(cache)


def decode_head(model: "GPT", x: Any) -> torch.Tensor:
    """The end of :meth:`GPT.decode_step`: final norm and head, x [B,1,d] (or a pair (x, delta) from the
    fused block steps, summed first) -> logits [B, vocab_size]."""
    if isinstance(x, tuple):
        x = x[0] + x[1]
    return model.lm_head(model.transformer.ln_f(x))[:, 0]


# One function per layer kind: torch.compile keeps its graphs per function (code object), and each
# function may hold at most ``torch._dynamo.config.recompile_limit`` (8) of them, one per batch size.
def _gdn2_block_step(block: Block, x: Any, ctx: DecodeContext, cache: GDN2Cache,
                     weights: Optional[BlockDecodeWeights] = None) -> Any:
    return block.decode_step(x, ctx, cache, weights)


def _attention_block_step(block: Block, x: Any, ctx: DecodeContext, cache: AttentionCache,
                          weights: Optional[BlockDecodeWeights] = None) -> Any:
    return block.decode_step(x, ctx, cache, weights)


class CompiledBlockStep:
    """A ``block_step`` for :meth:`GPT.decode_step` whose pieces run through ``torch.compile`` (static
    shapes): calling it runs one block (one compiled function per layer kind); ``inputs`` and ``head``
    are the compiled :func:`decode_inputs` and :func:`decode_head`, which ``GPT.decode_step`` uses in
    place of its own. Graphs are compiled on first use, one per function and batch size."""

    def __init__(self, backend: str = "inductor", fullgraph: bool = False) -> None:
        def compile_fn(fn: Callable[..., Any]) -> Callable[..., Any]:
            return torch.compile(fn, backend=backend, fullgraph=fullgraph, dynamic=False)

        self.blocks = {"gdn2": compile_fn(_gdn2_block_step), "attention": compile_fn(_attention_block_step)}
        self.inputs = compile_fn(decode_inputs)
        self.head = compile_fn(decode_head)

    def __call__(self, block: Block, x: torch.Tensor, ctx: DecodeContext, cache: Any,
                 weights: Optional[BlockDecodeWeights] = None) -> torch.Tensor:
        return self.blocks[block.kind](block, x, ctx, cache, weights)


@lru_cache(maxsize=None)
def compiled_block_step(backend: str = "inductor", fullgraph: bool = False) -> CompiledBlockStep:
    """The process-wide :class:`CompiledBlockStep` for ``backend``: every caller shares its graphs,
    so each (layer kind, batch size) compiles once per process. Compiling takes seconds per batch
    size (about 8-13 s for ``swa_gdn2_1.3B`` on an H200). Up to 8 batch sizes per function stay
    compiled (dynamo's recompile limit); beyond that dynamo warns and runs the extra ones eagerly."""
    return CompiledBlockStep(backend, fullgraph)


def positions_in_documents(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """[total] position of every token inside its document, from document offsets ``cu_seqlens``."""
    idx = torch.arange(total, device=cu_seqlens.device)
    starts = cu_seqlens[:-1].long()
    doc = torch.searchsorted(starts, idx, right=True) - 1
    return idx - starts[doc]


class GPT(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=Embedding(config.vocab_size, config.n_embd, std=0.02),
            h=nn.ModuleList(Block(config, i) for i in range(config.n_layer)),
            ln_f=RMSNorm(config.n_embd, eps=config.norm_eps),
        ))
        self.lm_head = Linear(config.n_embd, config.vocab_size, std=0.02)

    def forward(self, idx: torch.Tensor, cu_seqlens: Optional[torch.Tensor] = None,
                cache: Optional[InferenceCache] = None) -> torch.Tensor:
        """idx: int64 [B,T] -> logits [B,T,vocab_size].

        ``cu_seqlens``: int 1-D document offsets over the flattened B*T tokens (every row start
        included) for document masking: GDN-2 state, short conv and attention all restart at each
        document. ``cache``: an :class:`InferenceCache`, updated in place (prefill and decoding).
        """
        B, T = idx.shape
        x = self.transformer.wte(idx)
        pos_in_doc = None
        if cu_seqlens is not None:
            if cache is not None:
                raise ValueError("cu_seqlens cannot be combined with a decoding cache")
            cu_seqlens = cu_seqlens.to(device=idx.device, dtype=torch.int32)
            row_starts = torch.arange(0, B * T + 1, T, device=idx.device)
            if not torch.isin(row_starts, cu_seqlens).all():
                raise ValueError(f"cu_seqlens must contain every row start (multiples of T={T}) and B*T")
            x = x.reshape(1, B * T, -1)  # the operators take packed documents as one batch row
            pos_in_doc = positions_in_documents(cu_seqlens, B * T)
        start = cache.seen if cache is not None else 0
        if cache is not None and cache.ragged:
            raise ValueError("this cache holds prompts of different lengths: continue with decode_step")
        if cache is not None and start + T > cache.max_length and cache.full_attention():
            raise ValueError(f"sequence of {start + T} tokens exceeds the cache's max_length {cache.max_length}")
        # with document masking, RoPE positions restart with every document as well
        positions = pos_in_doc if pos_in_doc is not None else torch.arange(start, start + T, device=idx.device)
        for i, block in enumerate(self.transformer.h):
            x = block(x, positions, cu_seqlens=cu_seqlens, pos_in_doc=pos_in_doc,
                      cache=cache.layers[i] if cache is not None else None)
        x = self.transformer.ln_f(x)
        logits = self.lm_head(x)
        if cache is not None:
            cache.seen += T
            cache.column.add_(T)
        return logits.reshape(B, T, -1)

    @torch.no_grad()
    def prefill(self, prompts: list[torch.Tensor], cache: InferenceCache) -> torch.Tensor:
        """Run prompts of any lengths through the model in one packed pass and fill an empty ``cache``.

        prompts: ``cache.batch_size`` int64 1-D tensors (>= 1 token each). They are concatenated and
        processed as separate documents (``cu_seqlens``), so each prompt sees exactly what it would
        alone, with no padding; their states then go to cache row ``i``, right-aligned (see
        :class:`InferenceCache`). Returns the logits of each prompt's last token [B, vocab_size].
        """
        if len(prompts) != cache.batch_size:
            raise ValueError(f"prefill: got {len(prompts)} prompts for a cache of {cache.batch_size} rows")
        if cache.seen != 0:
            raise ValueError("prefill needs an empty cache (call cache.reset())")
        device = self.lm_head.weight.device
        packed = PackedPrompts.from_lengths([int(p.numel()) for p in prompts], device)
        if cache.full_attention() and packed.num_columns > cache.max_length:
            raise ValueError(f"prompt of {packed.num_columns} tokens exceeds the cache's max_length {cache.max_length}")
        idx = torch.cat([p.reshape(-1) for p in prompts]).to(device=device, dtype=torch.long)[None]
        x = self.transformer.wte(idx)
        for i, block in enumerate(self.transformer.h):
            x = block(x, packed.pos_in_doc, cu_seqlens=packed.cu_seqlens, pos_in_doc=packed.pos_in_doc,
                      cache=cache.layers[i], packed=packed)
        logits = self.lm_head(self.transformer.ln_f(x[0, packed.last]))
        cache.seen = packed.num_columns
        cache.column.fill_(packed.num_columns)
        cache.offsets.copy_(packed.offsets)
        cache.ragged = min(int(p.numel()) for p in prompts) != packed.num_columns
        return logits

    def prepare_decoding(self) -> DecodeWeights:
        """The fused decode-time weight layout for :meth:`decode_step` (copies of the current weights;
        see :class:`DecodeWeights` for how they follow later weight changes)."""
        return DecodeWeights(self)

    def decode_step(self, tokens: torch.Tensor, cache: InferenceCache,
                    block_step: Optional[Callable[..., torch.Tensor]] = None,
                    weights: Optional[DecodeWeights] = None) -> torch.Tensor:
        """One token per row: tokens int64 [B] -> logits [B, vocab_size].

        Every cache update happens in place and nothing waits for the host, so a CUDA graph can
        capture this call and replay it. The token goes to column ``cache.column`` (advanced here on
        the device); ``cache.seen``, a host-side count, is left to the caller, since a replayed graph
        cannot update it. The caller also checks that a full-attention cache has room.
        ``weights`` (from :meth:`prepare_decoding`): run the fused step (the same logits, fewer
        kernels); stale weights are a ValueError (``weights.refresh()`` updates them).
        ``block_step(block, x, ctx, layer_cache, layer_weights)``, when given, runs each block instead
        of ``Block.decode_step`` (with ``weights``, x is the pair that :meth:`Block.decode_step` takes);
        its ``inputs`` and ``head`` attributes, when present, replace :func:`decode_inputs` and
        :func:`decode_head` (see :func:`compiled_block_step`).
        """
        blocks = weights.blocks if weights is not None else [None] * len(self.transformer.h)
        if weights is not None and not torch.compiler.is_compiling():
            if weights.model is not self:
                raise ValueError("weights were prepared for another model")
            stale = weights.stale_blocks()
            if stale:
                raise ValueError(f"decode weights of blocks {stale} are stale (the parameters changed after "
                                 "prepare_decoding()): call weights.refresh()")
        step = block_step or block_decode_step
        x, ctx = getattr(step, "inputs", decode_inputs)(self, tokens, cache, weights is not None)
        for i, block in enumerate(self.transformer.h):
            x = step(block, x, ctx, cache.layers[i], blocks[i])
        logits = getattr(step, "head", decode_head)(self, x)
        cache.column.add_(1)
        return logits

    def _decode_context(self, cache: InferenceCache) -> DecodeContext:
        """Per-step values shared by all attention layers: they have one window, head size and ring
        layout, and their slot positions are always equal."""
        positions = cache.column - cache.offsets
        attn = next((c for c in cache.layers if isinstance(c, AttentionCache)), None)
        if attn is None:
            return DecodeContext(positions, cache.column)
        c = self.config
        slot = torch.remainder(cache.column, attn.capacity).reshape(1)
        kpos = attn.positions.index_copy(0, slot, cache.column.reshape(1))  # as after this step's write
        # every stored column is <= the current one; empty slots hold -1 < any offset
        visible = kpos[None, :] >= cache.offsets[:, None]
        if c.sliding_window is not None:
            visible = visible & (cache.column - kpos < c.sliding_window)[None, :]
        cos, sin = rope_tables(positions, c.head_size, c.rope_base)
        return DecodeContext(positions, cache.column, slot, visible, cos, sin)

    def num_parameters(self, blocks_only: bool = False) -> int:
        module = self.transformer.h if blocks_only else self
        return sum(p.numel() for p in module.parameters())


def flops_per_token(config: Config, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward = 3x forward) at sequence length ``seq_len``.

    Dense matmuls (2 FLOPs per weight, embedding lookup excluded), attention scores and values over the
    average number of keys a query sees, and the chunked GDN-2 operator (chunk size 64).
    """
    c = config
    d = c.n_embd
    attn_w = d * (c.n_head + 2 * c.n_query_groups) * c.head_size + c.n_head * c.head_size * d
    K, V, H, HV = c.gdn2_head_dim, c.gdn2_head_v_dim, c.gdn2_num_heads, c.gdn2_num_v_heads
    r = c.gdn2_gate_rank
    gdn_w = (d * (2 * H * K + HV * V) + d * r + r * H * K + d * H * K + d * HV * V + d * r + r * HV * V
             + HV * V * d)
    mlp_w = 3 * d * c.intermediate_size
    W = seq_len if c.sliding_window is None else min(c.sliding_window, seq_len)
    # mean over queries of min(i + 1, W)
    avg_keys = (W * (W + 1) / 2 + (seq_len - W) * W) / seq_len
    attn_ops = 4 * c.n_head * c.head_size * avg_keys
    C = 64
    gdn_ops = HV * (4 * C * K + 2 * C * K + 4 * C * V + 6 * K * V)
    fwd = 2 * d * c.vocab_size
    for i in range(c.n_layer):
        fwd += 2 * mlp_w
        fwd += (2 * gdn_w + gdn_ops) if c.is_gdn2_layer(i) else (2 * attn_w + attn_ops)
    return 3.0 * fwd
