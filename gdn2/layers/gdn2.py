"""The Gated DeltaNet-2 token mixer.

x -> q, k, v (full-rank, causal depthwise conv k=4 + SiLU), channel-wise decay g (low-rank, fp32),
erase gate b (key axis) and write gate w (value axis) -> GDN-2 operator (q, k L2-normalised inside) ->
per-head RMSNorm gated by silu(low-rank gate) -> output projection. No positional encoding.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch
import torch.nn as nn

from gdn2.config import Config
from gdn2.layers.decoding import recurrent_decode
from gdn2.layers.fused import causal_conv_silu, gated_rms_norm, gdn2_gates, project, runs_triton
from gdn2.layers.init import Linear
from gdn2.layers.recompute import RecomputeScope
from gdn2.ops import chunk_gdn2, short_conv_silu

if TYPE_CHECKING:
    from gdn2.inference import FusedGDN2

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
    if runs_triton("short_conv", x):
        return short_conv_silu(x, weight, pos_in_doc, backend="triton")
    return causal_conv_silu(x, weight, None, pos_in_doc)


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
        self.grouped_projections = False  # see GPT.set_grouped_projections
        self.recompute = False  # see GPT.set_recompute
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

    def forward(self, x: torch.Tensor, cu_seqlens: Optional[torch.Tensor] = None,
                pos_in_doc: Optional[torch.Tensor] = None, cache: Optional[GDN2Cache] = None,
                packed: bool = False, fused: Optional["FusedGDN2"] = None) -> torch.Tensor:
        """x: [B,T,d] -> [B,T,d].

        ``cu_seqlens`` (B == 1) restarts the state and the conv at each document start; ``pos_in_doc``
        [T] is the matching position inside the document. ``cache`` continues from its state and conv
        tails and is updated in place, without host synchronisation (a CUDA graph can capture a
        one-token step). ``packed=True`` (with ``cu_seqlens`` and an empty ``cache`` of one row per
        document): each document's final state and conv tails go to its cache row (prefill of several
        prompts). ``fused`` (:class:`gdn2.inference.FusedGDN2`): the input projections as two GEMMs
        and the three convs as one, over copies of these parameters (decoding).
        """
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
                # one GEMM for all seven when grouped projections are on, else seven (see fused.project)
                qp, kp, vp, f_lo, b, w, g_lo = project(x, (self.q_proj, self.k_proj, self.v_proj, self.f_proj[0],
                                                           self.b_proj, self.w_proj, self.g_proj[0]),
                                                       self.grouped_projections)
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
                g, b, w = gdn2_gates(f, b, w, self.A_log, self.dt_bias, K, b_scale)
            q, k, b, g = (t.reshape(B, T, H, K) for t in (q, k, b, g))
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
        backward to rebuild (``recompute``, set by :meth:`gdn2.model.GPT.set_recompute`; a forward with
        gradients and without a cache). The operator's own intermediates (Aqk, A, R) are then rebuilt
        by its backward (``chunk_gdn2(..., recompute=True)``)."""
        return self.recompute and cache is None and fused is None and torch.is_grad_enabled()

    def _operator_inputs(self, pre: tuple, logits: tuple, pos_in_doc: Optional[torch.Tensor], b_scale: float,
                         tails: tuple = (None,) * 3, packed_cu_seqlens: Optional[torch.Tensor] = None
                         ) -> tuple[torch.Tensor, ...]:
        """q, k, v (short conv + SiLU, see :meth:`_conv` for ``tails`` and ``packed_cu_seqlens``), the
        decay's full-rank projection f and the gates g, b, w from the projections ``pre`` (q, k, v) and
        ``logits`` (f's low-rank one, b, w)."""
        taps = (self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight)
        q, k, v = (self._conv(p, weight, tail, pos_in_doc, packed_cu_seqlens)
                   for p, weight, tail in zip(pre, taps, tails))
        f_lo, b, w = logits
        f = self.f_proj[1](f_lo)
        return (q, k, v, f, *gdn2_gates(f, b, w, self.A_log, self.dt_bias, self.head_k_dim, b_scale))

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
            return recurrent_decode(q, k, v, g, b, w, cache.state)
        else:
            o, final = chunk_gdn2(q, k, v, g, b, w, initial_state=cache.state, output_final_state=True,
                                  use_qk_l2norm_in_kernel=True)
        cache.state.copy_(final)
        return o
