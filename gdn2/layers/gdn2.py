"""The Gated DeltaNet-2 token mixer.

x -> q, k, v (full-rank, causal depthwise conv k=4 + SiLU), channel-wise decay g (low-rank, fp32),
erase gate b (key axis) and write gate w (value axis) -> GDN-2 operator (q, k L2-normalised inside) ->
per-head RMSNorm gated by silu(low-rank gate) -> output projection. No positional encoding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from gdn2.config import Config
from gdn2.layers.decoding import recurrent_decode
from gdn2.layers.fused import causal_conv_silu, decay_rate, gated_rms_norm, gdn2_gates
from gdn2.layers.init import Linear
from gdn2.ops import chunk_gdn2, fused_recurrent_gdn2

INNER_GAIN = 2 ** -2.5  # Xavier gain of every linear inside the layer (reference init)


@dataclass
class GDN2Cache:
    """Decoding state of one GDN-2 layer: the fp32 recurrent state and the short-conv input tails.

    The tails of q, k and v live side by side in one buffer, so that the decode step updates them
    with one copy; ``conv_q`` / ``conv_k`` / ``conv_v`` are views of it.
    """

    state: torch.Tensor  # [B, HV, K, V] fp32
    conv: torch.Tensor  # [B, conv_size - 1, 2 * key_dim + value_dim]: the last pre-conv inputs, q | k | v
    key_dim: int

    @property
    def conv_q(self) -> torch.Tensor:
        return self.conv[..., :self.key_dim]

    @property
    def conv_k(self) -> torch.Tensor:
        return self.conv[..., self.key_dim: 2 * self.key_dim]

    @property
    def conv_v(self) -> torch.Tensor:
        return self.conv[..., 2 * self.key_dim:]

    def reset(self) -> None:
        """Back to the empty state, in place (buffers a CUDA graph captured stay valid)."""
        self.state.zero_()
        self.conv.zero_()

    def rows(self, n: int) -> "GDN2Cache":
        """A cache over the first ``n`` rows that shares this one's memory."""
        return GDN2Cache(self.state[:n], self.conv[:n], self.key_dim)


@dataclass
class GDN2DecodeWeights:
    """One GDN-2 layer's parameters rearranged for the one-token decode step (built by
    :meth:`GatedDeltaNet2.decode_weights`; copies, the parameters themselves are untouched)."""

    # [2*key_dim + value_dim + key_dim + value_dim + 2*rank, d]: the rows of q_proj | k_proj | v_proj |
    # b_proj | w_proj | f_proj[0] | g_proj[0], so one GEMM gives every projection of the input
    in_proj: torch.Tensor
    # [key_dim + value_dim, 2*rank] block diagonal: f_proj[1] on the decay's hidden units, g_proj[1] on
    # the gate's; with ``low_rank_bias`` (0 | g_proj[1].bias) one GEMM gives both second stages
    low_rank: torch.Tensor
    low_rank_bias: torch.Tensor
    conv: torch.Tensor  # [conv_size, 2*key_dim + value_dim] depthwise taps of q | k | v, oldest first
    decay_rate: torch.Tensor  # fp32 [key_dim]: -exp(A_log) per key channel


class ShortConv(nn.Conv1d):
    """Causal depthwise convolution followed by SiLU, aware of document starts and decoding tails."""

    def __init__(self, channels: int, kernel_size: int, device=None, dtype=None) -> None:
        super().__init__(channels, channels, kernel_size, groups=channels, bias=False, device=device,
                         dtype=dtype)

    def forward(self, x: torch.Tensor, pos_in_doc: Optional[torch.Tensor] = None,
                tail: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [B,T,C]; pos_in_doc: [T] position of each token inside its document (document masking);
        tail: [B, kernel_size-1, C] inputs preceding x (decoding). Returns (silu(conv(x)), new tail)."""
        B, T, C = x.shape
        ks = self.kernel_size[0]
        y = causal_conv_silu(x, self.weight, tail, pos_in_doc)
        if T >= ks - 1:
            new_tail = x[:, T - (ks - 1):]
        else:
            before = tail.to(x.dtype) if tail is not None else x.new_zeros(B, ks - 1, C)
            new_tail = torch.cat([before, x], dim=1)[:, T:]
        return y, new_tail

    def step(self, x: torch.Tensor, tail: torch.Tensor) -> torch.Tensor:
        """One token per row: x [B,1,C], tail [B, kernel_size-1, C] updated in place. Returns silu(conv) [B,1,C]."""
        window = torch.cat([tail.to(x.dtype), x], dim=1)  # [B, ks, C], oldest first
        y = (window * self.weight[:, 0, :].t().to(x.dtype)).sum(1, keepdim=True)
        tail.copy_(window[:, 1:])
        return F.silu(y)

    def packed_tails(self, x: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        """The last kernel_size-1 inputs of each packed sequence, zeros before its start.

        x: [1, total, C] pre-conv inputs; cu_seqlens: [N+1]. Returns [N, kernel_size-1, C]."""
        ks = self.kernel_size[0]
        cu = cu_seqlens.long()
        idx = cu[1:, None] - (ks - 1) + torch.arange(ks - 1, device=x.device)[None, :]  # [N, ks-1]
        inside = idx >= cu[:-1, None]
        tails = x[0][idx.clamp_min(0)]
        return tails * inside[..., None].to(tails.dtype)


class GatedRMSNorm(nn.Module):
    """Per-head RMSNorm of the operator output, times silu(gate); weight shared across heads."""

    def __init__(self, head_dim: int, eps: float = 1e-5, device=None, dtype=None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(head_dim, device=device, dtype=dtype))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return gated_rms_norm(o, gate, self.weight, self.eps)


class GatedDeltaNet2(nn.Module):
    def __init__(self, config: Config, layer_idx: int = 0) -> None:
        super().__init__()
        c = config
        self.layer_idx = layer_idx
        self.num_heads = c.gdn2_num_heads
        self.num_v_heads = c.gdn2_num_v_heads
        self.head_k_dim = c.gdn2_head_dim
        self.head_v_dim = c.gdn2_head_v_dim
        self.key_dim = c.gdn2_key_dim
        self.value_dim = c.gdn2_value_dim
        self.conv_size = c.gdn2_conv_size
        self.allow_neg_eigval = c.allow_neg_eigval
        self.recurrent_max_len = c.gdn2_recurrent_max_len
        d, r = c.n_embd, c.gdn2_gate_rank

        def lin(i, o, bias=False):
            return Linear(i, o, bias=bias, init="xavier", gain=INNER_GAIN)

        self.q_proj = lin(d, self.key_dim)
        self.k_proj = lin(d, self.key_dim)
        self.v_proj = lin(d, self.value_dim)
        self.q_conv1d = ShortConv(self.key_dim, self.conv_size)
        self.k_conv1d = ShortConv(self.key_dim, self.conv_size)
        self.v_conv1d = ShortConv(self.value_dim, self.conv_size)
        self.f_proj = nn.Sequential(lin(d, r), lin(r, self.key_dim))  # decay, low rank
        self.b_proj = lin(d, self.key_dim)  # erase gate (key axis)
        self.w_proj = lin(d, self.value_dim)  # write gate (value axis)
        self.A_log = nn.Parameter(torch.empty(self.num_heads, dtype=torch.float32))
        self.dt_bias = nn.Parameter(torch.empty(self.key_dim, dtype=torch.float32))
        self.A_log._no_weight_decay = True
        self.dt_bias._no_weight_decay = True
        self.g_proj = nn.Sequential(lin(d, r), lin(r, self.value_dim, bias=True))  # output gate
        self.o_norm = GatedRMSNorm(self.head_v_dim, eps=c.norm_eps)
        self.o_proj = lin(self.value_dim, d)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """A_log = log U(1, 16) per head; dt ~ logU(1e-3, 1e-1) per key channel, dt_bias = softplus^-1(dt)."""
        with torch.no_grad():
            self.A_log.copy_(torch.empty_like(self.A_log).uniform_(1, 16).log())
            u = torch.rand_like(self.dt_bias)
            dt = torch.exp(u * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3)).clamp_min(1e-4)
            self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))

    def init_cache(self, batch_size: int, device: torch.device, dtype: torch.dtype) -> GDN2Cache:
        conv = torch.zeros(batch_size, self.conv_size - 1, 2 * self.key_dim + self.value_dim, device=device,
                           dtype=dtype)
        state = torch.zeros(batch_size, self.num_v_heads, self.head_k_dim, self.head_v_dim, device=device,
                            dtype=torch.float64 if dtype == torch.float64 else torch.float32)
        return GDN2Cache(state, conv, self.key_dim)

    def _gates(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Decay g (fp32, <= 0), erase gate b (key axis) and write gate w (value axis) for x [B,T,d]."""
        # decay in fp32: g = -exp(A_log) * softplus(f_proj(x) + dt_bias), per key channel, <= 0
        return gdn2_gates(self.f_proj(x), self.b_proj(x), self.w_proj(x), self.A_log, self.dt_bias,
                          self.head_k_dim, 2.0 if self.allow_neg_eigval else 1.0)

    def forward(self, x: torch.Tensor, cu_seqlens: Optional[torch.Tensor] = None,
                pos_in_doc: Optional[torch.Tensor] = None, cache: Optional[GDN2Cache] = None,
                packed: bool = False) -> torch.Tensor:
        """x: [B,T,d]. ``cu_seqlens`` (B == 1) restarts the state and the conv at each document start;
        ``pos_in_doc`` [T] is the matching position inside the document. ``cache`` is updated in place.
        ``packed=True`` (with ``cu_seqlens`` and an empty ``cache`` of one row per document): each
        document's final state and conv tails go to its cache row (prefill of several prompts)."""
        B, T, _ = x.shape
        H, HV, K, V = self.num_heads, self.num_v_heads, self.head_k_dim, self.head_v_dim
        tails = (cache.conv_q, cache.conv_k, cache.conv_v) if cache is not None and not packed else (None, None, None)
        xq, xk, xv = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q, tq = self.q_conv1d(xq, pos_in_doc, tails[0])
        k, tk = self.k_conv1d(xk, pos_in_doc, tails[1])
        v, tv = self.v_conv1d(xv, pos_in_doc, tails[2])
        g, b, w = self._gates(x)
        q, k, b, g = (t.reshape(B, T, H, K) for t in (q, k, b, g))
        v, w = v.reshape(B, T, HV, V), w.reshape(B, T, HV, V)

        if packed:
            if cache is None or cu_seqlens is None:
                raise ValueError("packed prompts need cu_seqlens and a cache to fill")
            o, final = chunk_gdn2(q, k, v, g, b, w, output_final_state=True, use_qk_l2norm_in_kernel=True,
                                  cu_seqlens=cu_seqlens)
            cache.state.copy_(final)
            for conv, pre, tail in ((self.q_conv1d, xq, cache.conv_q), (self.k_conv1d, xk, cache.conv_k),
                                    (self.v_conv1d, xv, cache.conv_v)):
                tail.copy_(conv.packed_tails(pre, cu_seqlens))
        elif cache is None:
            o, _ = chunk_gdn2(q, k, v, g, b, w, use_qk_l2norm_in_kernel=True, cu_seqlens=cu_seqlens)
        else:
            if cu_seqlens is not None:
                raise ValueError("cu_seqlens cannot be combined with a decoding cache")
            # in place, so that buffers held elsewhere (a captured decode step) see the update
            cache.conv_q.copy_(tq)
            cache.conv_k.copy_(tk)
            cache.conv_v.copy_(tv)
            if not self.training and T <= self.recurrent_max_len:
                o, _ = fused_recurrent_gdn2(q, k, v, g, b, w, initial_state=cache.state,
                                            use_qk_l2norm_in_kernel=True, inplace_final_state=True)
            else:
                o, final = chunk_gdn2(q, k, v, g, b, w, initial_state=cache.state,
                                      output_final_state=True, use_qk_l2norm_in_kernel=True)
                cache.state.copy_(final)
        gate = self.g_proj(x).reshape(B, T, HV, V)
        o = self.o_norm(o, gate).reshape(B, T, self.value_dim)
        return self.o_proj(o)

    def decode_step(self, x: torch.Tensor, cache: GDN2Cache) -> torch.Tensor:
        """One token per row with the recurrent kernel; state and conv tails updated in place, no host
        synchronisation (a CUDA graph can capture it). x: [B,1,d] -> [B,1,d]."""
        B = x.shape[0]
        H, HV, K, V = self.num_heads, self.num_v_heads, self.head_k_dim, self.head_v_dim
        q = self.q_conv1d.step(self.q_proj(x), cache.conv_q).reshape(B, 1, H, K)
        k = self.k_conv1d.step(self.k_proj(x), cache.conv_k).reshape(B, 1, H, K)
        v = self.v_conv1d.step(self.v_proj(x), cache.conv_v).reshape(B, 1, HV, V)
        g, b, w = self._gates(x)
        o = recurrent_decode(q, k, v, g.reshape(B, 1, H, K), b.reshape(B, 1, H, K), w.reshape(B, 1, HV, V),
                             cache.state)
        gate = self.g_proj(x).reshape(B, 1, HV, V)
        return self.o_proj(self.o_norm(o, gate).reshape(B, 1, self.value_dim))

    # ---- fused decode step ------------------------------------------------------------------------
    def decode_weight_sources(self) -> list[torch.Tensor]:
        """The parameters :meth:`decode_weights` reads (what a refresh of the fused copies watches)."""
        linears = [self.q_proj, self.k_proj, self.v_proj, self.b_proj, self.w_proj, self.f_proj[0], self.g_proj[0],
                   self.f_proj[1], self.g_proj[1]]
        return ([p for lin in linears for p in (lin.weight, lin.bias) if p is not None]
                + [self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight, self.A_log])

    @torch.no_grad()
    def decode_weights(self) -> GDN2DecodeWeights:
        """Fresh copies of this layer's parameters in the layout of :meth:`fused_decode_mix`.

        Matrices and conv taps in the dtype of ``q_proj.weight`` (the activations' dtype), the decay
        rate in fp32 by the same function as :meth:`_gates` (``decay_rate``)."""
        first = [self.q_proj, self.k_proj, self.v_proj, self.b_proj, self.w_proj, self.f_proj[0], self.g_proj[0]]
        f1, g1 = self.f_proj[1], self.g_proj[1]
        ref = self.q_proj.weight
        dtype = ref.dtype
        names = ("q_proj", "k_proj", "v_proj", "b_proj", "w_proj", "f_proj.0", "g_proj.0", "f_proj.1", "g_proj.1")
        for name, lin in zip(names, first + [f1, g1]):
            if lin.weight.dtype != dtype or lin.weight.device != ref.device:
                raise ValueError(f"layer {self.layer_idx}: {name}.weight is {lin.weight.dtype} on "
                                 f"{lin.weight.device}, q_proj.weight {dtype} on {ref.device}: the fused "
                                 "decode projections need one dtype and device")
            if lin in first and lin.bias is not None:
                raise ValueError(f"layer {self.layer_idx}: {name} has a bias, which the fused input GEMM omits")
        in_proj = torch.cat([lin.weight for lin in first], dim=0)
        r, Kd, Vd = f1.in_features, self.key_dim, self.value_dim
        low_rank = in_proj.new_zeros(Kd + Vd, 2 * r)
        low_rank[:Kd, :r] = f1.weight
        low_rank[Kd:, r:] = g1.weight
        low_rank_bias = torch.cat([in_proj.new_zeros(Kd) if f1.bias is None else f1.bias.to(dtype),
                                   in_proj.new_zeros(Vd) if g1.bias is None else g1.bias.to(dtype)])
        conv = torch.cat([c.weight[:, 0, :].t() for c in (self.q_conv1d, self.k_conv1d, self.v_conv1d)],
                         dim=1).to(dtype).contiguous()
        return GDN2DecodeWeights(in_proj, low_rank, low_rank_bias, conv, decay_rate(self.A_log, self.head_k_dim))

    def fused_decode_mix(self, x: torch.Tensor, cache: GDN2Cache, weights: GDN2DecodeWeights) -> torch.Tensor:
        """:meth:`decode_step` on the fused layout, without the output projection.

        x: [B,1,d] -> the gated, normalised operator output [B,1,value_dim] (the block applies o_proj
        together with the residual add). Two GEMMs instead of nine for the projections, the three
        short convs as one op over the concatenated channels, the gates on slices of one output; the
        state and conv tails are updated in place, without host synchronisation. The same arithmetic
        as :meth:`decode_step` per element, up to the summation order inside the GEMMs.
        """
        B = x.shape[0]
        H, HV, K, V = self.num_heads, self.num_v_heads, self.head_k_dim, self.head_v_dim
        Kd, Vd = self.key_dim, self.value_dim
        proj = F.linear(x, weights.in_proj)  # [B, 1, 2Kd+Vd | Kd+Vd | 2r]
        pre_conv, bw, hidden = proj.split([2 * Kd + Vd, Kd + Vd, weights.low_rank.shape[1]], dim=-1)
        window = torch.cat([cache.conv.to(x.dtype), pre_conv], dim=1)  # [B, conv_size, C], oldest first
        conv = F.silu((window * weights.conv).sum(1, keepdim=True))
        cache.conv.copy_(window[:, 1:])
        # the slices are contiguous at B = 1; at B > 1 the copies let the kernel read them densely
        q, k, v = (t.contiguous() for t in conv.split([Kd, Kd, Vd], dim=-1))
        # The bias is added apart from the GEMM, so that the compiler folds it into the kernels that
        # read f and the gate (a GEMM with a bias copies the bias into its output first at batch 1). A
        # non-finite hidden unit would leak into the other stage through the zero blocks, but it
        # already makes this layer's output non-finite in the unfused step.
        f, gate = (F.linear(hidden.reshape(B, -1), weights.low_rank) + weights.low_rank_bias).split([Kd, Vd], dim=-1)
        g = weights.decay_rate * F.softplus(f.float() + self.dt_bias)
        b, w = (t.contiguous() for t in torch.sigmoid(bw).split([Kd, Vd], dim=-1))
        if self.allow_neg_eigval:
            b = b * 2.0
        o = recurrent_decode(q.reshape(B, 1, H, K), k.reshape(B, 1, H, K), v.reshape(B, 1, HV, V),
                             g.reshape(B, 1, H, K), b.reshape(B, 1, H, K), w.reshape(B, 1, HV, V), cache.state)
        return self.o_norm(o, gate.reshape(B, 1, HV, V)).reshape(B, 1, Vd)
