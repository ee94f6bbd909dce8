"""Triton kernels of the row-wise stages and their autograd functions.

RoPE: one launch per segment of the joint projection (q, k: rotated; v: copied), one program per
``ROPE_ROWS`` rows going through the segment's heads, the two halves of a head loaded side by side
and the tables' rows loaded once per program (per head they would cost four times the data's bytes); the backward applies
the inverse rotation and writes each segment's gradient straight into its columns of the joint
gradient. SwiGLU: one program per ``SWIGLU_TILE`` (rows, columns) of the output; the backward reads
gate, up and the output gradient once and writes both halves of the joint gradient. All arithmetic in
fp32, one rounding to the output dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

ROPE_ROWS, ROPE_WARPS = 16, 4
SWIGLU_TILE = (16, 256, 4)  # rows, columns, warps


@triton.jit
def _rope_segment_kernel(src, dst, cos, sin, T, heads, s_src_b, s_src_t, s_dst_b, s_dst_t,
                         D: tl.constexpr, BH: tl.constexpr, BT: tl.constexpr,
                         ROTATE: tl.constexpr, INVERSE: tl.constexpr):
    """Rows ``program_id(0)`` of batch row ``program_id(1)``, every head of the segment in turn (the
    tables' rows loaded once for all of them): head h's D channels start at column h * D of src and
    of dst. ROTATE: y = x cos + rotate_half(x) sin (INVERSE: the transpose of that map, the
    gradient's); else a copy."""
    it, ib = tl.program_id(0), tl.program_id(1).to(tl.int64)
    HALF: tl.constexpr = D // 2
    t = it * BT + tl.arange(0, BT)
    j = tl.arange(0, BH)
    m = (t < T)[:, None] & (j < HALF)[None, :]
    rows = t.to(tl.int64)[:, None]
    if ROTATE:
        tp = rows * D + j[None, :]
        c1 = tl.load(cos + tp, mask=m, other=0.0)
        c2 = tl.load(cos + tp + HALF, mask=m, other=0.0)
        s1 = tl.load(sin + tp, mask=m, other=0.0)
        s2 = tl.load(sin + tp + HALF, mask=m, other=0.0)
    sp = src + ib * s_src_b + rows * s_src_t + j[None, :]
    dp = dst + ib * s_dst_b + rows * s_dst_t + j[None, :]
    for h in range(heads):
        x1 = tl.load(sp + h * D, mask=m, other=0.0).to(tl.float32)
        x2 = tl.load(sp + h * D + HALF, mask=m, other=0.0).to(tl.float32)
        if ROTATE:
            if INVERSE:
                y1 = x1 * c1 + x2 * s2
                y2 = x2 * c2 - x1 * s1
            else:
                y1 = x1 * c1 - x2 * s1
                y2 = x2 * c2 + x1 * s2
        else:
            y1 = x1
            y2 = x2
        tl.store(dp + h * D, y1.to(dst.dtype.element_ty), mask=m)
        tl.store(dp + h * D + HALF, y2.to(dst.dtype.element_ty), mask=m)


def _rope_segment(src: torch.Tensor, dst: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int,
                  D: int, rotate: bool, inverse: bool) -> None:
    """src, dst: [B, T, >= heads * D] views whose channels are contiguous (rows may be strided)."""
    B, T = src.shape[:2]
    _rope_segment_kernel[(triton.cdiv(T, ROPE_ROWS), B)](
        src, dst, cos, sin, T, heads, src.stride(0), src.stride(1), dst.stride(0), dst.stride(1),
        D=D, BH=triton.next_power_of_2(D // 2), BT=ROPE_ROWS, ROTATE=rotate, INVERSE=inverse,
        num_warps=ROPE_WARPS)


class RopeQKVFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_head: int, n_kv: int):
        B, T, C = qkv.shape
        D = C // (n_head + 2 * n_kv)
        q = torch.empty((B, T, n_head, D), dtype=qkv.dtype, device=qkv.device)
        k = torch.empty((B, T, n_kv, D), dtype=qkv.dtype, device=qkv.device)
        v = torch.empty_like(k)
        for (lo, heads), out, rotate in zip(_segments(n_head, n_kv, D), (q, k, v), (True, True, False)):
            _rope_segment(qkv[..., lo:], out.view(B, T, heads * D), cos, sin, heads, D, rotate, False)
        ctx.save_for_backward(cos, sin)
        ctx.dims = (n_head, n_kv, D)
        return q, k, v

    @staticmethod
    def backward(ctx, dq, dk, dv):
        cos, sin = ctx.saved_tensors
        n_head, n_kv, D = ctx.dims
        grads = [g for g in (dq, dk, dv) if g is not None]
        B, T = grads[0].shape[:2]
        dqkv = torch.empty((B, T, (n_head + 2 * n_kv) * D), dtype=grads[0].dtype, device=grads[0].device)
        for (lo, heads), g, rotate in zip(_segments(n_head, n_kv, D), (dq, dk, dv), (True, True, False)):
            if g is None:
                dqkv[..., lo: lo + heads * D].zero_()
                continue
            g = g.contiguous().view(B, T, heads * D)
            _rope_segment(g, dqkv[..., lo:], cos, sin, heads, D, rotate, True)
        return dqkv, None, None, None, None


def _segments(n_head: int, n_kv: int, D: int) -> tuple[tuple[int, int], ...]:
    """(first column, heads) of q, k and v in the joint projection."""
    return (0, n_head), (n_head * D, n_kv), ((n_head + n_kv) * D, n_kv)


def rope_qkv_triton(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_head: int, n_kv: int):
    """See ``gdn2.ops.pointwise.rope_qkv`` (inputs already checked)."""
    if qkv.stride(2) != 1:
        qkv = qkv.contiguous()
    cos, sin = cos.float().contiguous(), sin.float().contiguous()
    return RopeQKVFunction.apply(qkv, cos, sin, n_head, n_kv)


@triton.jit
def _gate_up_tile(gu, R, F, s_gu, BR: tl.constexpr, BF: tl.constexpr):
    """This program's (rows, columns) tile: row offsets, columns, mask, and gate and up in fp32."""
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    c = tl.program_id(1) * BF + tl.arange(0, BF)
    m = (r < R)[:, None] & (c < F)[None, :]
    rows = r.to(tl.int64)[:, None]
    p = gu + rows * s_gu + c[None, :]
    g = tl.load(p, mask=m, other=0.0).to(tl.float32)
    u = tl.load(p + F, mask=m, other=0.0).to(tl.float32)
    return rows, c, m, g, u


@triton.jit
def _swiglu_fwd_kernel(gu, h, R, F, s_gu, BR: tl.constexpr, BF: tl.constexpr):
    rows, c, m, g, u = _gate_up_tile(gu, R, F, s_gu, BR, BF)
    tl.store(h + rows * F + c[None, :], (g * tl.sigmoid(g) * u).to(h.dtype.element_ty), mask=m)


@triton.jit
def _swiglu_bwd_kernel(gu, dh, dgu, R, F, s_gu, BR: tl.constexpr, BF: tl.constexpr):
    rows, c, m, g, u = _gate_up_tile(gu, R, F, s_gu, BR, BF)
    d = tl.load(dh + rows * F + c[None, :], mask=m, other=0.0).to(tl.float32)
    s = tl.sigmoid(g)
    q = dgu + rows * (2 * F) + c[None, :]
    tl.store(q, (d * u * s * (1.0 + g * (1.0 - s))).to(dgu.dtype.element_ty), mask=m)
    tl.store(q + F, (d * g * s).to(dgu.dtype.element_ty), mask=m)


def _swiglu_grid(R: int, F: int) -> tuple[int, int]:
    return triton.cdiv(R, SWIGLU_TILE[0]), triton.cdiv(F, SWIGLU_TILE[1])


class SwiGLUJoinedFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gu: torch.Tensor) -> torch.Tensor:
        R, F = gu.shape[0], gu.shape[1] // 2
        h = torch.empty((R, F), dtype=gu.dtype, device=gu.device)
        br, bf, warps = SWIGLU_TILE
        if R:
            _swiglu_fwd_kernel[_swiglu_grid(R, F)](gu, h, R, F, gu.stride(0), BR=br, BF=bf, num_warps=warps)
        ctx.save_for_backward(gu)
        return h

    @staticmethod
    def backward(ctx, dh: torch.Tensor) -> torch.Tensor:
        (gu,) = ctx.saved_tensors
        R, F = gu.shape[0], gu.shape[1] // 2
        dh = dh.contiguous()
        dgu = torch.empty((R, 2 * F), dtype=gu.dtype, device=gu.device)
        br, bf, warps = SWIGLU_TILE
        if R:
            _swiglu_bwd_kernel[_swiglu_grid(R, F)](gu, dh, dgu, R, F, gu.stride(0), BR=br, BF=bf, num_warps=warps)
        return dgu


def swiglu_joined_triton(gate_up: torch.Tensor) -> torch.Tensor:
    """See ``gdn2.ops.pointwise.swiglu_joined`` (input already checked)."""
    lead = gate_up.shape[:-1]
    gu = gate_up.reshape(-1, gate_up.shape[-1])
    if gu.stride(-1) != 1:
        gu = gu.contiguous()
    return SwiGLUJoinedFunction.apply(gu).reshape(*lead, gate_up.shape[-1] // 2)
