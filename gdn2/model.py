"""The GPT: token embedding, pre-norm blocks (GDN-2 or attention mixer + SwiGLU MLP), final norm, head.

lit-gpt naming: ``transformer.wte``, ``transformer.h``, ``transformer.ln_f``, ``lm_head``. The
forward here is training and scoring; prefill, cached decoding and their fused weights are in
:mod:`gdn2.inference`, on the same blocks and layers.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Optional, Union

import torch
import torch.nn as nn
import torch.nn.functional as F

from gdn2.config import Config
from gdn2.layers.attention import AttentionCache, CausalSelfAttention
from gdn2.layers.decoding import DecodeContext
from gdn2.layers.fused import grouped_linear, swiglu, swiglu_joined, swiglu_joined_stage
from gdn2.layers.gdn2 import GatedDeltaNet2, GDN2Cache
from gdn2.layers.init import Embedding, Linear, RMSNorm
from gdn2.layers.loss import cross_entropy_fp32, linear_cross_entropy
from gdn2.layers.packed import PackedPrompts

if TYPE_CHECKING:
    from gdn2.inference import BlockWeights
    from gdn2.layers.float8 import Float8Spec

__all__ = ["GPT", "Block", "MLP", "flops_per_token", "positions_in_documents"]


class MLP(nn.Module):
    """SwiGLU: ``w3(silu(w1 x) * w2 x)``, no bias."""

    def __init__(self, config: Config) -> None:
        super().__init__()
        d, i = config.n_embd, config.intermediate_size
        self.w1 = Linear(d, i, std=0.02)
        self.w2 = Linear(d, i, std=0.02)
        self.w3 = Linear(i, d, std=0.02 / math.sqrt(2 * config.n_layer))
        self.grouped_projections = False  # see GPT.set_grouped_projections

    def forward(self, x: torch.Tensor, fused_in: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``fused_in``: a copy of the rows of w1 then w2 (decoding), one GEMM for both. Decoding keeps
        the torch form of the joined SwiGLU, the one a CUDA graph captures, so that the captured decode
        step gives the eager step's values (the Triton kernel rounds once from fp32, the torch form twice)."""
        if fused_in is not None:
            h = swiglu_joined_stage(F.linear(x, fused_in))
        elif self.grouped_projections:
            h = swiglu_joined(grouped_linear(x, (self.w1, self.w2)))
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

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cu_seqlens: Optional[torch.Tensor] = None,
                pos_in_doc: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x [B,T,d] -> [B,T,d] (training and scoring; with a cache, see :meth:`branches`)."""
        x, delta = self.branches(x, positions, cu_seqlens, pos_in_doc)
        return x + delta

    def branches(self, x: torch.Tensor, positions: torch.Tensor, cu_seqlens: Optional[torch.Tensor] = None,
                 pos_in_doc: Optional[torch.Tensor] = None, cache: Optional[Union[GDN2Cache, AttentionCache]] = None,
                 packed: Optional[PackedPrompts] = None, step: Optional[DecodeContext] = None,
                 fused: Optional["BlockWeights"] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The block as ``(x + mixer output, mlp output)``, whose sum is its output: a decode step
        keeps them apart so that the add lands in the next norm's kernel. ``cache``, ``packed``,
        ``step`` go to the mixer (see the layers); ``fused``: this block's decode-weight copies."""
        h = self.norm_1(x)
        if self.kind == "gdn2":
            h = self.mixer(h, cu_seqlens=cu_seqlens, pos_in_doc=pos_in_doc, cache=cache, packed=packed is not None,
                           fused=None if fused is None else fused.mixer)
        else:
            h = self.mixer(h, positions, cu_seqlens=cu_seqlens, cache=cache, packed=packed, step=step)
        x, h = self.norm_2.add_forward(x, h)
        return x, self.mlp(h, None if fused is None else fused.mlp_in)


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
        self.fused_loss = False  # see forward

    def forward(self, idx: torch.Tensor, cu_seqlens: Optional[torch.Tensor] = None,
                labels: Optional[torch.Tensor] = None, loss_chunk_tokens: int = 8192) -> torch.Tensor:
        """idx: int64 [B,T] -> logits [B,T,vocab_size]; with ``labels`` (int64 [B,T], -100 ignored) the
        mean next-token loss instead (fp32 scalar), ``loss_chunk_tokens`` rows of logits at a time.

        ``cu_seqlens``: int 1-D document offsets over the flattened B*T tokens (every row start
        included) for document masking: GDN-2 state, short conv, RoPE positions and attention all
        restart at each document. ``fused_loss`` (attribute; off for a bare model, on in training by
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
        for block in self.transformer.h:
            x = block(x, positions, cu_seqlens=cu_seqlens, pos_in_doc=pos_in_doc)
        x = self.transformer.ln_f(x).reshape(B, T, -1)
        if labels is not None and self.fused_loss:
            return linear_cross_entropy(x, self.lm_head.weight, labels, loss_chunk_tokens)
        logits = self.lm_head(x)
        if labels is not None:
            return cross_entropy_fp32(logits, labels, loss_chunk_tokens)
        return logits

    def set_grouped_projections(self, enabled: bool) -> None:
        """Run the projections that read one input (a GDN-2 layer's seven, the MLP's two) as one GEMM
        over their stacked weights, and one for each gradient (off for a bare model, on in training by
        ``train.grouped_projections``). Same values up to the GEMMs' summation order."""
        for module in self.modules():
            if hasattr(module, "grouped_projections"):
                module.grouped_projections = bool(enabled)

    def set_recompute(self, enabled: bool) -> None:
        """Let each GDN-2 layer's training forward drop what its backward can cheaply rebuild: the short
        convolutions' outputs, the decay's full-rank projection, the gates, the output gate and the gated
        norm, and the GDN-2 operator's chunk intermediates, kept for the backward otherwise (off for a bare
        model; ``train.recompute`` in training). The same values and gradients; the rebuild runs again what
        made them, once per layer and step."""
        for module in self.modules():
            if isinstance(module, GatedDeltaNet2):
                module.recompute = bool(enabled)

    def set_float8(self, spec: Optional["Float8Spec"]) -> None:
        """Run the blocks' projections in float8 (``spec`` from :func:`gdn2.layers.float8.float8_spec`;
        None: back to the autocast dtype): every block projection that :func:`gdn2.layers.float8.eligible`
        admits, grouped ones as one float8 GEMM, except the GDN-2 gates' low-rank up-projections (their
        GEMMs reduce over the gate rank only). The output head keeps its GEMMs (off for a bare model;
        ``train.float8`` in training)."""
        from gdn2.layers.float8 import eligible

        low_rank_ups = {id(lin) for m in self.transformer.h.modules() if isinstance(m, GatedDeltaNet2)
                        for lin in (m.f_proj[1], m.g_proj[1])}
        for module in self.transformer.h.modules():
            if isinstance(module, Linear):
                on = spec is not None and eligible(module) and id(module) not in low_rank_ups
                module.float8 = spec if on else None

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
