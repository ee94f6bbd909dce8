"""The GPT: token embedding, pre-norm blocks (GDN-2 or attention mixer + SwiGLU MLP), final norm, head.

lit-gpt naming: ``transformer.wte``, ``transformer.h``, ``transformer.ln_f``, ``lm_head``. The
forward here is training and scoring; prefill and cached decoding (``gdn2.generation``) run the same
blocks through :meth:`Block.branches`, with each layer's cache and the blocks' decode layout
(:class:`BlockWeights`). Training options (fused loss, grouped projections, float8, recompute,
compilation) are set on a model by one function, :func:`gdn2.options.apply_options`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Union

import torch
import torch.nn as nn
import torch.nn.functional as F

from gdn2.config import Config
from gdn2.layers.attention import AttentionCache, CausalSelfAttention
from gdn2.layers.gdn2 import FusedGDN2, GatedDeltaNet2, GDN2Cache
from gdn2.layout import TokenLayout, positions_in_documents
from gdn2.linear import grouped_linear
from gdn2.loss import cross_entropy_fp32, linear_cross_entropy
from gdn2.modules import Embedding, Linear, RMSNorm
from gdn2.ops import swiglu_joined
from gdn2.stages import swiglu, swiglu_joined_stage

__all__ = ["GPT", "Block", "BlockWeights", "MLP", "flops_per_token"]


class MLP(nn.Module):
    """SwiGLU: ``w3(silu(w1 x) * w2 x)``, no bias."""

    def __init__(self, config: Config) -> None:
        super().__init__()
        d, i = config.n_embd, config.intermediate_size
        self.w1 = Linear(d, i, std=0.02)
        self.w2 = Linear(d, i, std=0.02)
        self.w3 = Linear(i, d, std=0.02 / math.sqrt(2 * config.n_layer))
        self.grouped_projections = False  # set by gdn2.options.apply_options

    def forward(self, x: torch.Tensor, fused_in: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``fused_in``: a copy of the rows of w1 then w2 (decoding), one GEMM for both. Decoding keeps
        the torch form of the joined SwiGLU, the one a CUDA graph captures, so that the captured decode
        step gives the eager step's values (the Triton kernel rounds once from fp32, the torch form twice)."""
        if fused_in is not None:
            h = swiglu_joined_stage(F.linear(x, fused_in))
        elif self.grouped_projections:
            # the Triton kernel where the pointwise operator's backend is Triton (CUDA), else the compiled stage
            h = swiglu_joined(grouped_linear(x, (self.w1, self.w2)), torch_path=swiglu_joined_stage)
        else:
            h = swiglu(self.w1(x), self.w2(x))
        return self.w3(h)


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

    def forward(self, x: torch.Tensor, layout: TokenLayout) -> torch.Tensor:
        """x [B,T,d] -> [B,T,d] (training and scoring; with a cache, see :meth:`branches`)."""
        x, delta = self.branches(x, layout)
        return x + delta

    def branches(self, x: torch.Tensor, layout: TokenLayout, cache: Optional[Union[GDN2Cache, AttentionCache]] = None,
                 fused: Optional["BlockWeights"] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The block as ``(x + mixer output, mlp output)``, whose sum is its output: a decode step
        keeps them apart so that the add lands in the next norm's kernel. ``layout`` and ``cache`` go to
        the mixer (see the layers); ``fused``: this block's decode layout (:meth:`decode_weights`)."""
        h = self.norm_1(x)
        if self.kind == "gdn2":
            h = self.mixer(h, layout, cache=cache, fused=None if fused is None else fused.mixer)
        else:
            h = self.mixer(h, layout, cache=cache)
        x, h = self.norm_2.add_forward(x, h)
        return x, self.mlp(h, None if fused is None else fused.mlp_in)

    def decode_weights(self) -> "BlockWeights":
        """New copies of this block's weights in the decode layout."""
        return BlockWeights.of(self)


@dataclass
class BlockWeights:
    """One block's decode layout: copies of its MLP's w1 | w2 as one matrix and of its GDN-2 layer's input
    projections (:class:`gdn2.layers.gdn2.FusedGDN2`), for few-token steps (``gdn2.generation.DecodeWeights``)."""

    mlp_in: torch.Tensor  # [2 * intermediate_size, d]: the rows of w1 | w2
    mixer: Optional[FusedGDN2] = None  # GDN-2 blocks; attention's qkv is one matrix already

    @classmethod
    def of(cls, block: "Block") -> "BlockWeights":
        w1, w2 = block.mlp.w1.weight, block.mlp.w2.weight
        if w1.dtype != w2.dtype or w1.device != w2.device:
            raise ValueError(f"mlp: w1.weight ({w1.dtype}, {w1.device}) and w2.weight ({w2.dtype}, {w2.device}) "
                             "differ in dtype or device")
        fused = cls(w1.new_empty(w1.shape[0] + w2.shape[0], w1.shape[1]),
                    block.mixer.decode_weights() if block.kind == "gdn2" else None)
        fused.copy_from(block)
        return fused

    @torch.no_grad()
    def copy_from(self, block: "Block") -> None:
        torch.cat([block.mlp.w1.weight, block.mlp.w2.weight], dim=0, out=self.mlp_in)
        if self.mixer is not None:
            self.mixer.copy_from(block.mixer)

    @staticmethod
    def sources(block: "Block") -> list[torch.Tensor]:
        """The parameters :meth:`copy_from` copies."""
        mixer = FusedGDN2.sources(block.mixer) if block.kind == "gdn2" else []
        return mixer + [block.mlp.w1.weight, block.mlp.w2.weight]

    def tensors(self) -> list[torch.Tensor]:
        return [self.mlp_in] + ([] if self.mixer is None else self.mixer.tensors())


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
        self.fused_loss = False  # see forward; set by gdn2.options.apply_options

    def forward(self, idx: torch.Tensor, cu_seqlens: Optional[torch.Tensor] = None,
                labels: Optional[torch.Tensor] = None, loss_chunk_tokens: int = 8192) -> torch.Tensor:
        """idx: int64 [B,T] -> logits [B,T,vocab_size]; with ``labels`` (int64 [B,T], -100 ignored) the
        mean next-token loss instead (fp32 scalar), ``loss_chunk_tokens`` rows of logits at a time.

        ``cu_seqlens``: int 1-D document offsets over the flattened B*T tokens (every row start
        included) for document masking: GDN-2 state, short conv, RoPE positions and attention all
        restart at each document. ``fused_loss`` (off for a bare model, on in training by
        ``train.fused_loss``): the loss straight from the final hidden states and the head's weight
        (``linear_cross_entropy``), so the logits never exist whole.
        """
        B, T = idx.shape
        x = self.transformer.wte(idx)
        pos_in_doc = None
        if cu_seqlens is not None:
            cu_seqlens = cu_seqlens.to(device=idx.device, dtype=torch.int32)
            row_starts = torch.arange(0, B * T + 1, T, device=idx.device)
            if not torch.isin(row_starts, cu_seqlens).all():
                raise ValueError(f"cu_seqlens must contain every row start (multiples of T={T}) and B*T")
            x = x.reshape(1, B * T, -1)  # the operators take packed documents as one batch row
            pos_in_doc = positions_in_documents(cu_seqlens, B * T)
        positions = pos_in_doc if pos_in_doc is not None else torch.arange(T, device=idx.device)
        layout = TokenLayout(positions, cu_seqlens, pos_in_doc)
        for block in self.transformer.h:
            x = block(x, layout)
        x = self.transformer.ln_f(x).reshape(B, T, -1)
        if labels is not None and self.fused_loss:
            return linear_cross_entropy(x, self.lm_head.weight, labels, loss_chunk_tokens)
        logits = self.lm_head(x)
        if labels is not None:
            return cross_entropy_fp32(logits, labels, loss_chunk_tokens)
        return logits

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
    # q, k, v; the decay (low rank); the erase and write gates (per channel, per head, or one tied);
    # the output gate (low rank); the output projection
    gdn_w = (d * (2 * H * K + HV * V) + d * r + r * c.gdn2_decay_units + d * (c.gdn2_erase_units + c.gdn2_write_units)
             + d * r + r * HV * V + HV * V * d)
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
