"""Chunked GDN-2 in Triton: forward, backward and the autograd Function behind ``chunk_gdn2``.

Forward: [L2 norm of q, k] -> ``gdn2_intra_kernel`` (Aqk and A, chunk-parallel) -> ``gdn2_prep_kernel``
(Qg, Y, Kt, U, chunk-parallel) -> ``gdn2_fwd_scan_kernel`` (the state scan, which also writes o). For
training the forward saves Aqk and A ([TT, H, 64] each, input dtype) and R; at K = V = 128 Aqk and A
take half the bytes of per-chunk state checkpoints. It also keeps the fp32 state every STATE_SEGMENT
(64) chunks inside a sequence (1/64 of the per-chunk states). Backward: ``gdn2_prep_kernel`` again
without U (the intra kernel is not re-run) -> ``gdn2_state_scan_kernel`` (the states at every chunk
start from R, one product per chunk, in parallel over windows of 64 chunks) -> ``gdn2_bwd_scan_kernel``
(one reverse scan) -> ``gdn2_bwd_wy_kernel`` -> ``gdn2_bwd_intra_kernel`` -> ``gdn2_bwd_qkbg_kernel``
(chunk-parallel) -> [L2 norm backward]. With ``recompute`` the forward keeps only its inputs and the
backward first runs the forward's kernels again for Aqk, A, R and the window starts (the prep kernel
then runs once, with U, its other outputs serving the backward too).

The math and kernel layout are documented in ``chunk_fwd`` and ``chunk_bwd``.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton

from gdn2.ops.gdn2.chunk_bwd import (gdn2_bwd_intra_kernel, gdn2_bwd_qkbg_kernel, gdn2_bwd_scan_kernel,
                                     gdn2_bwd_wy_kernel)
from gdn2.ops.gdn2.chunk_fwd import gdn2_fwd_scan_kernel, gdn2_intra_kernel, gdn2_prep_kernel, gdn2_state_scan_kernel
from gdn2.ops.gdn2.l2norm import l2norm_bwd, l2norm_fwd
from gdn2.ops.gdn2.utils import CHUNK, EXACT_SPAN, SUB, ChunkLayout, chunk_layout, dot_precision, padded


# chunks per window of the backward's state scan (see ``gdn2_state_scan_kernel``): windows, not
# sequences, set its parallelism, so 1 x 32768 gets as many programs as 8 x 4096
STATE_SEGMENT = 64


def state_windows(lay: ChunkLayout) -> int:
    return triton.cdiv(lay.NC, STATE_SEGMENT)


def window_starts_buffer(lay: ChunkLayout, H: int, K: int, V: int, device) -> torch.Tensor:
    """fp32 [windows, H, K, V] for the state at every window start that lies inside a sequence (the
    forward scan writes them); a one-element placeholder when every window starts a sequence."""
    inside = lay.varlen or lay.NT > STATE_SEGMENT
    shape = (state_windows(lay), H, K, V) if inside else (1,)
    return torch.empty(shape, device=device, dtype=torch.float32)


def _intra_grid0(programs: int, exact: bool) -> int:
    """First grid axis of an intra kernel launch: its ``programs`` chunk (or chunk x key block)
    programs, or, for the exact-path launch, one program per EXACT_SPAN of them."""
    return triton.cdiv(programs, EXACT_SPAN) if exact else programs


def _size_bucket(n: int) -> int:
    # scan config key (GDN2_AUTOTUNE=1) and BV heuristic input: the next power of two of N * H
    return 1 << max(0, (max(n, 1) - 1).bit_length())


def chunk_operands(q, k, g, b, v, w, amat, lay: ChunkLayout, with_u: bool):
    """Y, Kt, Qg (like q), exp2(G_C) (fp32 [NC, H, K]) and, ``with_u``, U (like v; else None) from A
    (see ``gdn2_prep_kernel``)."""
    TT, H, K = q.shape
    V = v.shape[-1]
    y = torch.empty_like(q)
    kt = torch.empty_like(q)
    qg = torch.empty_like(q)
    u = torch.empty_like(v) if with_u else None
    gcl = torch.empty(lay.NC, H, K, device=q.device, dtype=torch.float32)
    cu, info, _ = lay.kernel_args(gcl)
    gdn2_prep_kernel[lambda meta: (lay.NC * (triton.cdiv(K, meta["BK"]) + with_u * triton.cdiv(V, meta["BV"])), H)](
        q, k, b, g, v, w, amat, y, kt, qg, u if with_u else y, gcl, cu, info, lay.T, lay.NT,
        H=H, K=K, V=V, KP=padded(K), VP=padded(V), IS_VARLEN=lay.varlen, WITH_U=int(with_u),
        DOT_PREC=dot_precision(q.dtype), BT=CHUNK)
    return y, kt, qg, u, gcl


def forward_operands(q, k, g, b, v, w, scale, lay: ChunkLayout):
    """Chunk-parallel part of the forward: Aqk and A (``gdn2_intra_kernel``), then Y, Kt, Qg, U, exp2(G_C)."""
    TT, H, K = q.shape
    dev, dt = q.device, q.dtype
    aqk = torch.empty(TT, H, CHUNK, device=dev, dtype=dt)
    amat = torch.empty(TT, H, CHUNK, device=dev, dtype=dt)
    steep = torch.empty(lay.NC, H, device=dev, dtype=torch.int32)
    cu, info, _ = lay.kernel_args(steep)
    # anchored diagonal blocks everywhere, then the chunks flagged in ``steep`` again with the exact path
    for exact in (False, True):
        gdn2_intra_kernel[(_intra_grid0(lay.NC, exact), H)](
            q, k, g, b, aqk, amat, steep, cu, info, scale, lay.T, lay.NT, lay.NC,
            H=H, K=K, KP=padded(K), IS_VARLEN=lay.varlen, EXACT=exact,
            DOT_PREC=dot_precision(dt), BT=CHUNK, BC=SUB, SPAN=EXACT_SPAN)
    return (aqk, amat) + chunk_operands(q, k, g, b, v, w, amat, lay, with_u=True)


def gdn2_forward(q, k, v, g, b, w, scale, initial_state, output_final_state, lay: ChunkLayout,
                 for_backward: bool):
    """Flattened forward. q, k, b, g: [TT, H, K]; v, w: [TT, H, V] (contiguous, q's dtype except g).

    Returns o [TT, H, V], the final state (fp32 [N, H, K, V] or None) and, when ``for_backward``, what
    the backward needs besides the inputs: (Aqk, A, R, window starts), [TT, H, 64] / [TT, H, 64] /
    [TT, H, V] in q's dtype and the states where a state-scan window starts inside a sequence (see
    :func:`window_starts_buffer`; else None).
    """
    aqk, amat, y, kt, qg, u, gcl = forward_operands(q, k, g, b, v, w, scale, lay)
    o, ht, rbuf, hseg = forward_scan(y, u, kt, qg, aqk, gcl, scale, initial_state, lay, for_backward)
    saved = (aqk, amat, rbuf, hseg) if for_backward else None
    return o, (ht if output_final_state else None), saved


def forward_scan(y, u, kt, qg, aqk, gcl, scale, initial_state, lay: ChunkLayout, for_backward: bool):
    """The state scan of the forward over the chunk operands of :func:`forward_operands`: o [TT, H, V],
    the fp32 final state [N, H, K, V] and, when ``for_backward``, R and the window-start states (else
    None)."""
    TT, H, K = y.shape
    V = u.shape[-1]
    dev, dt = y.device, y.dtype
    o = torch.empty(TT, H, V, device=dev, dtype=dt)
    ht = torch.empty(lay.N, H, K, V, device=dev, dtype=torch.float32)
    h0 = initial_state if initial_state is not None else torch.zeros_like(ht)
    rbuf = torch.empty(TT, H, V, device=dev, dtype=dt) if for_backward else None
    hseg = window_starts_buffer(lay, H, K, V, dev) if for_backward else ht
    cu, _, off = lay.kernel_args(gcl)
    gdn2_fwd_scan_kernel[lambda meta: (triton.cdiv(V, meta["BV"]), lay.N * H)](
        y, u, kt, qg, aqk, gcl, h0, o, rbuf if for_backward else o, ht, hseg,
        cu, off, scale, lay.T, lay.NT, _size_bucket(lay.N * H),
        H=H, K=K, V=V, KP=padded(K), VP=padded(V), IS_VARLEN=lay.varlen, SAVE_R=for_backward,
        DOT_PREC=dot_precision(dt), BT=CHUNK, SEG=STATE_SEGMENT)
    return o, ht, rbuf, (hseg if for_backward else None)


def chunk_start_states(kt, rbuf, gcl, initial_state, hseg, lay: ChunkLayout) -> torch.Tensor:
    """The state at every chunk start ([NC, H, K, V] in R's dtype), rebuilt from the R the training
    forward saved and the prep kernel's Kt and exp2(G_C): the forward scan's state update alone, in
    windows of STATE_SEGMENT chunks, each from the initial state or the forward's ``hseg``."""
    TT, H, K = kt.shape
    V = rbuf.shape[-1]
    hbuf = torch.empty(lay.NC, H, K, V, device=kt.device, dtype=rbuf.dtype)
    h0 = initial_state if initial_state is not None else torch.zeros(lay.N, H, K, V, device=kt.device,
                                                                       dtype=torch.float32)
    cu, info, _ = lay.kernel_args(gcl)
    nw = state_windows(lay)
    gdn2_state_scan_kernel[lambda meta: (triton.cdiv(V, meta["BV"]), nw * H)](
        kt, rbuf, gcl, h0, hseg, hbuf, cu, info, lay.T, lay.NT, lay.NC, _size_bucket(nw * H),
        H=H, K=K, V=V, KP=padded(K), VP=padded(V), IS_VARLEN=lay.varlen, DOT_PREC=dot_precision(kt.dtype),
        BT=CHUNK, SEG=STATE_SEGMENT)
    return hbuf


def rebuild_saved(q, k, v, g, b, w, scale, initial_state, lay: ChunkLayout):
    """What the training forward of :func:`gdn2_forward` saves (Aqk, A, R, window starts), made again
    from its inputs by the same kernels, and the chunk operands (Y, Kt, Qg, exp2(G_C)) the backward
    would otherwise make with a second prep launch."""
    aqk, amat, y, kt, qg, u, gcl = forward_operands(q, k, g, b, v, w, scale, lay)
    _, _, rbuf, hseg = forward_scan(y, u, kt, qg, aqk, gcl, scale, initial_state, lay, for_backward=True)
    return (aqk, amat, rbuf, hseg), (y, kt, qg, gcl)


def gdn2_backward(q, k, v, g, b, w, scale, initial_state, saved: Optional[tuple], do, dht, lay: ChunkLayout,
                  need_dh0: bool, qk_grad_dtype: torch.dtype):
    """Flattened backward: (dq, dk, dv, dg, db, dw, dh0) for the tensors of :func:`gdn2_forward`, given
    its ``saved`` (Aqk, A, R, window starts), or None for a forward that kept only its inputs
    (:func:`rebuild_saved` then makes them again).

    dq and dk come in ``qk_grad_dtype`` (fp32 when the L2-norm backward follows); the others have
    their input's dtype; dh0 is fp32 or None.
    """
    TT, H, K = q.shape
    V = v.shape[-1]
    dev, dt = q.device, q.dtype
    prec = dot_precision(dt)
    if saved is None:
        (aqk, amat, rbuf, hseg), (y, kt, qg, gcl) = rebuild_saved(q, k, v, g, b, w, scale, initial_state, lay)
    else:
        aqk, amat, rbuf, hseg = saved
        y, kt, qg, _, gcl = chunk_operands(q, k, g, b, v, w, amat, lay, with_u=False)
    del saved
    cu, info, off = lay.kernel_args(gcl)
    hbuf = chunk_start_states(kt, rbuf, gcl, initial_state, hseg, lay)
    dhbuf = torch.empty(lay.NC, H, K, V, device=dev, dtype=dt)
    dr = torch.empty(TT, H, V, device=dev, dtype=dt)
    dh0 = torch.empty(lay.N, H, K, V, device=dev, dtype=torch.float32)
    dht = dht if dht is not None else torch.zeros_like(dh0)
    gdn2_bwd_scan_kernel[lambda meta: (triton.cdiv(V, meta["BV"]), lay.N * H)](
        qg, y, kt, aqk, gcl, do, dht, dhbuf, dr, dh0,
        cu, off, scale, lay.T, lay.NT, _size_bucket(lay.N * H),
        H=H, K=K, V=V, KP=padded(K), VP=padded(V), IS_VARLEN=lay.varlen, DOT_PREC=prec, BT=CHUNK)
    del y, kt, qg, aqk
    dv = torch.empty_like(v)
    dw = torch.empty_like(w)
    # dAqk and dT: bf16 for bf16 inputs (the intra-gradient kernels feed them to 16-bit products or widen
    # them; the diagonal terms whose dg contributions cancel read the same rounded values on both sides),
    # else fp32
    sdt = torch.bfloat16 if q.dtype == torch.bfloat16 else torch.float32
    daqk = torch.empty(TT, H, CHUNK, device=dev, dtype=sdt)
    dtm = torch.empty(TT, H, CHUNK, device=dev, dtype=sdt)
    gdn2_bwd_wy_kernel[(lay.NC, H)](
        v, w, amat, rbuf, dr, do, dv, dw, daqk, dtm, cu, info, scale, lay.T, lay.NT,
        _size_bucket(lay.NC * H), H=H, V=V, VP=padded(V), IS_VARLEN=lay.varlen, DOT_PREC=prec, BT=CHUNK)
    # intra-chunk gradients (fp32 scratch), then the value-axis part and the final combination
    dqi = torch.empty(TT, H, K, device=dev, dtype=torch.float32)
    dbki = torch.empty_like(dqi)
    dki = torch.empty_like(dqi)
    # row side (dqi, dbki) and column side (dki) in separate launches; one flag per program and side (at
    # most one per chunk, head and key channel); as in the forward, the programs flagged by the first
    # launch of a side run again with the exact diagonal path
    steep = torch.empty(2, H, lay.NC * K, device=dev, dtype=torch.int32)  # [side, head, program]
    for exact in (False, True):
        for side in (0, 1):
            gdn2_bwd_intra_kernel[lambda meta: (_intra_grid0(lay.NC * triton.cdiv(K, meta["BK"]), exact), H)](
                q, k, b, g, daqk, dtm, dqi, dbki, dki, steep[side], cu, info, lay.T, lay.NT, lay.NC,
                H=H, K=K, KP=padded(K), IS_VARLEN=lay.varlen, EXACT=exact, SIDE=side, DOT_PREC=prec, BT=CHUNK,
                BC=SUB, SPAN=EXACT_SPAN)
    del daqk, dtm
    dq = torch.empty(TT, H, K, device=dev, dtype=qk_grad_dtype)
    dk = torch.empty(TT, H, K, device=dev, dtype=qk_grad_dtype)
    db = torch.empty_like(b)
    dg = torch.empty_like(g)
    gdn2_bwd_qkbg_kernel[lambda meta: (lay.NC * triton.cdiv(K, meta["BK"]), H)](
        q, k, b, g, amat, hbuf, dhbuf, do, rbuf, dr, dqi, dbki, dki, dq, dk, db, dg, cu, info, scale,
        lay.T, lay.NT, H=H, K=K, V=V, KP=padded(K), VP=padded(V),
        IS_VARLEN=lay.varlen, DOT_PREC=prec, BT=CHUNK)
    return dq, dk, dv, dg, db, dw, (dh0 if need_dh0 else None)


class ChunkGDN2Function(torch.autograd.Function):
    """Autograd over flattened tensors [TT, H, D]; see :func:`chunk_gdn2_triton` for the contract."""

    @staticmethod
    def forward(ctx, q, k, v, g, b, w, initial_state, scale, output_final_state, use_l2, lay, recompute):
        qn, q_rstd = l2norm_fwd(q) if use_l2 else (q, None)
        kn, k_rstd = l2norm_fwd(k) if use_l2 else (k, None)
        o, ht, saved = gdn2_forward(qn, kn, v, g, b, w, scale, initial_state, output_final_state, lay,
                                    for_backward=not recompute)
        ctx.save_for_backward(q, k, v, g, b, w, initial_state, *(saved or (None,) * 4))
        ctx.scale, ctx.use_l2, ctx.lay = scale, use_l2, lay
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, g, b, w, initial_state, *saved = ctx.saved_tensors
        if ctx.use_l2:
            qn, q_rstd = l2norm_fwd(q)
            kn, k_rstd = l2norm_fwd(k)
        else:
            qn, kn = q, k
        dq, dk, dv, dg, db, dw, dh0 = gdn2_backward(
            qn, kn, v, g, b, w, ctx.scale, initial_state, None if saved[0] is None else tuple(saved),
            do.contiguous(), None if dht is None else dht.contiguous(), ctx.lay,
            need_dh0=initial_state is not None and ctx.needs_input_grad[6],
            qk_grad_dtype=torch.float32 if ctx.use_l2 else q.dtype)
        if ctx.use_l2:
            dq = l2norm_bwd(q, q_rstd, dq, q.dtype)
            dk = l2norm_bwd(k, k_rstd, dk, k.dtype)
        return dq, dk, dv, dg, db, dw, dh0, None, None, None, None, None


def chunk_gdn2_triton(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, b: torch.Tensor, w: torch.Tensor,
    scale: float, initial_state: Optional[torch.Tensor] = None, output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False, cu_seqlens: Optional[torch.Tensor] = None, recompute: bool = False,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Chunked GDN-2 on validated inputs (see ``gdn2.ops.chunk_gdn2``).

    q, k: [B,T,H,K]; v, w: [B,T,HV,V]; g, b: [B,T,H or HV,K]; g fp32 or bf16, the others bf16 / fp16 /
    fp32 (k, v, b, w are used in q's dtype); initial_state fp32 [N,HV,K,V]. Returns o [B,T,HV,V] in q's
    dtype and the fp32 final state [N,HV,K,V] (or None). Differentiable in all tensor inputs.
    Grouped value heads are served by repeating q, k (and g, b) over their value heads.
    """
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    dt = q.dtype
    k, v, b, w = (t if t.dtype == dt else t.to(dt) for t in (k, v, b, w))
    if H != HV:
        q, k = (t.repeat_interleave(HV // H, dim=2) for t in (q, k))
    g, b = (t if t.shape[2] == HV else t.repeat_interleave(HV // t.shape[2], dim=2) for t in (g, b))
    lay = chunk_layout(B, T, cu_seqlens, q.device)
    if B * T == 0:
        o = v.new_zeros(B, T, HV, V, dtype=dt)
        if not output_final_state:
            return o, None
        init = initial_state if initial_state is not None else v.new_zeros(lay.N, HV, K, V, dtype=torch.float32)
        return o, init.float().clone()
    flat = [t.reshape(B * T, HV, t.shape[-1]).contiguous() for t in (q, k, v, g, b, w)]
    h0 = initial_state.contiguous() if initial_state is not None else None
    needs_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (q, k, v, g, b, w, initial_state))
    if needs_grad:
        o, ht = ChunkGDN2Function.apply(*flat, h0, scale, output_final_state, use_qk_l2norm_in_kernel, lay,
                                        recompute)
    else:
        qf, kf = flat[0], flat[1]
        if use_qk_l2norm_in_kernel:
            qf, kf = l2norm_fwd(qf)[0], l2norm_fwd(kf)[0]
        o, ht, _ = gdn2_forward(qf, kf, *flat[2:], scale, h0, output_final_state, lay, for_backward=False)
    return o.view(B, T, HV, V), ht
