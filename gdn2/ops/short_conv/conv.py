"""Triton kernels of the short convolution: ``y = silu(sum_j w[:, ks-1-j] * x_{t-j})`` per channel.

The forward reads each input row ``ks`` times from cache (one shifted tile per tap) and writes y once.
Only the input is saved. The backward runs in two passes: the first recomputes the pre-activation,
writes its gradient in fp32 and, per program, the weight gradient's partial sums over its rows (one
torch reduction adds them up); the second makes dx from ``ks`` shifted reads of that gradient. (One
kernel that recomputed the pre-activation at the ``ks`` rows each input feeds, writing nothing in
between, took 2.3x as long on an H200.) Both accumulate in fp32; the taps are rounded to x's dtype
first, as a convolution in that dtype would. x may be a slice of a wider tensor (its rows strided), as the GDN-2
layer's q, k and v are of the grouped input projection.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl


# (rows, channels, warps) of one program, the backward's tile for both of its kernels
# (``bench/ops_short_conv.py --sweep`` times the candidates)
FWD_TILE = (64, 128, 4)
BWD_TILE = (64, 128, 4)


@triton.jit
def _tap(w, c, cm, j: tl.constexpr, KS: tl.constexpr, like):
    """The weight on x_{t-j} per channel, rounded to the dtype of the pointer ``like`` (x's), in fp32."""
    return tl.load(w + c * KS + (KS - 1 - j), mask=cm, other=0.0).to(like.dtype.element_ty).to(tl.float32)


@triton.jit
def _shifted_input(xb, t, c, tm, cm, p, j: tl.constexpr, sxt):
    """x_{t-j} for the rows t in fp32; 0 where t-j lies before the sequence or the row's document."""
    ok = tm & (p >= j) & (t >= j)
    xj = tl.load(xb + (t - j).to(tl.int64)[:, None] * sxt + c[None, :], mask=ok[:, None] & cm[None, :], other=0.0)
    return xj.to(tl.float32)


@triton.jit
def _pre_activation(xb, w, t, c, tm, cm, p, sxt, KS: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    """``sum_j w_j x_{t-j}`` for the rows t, in fp32."""
    acc = tl.zeros([BT, BC], dtype=tl.float32)
    for j in tl.static_range(KS):
        wj = _tap(w, c, cm, j, KS, xb)
        acc += _shifted_input(xb, t, c, tm, cm, p, j, sxt) * wj[None, :]
    return acc


@triton.jit
def _short_conv_fwd_kernel(x, w, pos, y, T, C, sxb, sxt,
                           KS: tl.constexpr, HAS_POS: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    it, ic, ib = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    t = it * BT + tl.arange(0, BT)
    c = ic * BC + tl.arange(0, BC)
    tm, cm = t < T, c < C
    p = tl.load(pos + t, mask=tm, other=0) if HAS_POS else t
    acc = _pre_activation(x + ib * sxb, w, t, c, tm, cm, p, sxt, KS, BT, BC)
    out = acc * tl.sigmoid(acc)
    yp = y + ib * T * C + t.to(tl.int64)[:, None] * C + c[None, :]
    tl.store(yp, out.to(y.dtype.element_ty), mask=tm[:, None] & cm[None, :])


@triton.jit
def _short_conv_dpre_kernel(x, w, pos, dy, dpre, dwp, T, C, sxb, sxt, NT,
                            KS: tl.constexpr, HAS_POS: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    """The backward's first pass: the pre-activation's gradient (fp32, written once) and the weight
    gradient's partial sums over this program's rows, from the same shifted input tiles."""
    it, ic, ib = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    s = it * BT + tl.arange(0, BT)
    c = ic * BC + tl.arange(0, BC)
    sm, cm = s < T, c < C
    p = tl.load(pos + s, mask=sm, other=0) if HAS_POS else s
    xb = x + ib * sxb
    pre = _pre_activation(xb, w, s, c, sm, cm, p, sxt, KS, BT, BC)
    sg = tl.sigmoid(pre)
    off = ib * T * C + s.to(tl.int64)[:, None] * C + c[None, :]
    g = tl.load(dy + off, mask=sm[:, None] & cm[None, :], other=0.0)
    d = g.to(tl.float32) * sg * (1.0 + pre * (1.0 - sg))
    tl.store(dpre + off, d, mask=sm[:, None] & cm[None, :])
    for i in tl.static_range(KS):
        part = tl.sum(d * _shifted_input(xb, s, c, sm, cm, p, i, sxt), axis=0)
        tl.store(dwp + ((ib * NT + it) * KS + (KS - 1 - i)) * C + c, part, mask=cm)


@triton.jit
def _short_conv_dx_kernel(dpre, w, pos, dx, T, C,
                          KS: tl.constexpr, HAS_POS: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    """Second pass: ``dx_s = sum_j w_j dpre_{s+j}`` over the rows s feeds (inside its document)."""
    it, ic, ib = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    s = it * BT + tl.arange(0, BT)
    c = ic * BC + tl.arange(0, BC)
    sm, cm = s < T, c < C
    base = dpre + ib * T * C
    acc = tl.zeros([BT, BC], dtype=tl.float32)
    for j in tl.static_range(KS):
        r = s + j
        rm = r < T
        pr = tl.load(pos + r, mask=rm, other=0) if HAS_POS else r
        feeds = rm & (pr >= j)
        wj = _tap(w, c, cm, j, KS, dx)
        d = tl.load(base + r.to(tl.int64)[:, None] * C + c[None, :], mask=feeds[:, None] & cm[None, :], other=0.0)
        acc += d * wj[None, :]
    tl.store(dx + ib * T * C + s.to(tl.int64)[:, None] * C + c[None, :], acc.to(dx.dtype.element_ty),
             mask=sm[:, None] & cm[None, :])


class ShortConvSiLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, pos: Optional[torch.Tensor]) -> torch.Tensor:
        B, T, C = x.shape
        ks = weight.shape[-1]
        w = weight.reshape(C, ks).contiguous()
        y = torch.empty((B, T, C), dtype=x.dtype, device=x.device)
        if y.numel():
            bt, bc, warps = FWD_TILE
            _short_conv_fwd_kernel[(triton.cdiv(T, bt), triton.cdiv(C, bc), B)](
                x, w, w if pos is None else pos, y, T, C, x.stride(0), x.stride(1),
                KS=ks, HAS_POS=pos is not None, BT=bt, BC=bc, num_warps=warps)
        ctx.save_for_backward(x, w, pos)
        ctx.weight_shape, ctx.weight_dtype = weight.shape, weight.dtype
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x, w, pos = ctx.saved_tensors
        B, T, C = x.shape
        ks = w.shape[1]
        dy = dy.contiguous()
        dx = torch.empty((B, T, C), dtype=x.dtype, device=x.device)
        bt, bc, warps = BWD_TILE
        nt = triton.cdiv(T, bt)
        partial = torch.empty((B * nt, ks, C), dtype=torch.float32, device=x.device)
        grid = (nt, triton.cdiv(C, bc), B)
        posarg = w if pos is None else pos
        if dx.numel():
            dpre = torch.empty((B, T, C), dtype=torch.float32, device=x.device)
            _short_conv_dpre_kernel[grid](
                x, w, posarg, dy, dpre, partial, T, C, x.stride(0), x.stride(1), nt,
                KS=ks, HAS_POS=pos is not None, BT=bt, BC=bc, num_warps=warps)
            _short_conv_dx_kernel[grid](dpre, w, posarg, dx, T, C,
                                        KS=ks, HAS_POS=pos is not None, BT=bt, BC=bc, num_warps=warps)
        dw = partial.sum(0).t().reshape(ctx.weight_shape).to(ctx.weight_dtype)
        return dx, dw, None


def short_conv_silu_triton(x: torch.Tensor, weight: torch.Tensor, pos_in_doc: Optional[torch.Tensor] = None
                           ) -> torch.Tensor:
    """See ``gdn2.ops.short_conv.short_conv_silu`` (inputs already checked)."""
    pos = None if pos_in_doc is None else pos_in_doc.to(torch.int32).contiguous()
    return ShortConvSiLUFunction.apply(x, weight, pos)
