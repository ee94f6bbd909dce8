"""Plain-PyTorch oracles of the GDN-2 operators; also their CPU execution path.

Every function works in any floating dtype (float64 included), supports autograd through every
tensor input and follows the layout ``[B, T, H, D]``. Per (sequence, head) a fp32 state ``S`` of shape
``[K, V]`` and, per token,

    S <- Diag(exp(g_t)) S
    u_t = w_t * v_t - S^T (b_t * k_t)
    S <- S + k_t u_t^T
    o_t = scale * S^T q_t

Grouped value heads: q and k have ``H`` heads, v and w have ``HV`` heads (a multiple of ``H``),
g and b have either; value head ``j`` uses key head ``j // (HV // H)``.
"""

from __future__ import annotations

from typing import Optional

import torch

CHUNK_SIZE = 64
L2NORM_EPS = 1e-6


def l2norm(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last axis, computed in at least fp32."""
    xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
    return (xf * torch.rsqrt(xf.square().sum(-1, keepdim=True) + eps)).to(x.dtype)


def _expand_heads(x: torch.Tensor, hv: int) -> torch.Tensor:
    h = x.shape[2]
    return x if h == hv else x.repeat_interleave(hv // h, dim=2)


def _prepare(q, k, v, g, b, w, scale, use_qk_l2norm_in_kernel):
    """Normalise, broadcast heads to HV and move everything to one compute dtype."""
    compute = torch.float64 if v.dtype == torch.float64 else torch.float32
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    hv = v.shape[2]
    q, k, g, b = (_expand_heads(t, hv) for t in (q, k, g, b))
    if scale is None:
        scale = q.shape[-1] ** -0.5
    return [t.to(compute) for t in (q, k, v, g, b, w)], scale, compute


def _segments(T: int, cu_seqlens: Optional[torch.Tensor], batch: int) -> list[tuple[int, int, int, int]]:
    """(batch row, state row, start, end) of every sequence."""
    if cu_seqlens is None:
        return [(i, i, 0, T) for i in range(batch)]
    cu = [int(c) for c in cu_seqlens.tolist()]
    return [(0, n, cu[n], cu[n + 1]) for n in range(len(cu) - 1)]


def recurrent_gdn2_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, b: torch.Tensor, w: torch.Tensor,
    scale: Optional[float] = None, initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False, use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The token recurrence, one step at a time: the ground truth.

    q, k: [B,T,H,K]; v, w: [B,T,HV,V]; g, b: [B,T,H or HV,K]; initial_state: [N,HV,K,V] where N is B or
    the number of sequences in ``cu_seqlens``. Returns o [B,T,HV,V] in v's dtype and, if asked, the
    final state [N,HV,K,V] (float64 for float64 inputs, else float32).
    """
    B, T, HV, Vd = v.shape
    out_dtype = q.dtype
    (q, k, v, g, b, w), scale, compute = _prepare(q, k, v, g, b, w, scale, use_qk_l2norm_in_kernel)
    K = q.shape[-1]
    segs = _segments(T, cu_seqlens, B)
    outs = [[None] * T for _ in range(B)]
    finals = []
    for bi, n, start, end in segs:
        S = (initial_state[n].to(compute) if initial_state is not None
             else q.new_zeros(HV, K, Vd))
        for t in range(start, end):
            S = S * g[bi, t].exp()[..., None]
            u = w[bi, t] * v[bi, t] - torch.einsum("hkv,hk->hv", S, b[bi, t] * k[bi, t])
            S = S + k[bi, t][..., None] * u[:, None, :]
            outs[bi][t] = scale * torch.einsum("hkv,hk->hv", S, q[bi, t])
        finals.append(S)
    if T == 0:
        o = v.new_zeros(B, 0, HV, Vd)
    else:
        o = torch.stack([torch.stack(row) for row in outs])
    final = torch.stack(finals) if output_final_state else None
    return o.to(out_dtype), final


def _chunk_scan(q, k, v, g, b, w, scale, S, chunk_size):
    """Chunked WY form over one sequence. Tensors [B,T,H,D] (already prepared); S: [B,H,K,V]."""
    T = q.shape[1]
    outs = []
    for s in range(0, T, chunk_size):
        e = min(s + chunk_size, T)
        # [B,H,C,D]
        qc, kc, vc, gc, bc, wc = (t[:, s:e].transpose(1, 2) for t in (q, k, v, g, b, w))
        G = gc.cumsum(2)  # cumulative log-decay inside the chunk, <= 0
        C = e - s
        # pairwise relative decays exp(G_r - G_s) for s <= r (exponent <= 0; no overflow possible)
        diff = G[:, :, :, None, :] - G[:, :, None, :, :]  # [B,H,C,C,K]
        causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
        decay = torch.where(causal[:, :, None], diff, torch.full_like(diff, float("-inf"))).exp()
        Aqk = scale * torch.einsum("bhrk,bhsk,bhrsk->bhrs", qc, kc, decay)
        Tm = torch.einsum("bhrk,bhsk,bhrsk->bhrs", bc * kc, kc, decay).tril(-1)
        eye = torch.eye(C, dtype=q.dtype, device=q.device)
        gamma = G.exp()
        Eb = bc * kc * gamma
        Z = wc * vc
        rhs = torch.cat([Eb, Z], dim=-1)
        sol = torch.linalg.solve_triangular(eye + Tm, rhs, upper=False, unitriangular=True)
        Y, U = sol[..., : Eb.shape[-1]], sol[..., Eb.shape[-1]:]
        R = U - Y @ S
        outs.append(scale * (qc * gamma) @ S + Aqk @ R)
        tail = (G[:, :, -1:, :] - G).exp()  # gamma_C / gamma_r <= 1
        S = gamma[:, :, -1, :, None] * S + (kc * tail).transpose(-1, -2) @ R
    o = torch.cat(outs, dim=2).transpose(1, 2) if outs else v.new_zeros(v.shape)
    return o, S


def chunk_gdn2_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, b: torch.Tensor, w: torch.Tensor,
    scale: Optional[float] = None, initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False, use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: Optional[torch.Tensor] = None, chunk_size: int = CHUNK_SIZE,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The chunked (WY) form, equal to :func:`recurrent_gdn2_reference`, vectorised over B and heads.

    Same arguments and shapes. Inside a chunk only relative decays ``exp(G_r - G_s)`` with ``s <= r``
    are formed, so harsh gates cannot overflow.
    """
    B, T, HV, Vd = v.shape
    out_dtype = q.dtype
    (q, k, v, g, b, w), scale, compute = _prepare(q, k, v, g, b, w, scale, use_qk_l2norm_in_kernel)
    K = q.shape[-1]
    if cu_seqlens is None:
        S0 = (initial_state.to(compute) if initial_state is not None
              else q.new_zeros(B, HV, K, Vd))
        o, S = _chunk_scan(q, k, v, g, b, w, scale, S0, chunk_size)
        final = S
    else:
        outs, finals = [], []
        for _, n, start, end in _segments(T, cu_seqlens, B):
            S0 = (initial_state[n: n + 1].to(compute) if initial_state is not None
                  else q.new_zeros(1, HV, K, Vd))
            sl = [t[:, start:end] for t in (q, k, v, g, b, w)]
            o_n, S_n = _chunk_scan(*sl, scale, S0, chunk_size)
            outs.append(o_n)
            finals.append(S_n)
        o = torch.cat(outs, dim=1) if outs else v.new_zeros(v.shape)
        final = torch.cat(finals, dim=0)
    return o.to(out_dtype), (final if output_final_state else None)
