"""The Gated DeltaNet-2 token mixer.

x -> q, k, v (full-rank, causal depthwise conv k=4 + SiLU), channel-wise decay g (low-rank, fp32),
erase gate b (key axis) and write gate w (value axis) -> GDN-2 operator (q, k L2-normalised inside) ->
per-head RMSNorm gated by silu(low-rank gate) -> output projection. No positional encoding.

Gate granularity (``Config.gdn2_decay`` / ``gdn2_erase`` / ``gdn2_write``, ``gdn2_tied_gates``): a gate
"per head" is a projection to one value per head, repeated over the head's channels before the operator
(the same operator). Tied gates are one projection per value head whose gate is both b and w (KDA with a
channel decay, Gated DeltaNet with a decay per head too); ``allow_neg_eigval`` then doubles that shared
gate, ``b = w = 2 sigmoid(.)``, as Gated DeltaNet's doubled beta scales both its erase and its write.

The layer owns its decode layout: :class:`GDN2Cache` (the recurrent state and the short-conv tails) and
:class:`FusedGDN2` (copies of its input projections in a layout for few-token steps); a decode step is
its forward with a cache, through the in-place custom op ``gdn2::recurrent_decode`` for short inputs.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from gdn2.config import Config
from gdn2.layout import TokenLayout
from gdn2.linear import project
from gdn2.modules import Linear
from gdn2.ops import chunk_gdn2, recurrent_decode_op, short_conv_silu
from gdn2.recompute import RecomputeScope
from gdn2.stages import causal_conv_silu, gated_rms_norm, gdn2_gates

INNER_GAIN = 2 ** -2.5  # Xavier gain of every linear inside the layer (reference init)


@dataclass
class GDN2Cache:
    """Decoding state of one GDN-2 layer: the fp32 recurrent state and the short-conv input tails.

    The tails of q, k and v live side by side in one buffer (the channel order of the fused decode
    conv); ``conv_q`` / ``conv_k`` / ``conv_v`` are views of it.
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


def short_conv(channels: int, kernel_size: int) -> nn.Conv1d:
    """The parameters of a causal depthwise convolution (applied by ``causal_conv_silu``)."""
    return nn.Conv1d(channels, channels, kernel_size, groups=channels, bias=False)


def conv_tail(x: torch.Tensor, tail: torch.Tensor) -> torch.Tensor:
    """The last ``tail.shape[1]`` inputs once x [B,T,C] follows ``tail`` [B, ks-1, C]."""
    return torch.cat([tail.to(x.dtype), x], dim=1)[:, x.shape[1]:]


def packed_conv_tails(x: torch.Tensor, cu_seqlens: torch.Tensor, kernel_size: int) -> torch.Tensor:
    """The last kernel_size-1 inputs of each packed sequence, zeros before its start.

    x: [1, total, C] pre-conv inputs; cu_seqlens: [N+1]. Returns [N, kernel_size-1, C]."""
    cu = cu_seqlens.long()
    idx = cu[1:, None] - (kernel_size - 1) + torch.arange(kernel_size - 1, device=x.device)[None, :]
    inside = idx >= cu[:-1, None]
    tails = x[0][idx.clamp_min(0)]
    return tails * inside[..., None].to(tails.dtype)


def conv_from_start(x: torch.Tensor, weight: torch.Tensor, pos_in_doc: Optional[torch.Tensor]) -> torch.Tensor:
    """silu(short conv) of x [B,T,C] with nothing before it: the Triton kernel where the operator's
    backend is Triton (CUDA), else the (compiled) torch stage. The kernel saves only its input for the
    backward, where the compiled stage keeps more (1.6 GiB less at 4 x 4096 in the 1.3B hybrid)."""
    return short_conv_silu(x, weight, pos_in_doc, torch_path=causal_conv_silu)


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
        self.q_conv1d = short_conv(self.key_dim, self.conv_size)
        self.k_conv1d = short_conv(self.key_dim, self.conv_size)
        self.v_conv1d = short_conv(self.value_dim, self.conv_size)
        self.tied_gates = c.gdn2_tied_gates
        # channels each value of g, b and w covers: 1 per channel, the head dim per head
        self.gate_spans = (self.head_k_dim if c.gdn2_decay == "head" else 1,
                           self.head_k_dim if c.gdn2_erase == "head" else 1,
                           self.head_v_dim if c.gdn2_write == "head" else 1)
        self.f_proj = nn.Sequential(lin(d, r), lin(r, c.gdn2_decay_units))  # decay, low rank
        self.b_proj = lin(d, c.gdn2_erase_units)  # erase gate (key axis); tied: also the write gate
        if not self.tied_gates:
            self.w_proj = lin(d, c.gdn2_write_units)  # write gate (value axis)
        self.A_log = nn.Parameter(torch.empty(self.num_heads, dtype=torch.float32))
        self.dt_bias = nn.Parameter(torch.empty(c.gdn2_decay_units, dtype=torch.float32))
        self.A_log._no_weight_decay = True
        self.dt_bias._no_weight_decay = True
        self.g_proj = nn.Sequential(lin(d, r), lin(r, self.value_dim, bias=True))  # output gate
        self.o_norm = GatedRMSNorm(self.head_v_dim, eps=c.norm_eps)
        self.o_proj = lin(self.value_dim, d)
        self.grouped_projections = False  # set by gdn2.options.apply_options
        self.recompute = False  # set by gdn2.options.apply_options
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """A_log = log U(1, 16) per head; dt ~ logU(1e-3, 1e-1) per decay unit (key channel, or head),
        dt_bias = softplus^-1(dt)."""
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

    def gate_projections(self) -> list[nn.Linear]:
        """The erase and write gates' projections: b_proj and w_proj, or b_proj alone when tied."""
        return [self.b_proj] if self.tied_gates else [self.b_proj, self.w_proj]

    def input_projections(self) -> list[nn.Linear]:
        """The projections of the layer input, in the row order of :attr:`FusedGDN2.in_proj`."""
        return [self.q_proj, self.k_proj, self.v_proj, *self.gate_projections(), self.f_proj[0], self.g_proj[0]]

    def float8_exempt(self) -> list[nn.Linear]:
        """The projections that stay in bf16 under float8: the gates' low-rank up-projections, whose GEMMs
        reduce over the gate rank only, and the gates per head, whose GEMMs are a few columns wide."""
        per_head = [lin for lin, span in zip(self.gate_projections(), self.gate_spans[1:]) if span > 1]
        return [self.f_proj[1], self.g_proj[1], *per_head]

    def decode_weights(self) -> "FusedGDN2":
        """New copies of this layer's input projections and convs in the decode layout."""
        return FusedGDN2.of(self)

    def forward(self, x: torch.Tensor, layout: Optional[TokenLayout] = None, cache: Optional[GDN2Cache] = None,
                fused: Optional["FusedGDN2"] = None) -> torch.Tensor:
        """x: [B,T,d] -> [B,T,d].

        ``layout.cu_seqlens`` (B == 1) restarts the state and the conv at each document start;
        ``layout.pos_in_doc`` [T] is the matching position inside the document. ``cache`` continues from
        its state and conv tails and is updated in place, without host synchronisation (a CUDA graph can
        capture a one-token step). ``layout.packed`` (with an empty ``cache`` of one row per document):
        each document's final state and conv tails go to its cache row (prefill of several prompts).
        ``fused`` (:meth:`decode_weights`): the input projections as two GEMMs and the three convs as
        one, over copies of these parameters (decoding).
        """
        cu_seqlens = layout.cu_seqlens if layout is not None else None
        pos_in_doc = layout.pos_in_doc if layout is not None else None
        packed = layout is not None and layout.packed is not None
        B, T, _ = x.shape
        H, HV, K, V = self.num_heads, self.num_v_heads, self.head_k_dim, self.head_v_dim
        Kd, Vd = self.key_dim, self.value_dim
        if packed and (cache is None or cu_seqlens is None):
            raise ValueError("packed prompts need cu_seqlens and a cache to fill")
        if cache is not None and cu_seqlens is not None and not packed:
            raise ValueError("cu_seqlens cannot be combined with a decoding cache")
        b_scale = 2.0 if self.allow_neg_eigval else 1.0
        scope = RecomputeScope() if self._recomputes(cache, fused) else None
        with scope if scope is not None else contextlib.nullcontext():
            if fused is None:
                # one GEMM for all seven (six when tied) when grouped projections are on, else one each
                qp, kp, vp, f_lo, b, *w, g_lo = project(x, (self.q_proj, self.k_proj, self.v_proj, self.f_proj[0],
                                                            *self.gate_projections(), self.g_proj[0]),
                                                        self.grouped_projections)
                w = w[0] if w else None
                tails = (None,) * 3 if cache is None else (cache.conv_q, cache.conv_k, cache.conv_v)
                made_from = ((qp, kp, vp), (f_lo, b, w), pos_in_doc, b_scale)
                inputs = self._operator_inputs(*made_from, tails, cu_seqlens if packed else None)
                q, k, v, f, g, b, w = inputs
                if scope is not None:
                    # kept instead: the projections these come from (which their own backward needs)
                    scope.recompute(inputs, lambda: self._operator_inputs(*made_from))
            else:
                qkv, f, b, w, gate = fused.project(x)
                conv = self._conv(qkv, fused.conv, None if cache is None else cache.conv, pos_in_doc,
                                  cu_seqlens if packed else None)
                # slices of the fused conv output: dense copies for the kernel (free at batch 1)
                q, k, v = (t.contiguous() for t in conv.split([Kd, Kd, Vd], dim=-1))
                g, b, w = gdn2_gates(f, b, w, self.A_log, self.dt_bias, b_scale, self.gate_spans)
            q, k, g = (t.reshape(B, T, H, K) for t in (q, k, g))
            b = b.reshape(B, T, -1, K)  # H heads, or HV for a tied gate
            v, w = v.reshape(B, T, HV, V), w.reshape(B, T, HV, V)
            o = self._mix(q, k, v, g, b, w, cu_seqlens, cache, packed, recompute=scope is not None)
            if fused is None:
                gate, o_gated = self._gated_output(o, g_lo)
            else:
                o_gated = self._gated_norm(o, gate)
            if scope is not None:
                scope.recompute((gate, o_gated), lambda: self._gated_output(o, g_lo))
            return self.o_proj(o_gated)

    def _recomputes(self, cache: Optional[GDN2Cache], fused: Optional["FusedGDN2"]) -> bool:
        """Whether this forward lets go of the operator's inputs, the output gate and the gated norm for the
        backward to rebuild (``recompute``, set by :func:`gdn2.options.apply_options`; a forward with
        gradients and without a cache). The operator's own intermediates (Aqk, A, R) are then rebuilt
        by its backward (``chunk_gdn2(..., recompute=True)``)."""
        return self.recompute and cache is None and fused is None and torch.is_grad_enabled()

    def _operator_inputs(self, pre: tuple, logits: tuple, pos_in_doc: Optional[torch.Tensor], b_scale: float,
                         tails: tuple = (None,) * 3, packed_cu_seqlens: Optional[torch.Tensor] = None
                         ) -> tuple[torch.Tensor, ...]:
        """q, k, v (short conv + SiLU, see :meth:`_conv` for ``tails`` and ``packed_cu_seqlens``), the
        decay's full-rank projection f and the gates g, b, w from the projections ``pre`` (q, k, v) and
        ``logits`` (f's low-rank one, b, w; w None when tied)."""
        taps = (self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight)
        q, k, v = (self._conv(p, weight, tail, pos_in_doc, packed_cu_seqlens)
                   for p, weight, tail in zip(pre, taps, tails))
        f_lo, b, w = logits
        f = self.f_proj[1](f_lo)
        return (q, k, v, f, *gdn2_gates(f, b, w, self.A_log, self.dt_bias, b_scale, self.gate_spans))

    def _gated_norm(self, o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """The per-head norm of o [B,T,HV,V] gated by the output gate [B,T,HV*V], as [B,T,HV*V]."""
        return self.o_norm(o, gate.reshape(o.shape)).reshape(*o.shape[:2], -1)

    def _gated_output(self, o: torch.Tensor, g_lo: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The output gate from its low-rank projection ``g_lo``, and o's gated norm."""
        gate = self.g_proj[1](g_lo)
        return gate, self._gated_norm(o, gate)

    def _conv(self, x: torch.Tensor, weight: torch.Tensor, tail: Optional[torch.Tensor],
              pos_in_doc: Optional[torch.Tensor], packed_cu_seqlens: Optional[torch.Tensor]) -> torch.Tensor:
        """silu(short conv) of x [B,T,C]; ``tail`` (a cache view) holds the inputs before x and is
        advanced in place, or, for packed prompts, receives each document's last inputs."""
        if tail is None:
            return conv_from_start(x, weight, pos_in_doc)
        if packed_cu_seqlens is not None:
            y = conv_from_start(x, weight, pos_in_doc)
            tail.copy_(packed_conv_tails(x, packed_cu_seqlens, weight.shape[-1]))
            return y
        y = causal_conv_silu(x, weight, tail, pos_in_doc)
        tail.copy_(conv_tail(x, tail))
        return y

    def _mix(self, q, k, v, g, b, w, cu_seqlens: Optional[torch.Tensor], cache: Optional[GDN2Cache],
             packed: bool, recompute: bool = False) -> torch.Tensor:
        """The GDN-2 operator; with a cache, from its state, which is advanced in place. ``recompute``
        (a forward that rebuilds the operator's inputs, see :meth:`_recomputes`): the operator keeps only
        those inputs and rebuilds its own intermediates in its backward."""
        if cache is None:
            o, _ = chunk_gdn2(q, k, v, g, b, w, use_qk_l2norm_in_kernel=True, cu_seqlens=cu_seqlens,
                              recompute=recompute)
            return o
        if packed:
            o, final = chunk_gdn2(q, k, v, g, b, w, output_final_state=True, use_qk_l2norm_in_kernel=True,
                                  cu_seqlens=cu_seqlens)
        elif q.shape[1] <= self.recurrent_max_len and not (self.training and torch.is_grad_enabled()):
            # short inputs (decoding): the token-recurrent kernel, which has no backward
            return recurrent_decode_op(q, k, v, g, b, w, cache.state)
        else:
            o, final = chunk_gdn2(q, k, v, g, b, w, initial_state=cache.state, output_final_state=True,
                                  use_qk_l2norm_in_kernel=True)
        cache.state.copy_(final)
        return o


@dataclass
class FusedGDN2:
    """Copies of one GDN-2 layer's input projections in a layout for few-token steps: the seven (six with
    tied gates) input projections as one GEMM, the two low-rank second stages as one, the three short
    convs as one."""

    # [2*key_dim + value_dim + erase_units + write_units + 2*rank, d]: the rows of q_proj | k_proj |
    # v_proj | b_proj | w_proj (none when tied) | f_proj[0] | g_proj[0]
    in_proj: torch.Tensor
    # [decay_units + value_dim, 2*rank] block diagonal: f_proj[1] on the decay's hidden units, g_proj[1]
    # on the gate's; ``low_rank_bias`` is 0 | g_proj[1].bias
    low_rank: torch.Tensor
    low_rank_bias: torch.Tensor
    conv: torch.Tensor  # [2*key_dim + value_dim, 1, conv_size]: taps of q | k | v, GDN2Cache.conv's order
    key_dim: int
    value_dim: int
    # rows of the decay's (f_proj[1]), the erase gate's and the write gate's projections (0 when tied):
    # key_dim, key_dim, value_dim for channel gates, a head count for a gate per head
    decay_units: int
    erase_units: int
    write_units: int

    @classmethod
    def of(cls, layer: "GatedDeltaNet2") -> "FusedGDN2":
        """New buffers in this layout, filled from ``layer``'s parameters (in their dtype and device)."""
        ref, first = layer.q_proj.weight, layer.input_projections()
        names = {id(module): name for name, module in layer.named_modules()}  # w_proj is absent when tied
        for lin in first + [layer.f_proj[1], layer.g_proj[1]]:
            name = names[id(lin)]
            if lin.weight.dtype != ref.dtype or lin.weight.device != ref.device:
                raise ValueError(f"layer {layer.layer_idx}: {name}.weight is {lin.weight.dtype} on "
                                 f"{lin.weight.device}, q_proj.weight {ref.dtype} on {ref.device}: the fused "
                                 "decode projections need one dtype and device")
            if lin in first and lin.bias is not None:
                raise ValueError(f"layer {layer.layer_idx}: {name} has a bias, which the fused input GEMM omits")
        Kd, Vd, r = layer.key_dim, layer.value_dim, layer.f_proj[1].in_features
        Fu, Bu = layer.f_proj[1].out_features, layer.b_proj.out_features
        Wu = 0 if layer.tied_gates else layer.w_proj.out_features
        fused = cls(ref.new_empty(2 * Kd + Vd + Bu + Wu + 2 * r, ref.shape[1]), ref.new_zeros(Fu + Vd, 2 * r),
                    ref.new_zeros(Fu + Vd), ref.new_empty(2 * Kd + Vd, 1, layer.conv_size), Kd, Vd, Fu, Bu, Wu)
        fused.copy_from(layer)
        return fused

    @torch.no_grad()
    def copy_from(self, layer: "GatedDeltaNet2") -> None:
        """Copy ``layer``'s parameters into these buffers (the zero blocks stay zero)."""
        f1, g1 = layer.f_proj[1], layer.g_proj[1]
        Fu, r = self.decay_units, f1.in_features
        torch.cat([lin.weight for lin in layer.input_projections()], dim=0, out=self.in_proj)
        self.low_rank[:Fu, :r].copy_(f1.weight)
        self.low_rank[Fu:, r:].copy_(g1.weight)
        for bias, part in ((f1.bias, self.low_rank_bias[:Fu]), (g1.bias, self.low_rank_bias[Fu:])):
            if bias is not None:
                part.copy_(bias)
        for conv, part in zip((layer.q_conv1d, layer.k_conv1d, layer.v_conv1d),
                              self.conv.split([self.key_dim, self.key_dim, self.value_dim])):
            part.copy_(conv.weight)

    @staticmethod
    def sources(layer: "GatedDeltaNet2") -> list[torch.Tensor]:
        """The parameters :meth:`copy_from` copies."""
        linears = layer.input_projections() + [layer.f_proj[1], layer.g_proj[1]]
        return ([p for lin in linears for p in (lin.weight, lin.bias) if p is not None]
                + [layer.q_conv1d.weight, layer.k_conv1d.weight, layer.v_conv1d.weight])

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x [B,T,d] -> the pre-conv q | k | v [B,T,2*key_dim+value_dim] and the pre-activation f,
        b, w (None when tied) and output gate, as the layer's own projections give them."""
        B, T, _ = x.shape
        Kd, Vd, Fu, Bu, Wu = self.key_dim, self.value_dim, self.decay_units, self.erase_units, self.write_units
        qkv, bw, hidden = F.linear(x, self.in_proj).split([2 * Kd + Vd, Bu + Wu, self.low_rank.shape[1]], dim=-1)
        # The bias is added apart from the GEMM, so that the compiler folds it into the kernels that
        # read f and the gate. A non-finite hidden unit would leak into the other stage through the
        # zero blocks, but it already makes this layer's output non-finite unfused.
        low = F.linear(hidden.reshape(B * T, -1), self.low_rank) + self.low_rank_bias
        f, gate = low.reshape(B, T, Fu + Vd).split([Fu, Vd], dim=-1)
        b, w = bw.split([Bu, Wu], dim=-1) if Wu else (bw, None)
        return qkv, f, b, w, gate

    def tensors(self) -> list[torch.Tensor]:
        return [self.in_proj, self.low_rank, self.low_rank_bias, self.conv]
