"""Token-recurrent GDN-2 in Triton: decoding and short prefill in one kernel launch.

Each program owns one (sequence, value head, value block) and keeps its fp32 ``[K, BV]`` slice of the
state in registers over all tokens of its sequence:

    S <- Diag(exp(g_t)) S ;  u = w_t*v_t - S^T (b_t*k_t) ;  S <- S + k_t u^T ;  o_t = scale * S^T q_t

Grouped value heads are resolved in the kernel (value head j reads key head j // (HV // H); g and b may
have H or HV heads), so nothing is repeated in memory.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from gdn2.ops.gdn2.naive import L2NORM_EPS
from gdn2.ops.gdn2.utils import padded


@triton.jit
def gdn2_recurrent_kernel(q, k, v, g, b, w, o, h0, ht, cu, scale, T,
                          H: tl.constexpr, HV: tl.constexpr, HG: tl.constexpr, HB: tl.constexpr,
                          K: tl.constexpr, V: tl.constexpr, KP: tl.constexpr, BV: tl.constexpr,
                          IS_VARLEN: tl.constexpr, HAS_H0: tl.constexpr, STORE_FINAL: tl.constexpr,
                          USE_L2: tl.constexpr, EPS: tl.constexpr):
    i_v = tl.program_id(0)
    i_nh = tl.program_id(1)
    i_n = i_nh // HV
    i_hv = i_nh % HV
    i_h = i_hv // (HV // H)
    i_hg = i_hv // (HV // HG)
    i_hb = i_hv // (HV // HB)
    if IS_VARLEN:
        bos = tl.load(cu + i_n).to(tl.int64)
        eos = tl.load(cu + i_n + 1).to(tl.int64)
    else:
        bos = i_n.to(tl.int64) * T
        eos = bos + T
    o_k = tl.arange(0, KP)
    m_k = o_k < K
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    m_kv = m_k[:, None] & m_v[None, :]
    p_s = (i_n.to(tl.int64) * HV + i_hv) * K * V + o_k[:, None] * V + o_v[None, :]
    b_h = tl.zeros([KP, BV], dtype=tl.float32)
    if HAS_H0:
        b_h += tl.load(h0 + p_s, mask=m_kv, other=0.0)
    for t in range(bos, eos):
        b_q = tl.load(q + (t * H + i_h) * K + o_k, mask=m_k, other=0.0).to(tl.float32)
        b_k = tl.load(k + (t * H + i_h) * K + o_k, mask=m_k, other=0.0).to(tl.float32)
        if USE_L2:
            b_q = b_q / tl.sqrt(tl.sum(b_q * b_q) + EPS)
            b_k = b_k / tl.sqrt(tl.sum(b_k * b_k) + EPS)
        b_g = tl.load(g + (t * HG + i_hg) * K + o_k, mask=m_k, other=0.0).to(tl.float32)
        b_b = tl.load(b + (t * HB + i_hb) * K + o_k, mask=m_k, other=0.0).to(tl.float32)
        b_v = tl.load(v + (t * HV + i_hv) * V + o_v, mask=m_v, other=0.0).to(tl.float32)
        b_w = tl.load(w + (t * HV + i_hv) * V + o_v, mask=m_v, other=0.0).to(tl.float32)
        b_h = b_h * tl.exp(b_g)[:, None]
        b_u = b_w * b_v - tl.sum(b_h * (b_b * b_k)[:, None], axis=0)
        b_h = b_h + b_k[:, None] * b_u[None, :]
        b_o = tl.sum(b_h * b_q[:, None], axis=0) * scale
        tl.store(o + (t * HV + i_hv) * V + o_v, b_o.to(o.dtype.element_ty), mask=m_v)
    if STORE_FINAL:
        tl.store(ht + p_s, b_h, mask=m_kv)


def fused_recurrent_gdn2_triton(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, b: torch.Tensor, w: torch.Tensor,
    scale: float, initial_state: Optional[torch.Tensor] = None, output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False, cu_seqlens: Optional[torch.Tensor] = None,
    inplace_final_state: bool = False,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Token-recurrent GDN-2 on validated inputs (see ``gdn2.ops.fused_recurrent_gdn2``).

    q, k: [B,T,H,K]; v, w: [B,T,HV,V]; g, b: [B,T,H or HV,K] (any float dtypes, computed in fp32);
    initial_state: fp32 [N,HV,K,V]. Returns o [B,T,HV,V] in q's dtype and the fp32 final state
    [N,HV,K,V] when ``output_final_state`` (``inplace_final_state`` writes it into ``initial_state``
    and returns that tensor). Inference only: when gradients are required the call is served by the
    differentiable chunked kernels instead.
    """
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                       for t in (q, k, v, g, b, w, initial_state)):
        if inplace_final_state:
            raise ValueError("inplace_final_state=True overwrites initial_state and cannot be used while "
                             "gradients are required; call under torch.no_grad() or drop inplace_final_state")
        from gdn2.ops.gdn2.chunk import chunk_gdn2_triton

        return chunk_gdn2_triton(q, k, v, g, b, w, scale, initial_state, output_final_state,
                                 use_qk_l2norm_in_kernel, cu_seqlens)
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    q, k, v, g, b, w = (t.contiguous() for t in (q, k, v, g, b, w))
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    o = torch.empty(B, T, HV, V, device=q.device, dtype=q.dtype)
    store_final = output_final_state or inplace_final_state
    h0 = None if initial_state is None else initial_state.contiguous()
    if inplace_final_state and h0 is initial_state:
        ht = initial_state  # each program reads its state tile before it writes the same tile
    elif store_final:
        ht = torch.empty(N, HV, K, V, device=q.device, dtype=torch.float32)
    else:
        ht = None
    cu = None
    if cu_seqlens is not None:
        cu = cu_seqlens if (cu_seqlens.dtype == torch.int32 and cu_seqlens.device == q.device) \
            else cu_seqlens.to(device=q.device, dtype=torch.int32)
    VP = padded(V)
    # Few (sequence, head) pairs: split V finer so that more programs share the state traffic. One warp
    # per 4096 state elements (128 fp32 registers a thread); the sweep behind it is in bench/NOTES.md
    BV = min(VP, 16 if N * HV < 1024 else 32)
    warps = max(1, padded(K) * BV // 4096)
    gdn2_recurrent_kernel[(triton.cdiv(V, BV), N * HV)](
        q, k, v, g, b, w, o, h0 if h0 is not None else o, ht if ht is not None else o,
        cu if cu is not None else o, scale, T,
        H=H, HV=HV, HG=g.shape[2], HB=b.shape[2], K=K, V=V, KP=padded(K), BV=BV,
        IS_VARLEN=cu is not None, HAS_H0=h0 is not None, STORE_FINAL=store_final,
        USE_L2=use_qk_l2norm_in_kernel, EPS=L2NORM_EPS, num_warps=warps)
    if inplace_final_state:
        if ht is not initial_state:
            initial_state.copy_(ht)
        return o, initial_state
    return o, (ht if output_final_state else None)
