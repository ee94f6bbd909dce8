"""Forward kernels of the chunked (WY) GDN-2 operator.

Per chunk of 64 rows (S0 = state at the chunk start, G = in-chunk cumulative log2-decay):

    Aqk = scale * tril0((q*gamma)(k/gamma)^T)     T = tril-1((b*k*gamma)(k/gamma)^T)
    A = (I + T)^-1,  Y = A (b*k*gamma),  U = A (w*v),  R = U - Y S0
    O = scale * (q*gamma) S0 + Aqk R,     S_C = Diag(gamma_C) S0 + (k*gamma_C/gamma)^T R

``gdn2_prep_kernel`` (chunk-parallel) builds Aqk and A and the chunk-local operands of the scan;
``gdn2_fwd_scan_kernel`` (one program per sequence, head and value block) carries S across chunks,
writes o, and optionally the per-chunk state checkpoints and R for the backward.

No factor k/gamma is ever formed. Every pair r > s is computed at the level d of the highest bit in
which r and s differ, as one masked product per level whose factors exp2(G_r - G_a) and
exp2(G_a - G_s) are anchored at a row a with s < a <= r (``level_anchor``): both exponents are <= 0, so
log-decays of -20 per token (and far below) stay finite. Levels 5 and 4 are the off-diagonal 16x16
blocks (operands in the input dtype), levels 3..0 fill the diagonal blocks (fp32 operands, tf32 at most
for 16-bit inputs) that the fp32 forward substitution inverts.
"""

from __future__ import annotations

import triton
import triton.language as tl

from gdn2.ops.gdn2_triton_utils import (LOG2E, chunk_bounds, exp2_nonpos, level_anchor, row_of, seq_bounds,
                                        tuned)

@triton.jit
def invert_diag_blocks(tdc, BT: tl.constexpr, BC: tl.constexpr):
    """Block-diagonal ``(I + T_diag)^-1`` as a [BT, BT] tile.

    ``tdc`` [BT, BC] holds the strictly lower diagonal blocks of T compressed: row r keeps
    ``T[r, BC*(r//BC) + c]``. Each 16x16 block is inverted by fp32 forward substitution, all four at
    once as a [BT//BC, BC, BC] tensor.
    """
    t3 = tl.reshape(tdc, (BT // BC, BC, BC))
    i3 = tl.arange(0, BC)
    ai = tl.zeros((BT // BC, BC, BC), dtype=tl.float32)  # (I + T)^-1 - I, filled row by row
    for i in range(1, BC):
        rm = (i3 == i)[None, :, None]
        a = -tl.sum(tl.where(rm, t3, 0.0), axis=1)
        a = a + tl.sum(a[:, :, None] * ai, axis=1)
        ai = tl.where(rm, a[:, None, :], ai)
    ai = tl.where((i3[:, None] == i3[None, :])[None, :, :], ai + 1.0, ai)
    full = tl.reshape(tl.broadcast_to(tl.reshape(ai, (BT, BC))[:, None, :], (BT, BT // BC, BC)), (BT, BT))
    r = tl.arange(0, BT)
    return tl.where((r // BC)[:, None] == (r // BC)[None, :], full, 0.0)


@triton.jit
def load_chunk_qkbg(q, k, b, g, row0, o_t, o_k, m_t, H: tl.constexpr, K: tl.constexpr):
    """q, k, b and the cumulative log2-decay G of one chunk and key block, all fp32 [BT, BK].

    Rows past the sequence end load as zeros (g = 0, so G there stays at the last valid row's value).
    """
    base = row0 * K  # scalar int64; the in-tile offsets stay int32
    offs = o_t[:, None] * (H * K) + o_k[None, :]
    msk = m_t[:, None] & (o_k < K)[None, :]
    b_q = tl.load(q + base + offs, mask=msk, other=0.0).to(tl.float32)
    b_k = tl.load(k + base + offs, mask=msk, other=0.0).to(tl.float32)
    b_b = tl.load(b + base + offs, mask=msk, other=0.0).to(tl.float32)
    b_g = tl.load(g + base + offs, mask=msk, other=0.0).to(tl.float32) * LOG2E
    return b_q, b_k, b_b, tl.cumsum(b_g, axis=0)


@triton.jit
def prep_level(b_q, b_k, b_bk, b_G, d: tl.constexpr, op_dt: tl.constexpr, DOT_PREC: tl.constexpr,
               BT: tl.constexpr, BK: tl.constexpr):
    """Contribution of level d to the unscaled Aqk and to T: pairs r > s whose highest differing bit
    is d, as one product with factors exp2(G_r - G_an) and exp2(G_an - G_s), both <= 1.

    ``op_dt`` is the dtype of the product's operands: the input dtype between sub-chunks, fp32
    (tf32 at most) inside the 16x16 diagonal blocks, which feed the fp32 solve.
    """
    o_t = tl.arange(0, BT)
    g_an = level_anchor(b_G, d, BT, BK)
    up = (o_t & (1 << d)) != 0
    f = tl.exp2(tl.minimum(tl.where(up[:, None], b_G - g_an, g_an - b_G), 0.0))
    b_kct = tl.trans(tl.where(up[:, None], 0.0, b_k * f).to(op_dt))
    a_qk = tl.dot(tl.where(up[:, None], b_q * f, 0.0).to(op_dt), b_kct, input_precision=DOT_PREC)
    a_t = tl.dot(tl.where(up[:, None], b_bk * f, 0.0).to(op_dt), b_kct, input_precision=DOT_PREC)
    if d < 5:
        same = (o_t[:, None] >> (d + 1)) == (o_t[None, :] >> (d + 1))
        a_qk = tl.where(same, a_qk, 0.0)
        a_t = tl.where(same, a_t, 0.0)
    return a_qk, a_t


# ptxas (sm_90, K = V = 128) spills per thread: BK 32 / 8 warps 16 B, BK 64 / 8 warps 0.15 KB,
# BK 32 / 4 warps 0.7 KB
_PREP_CONFIGS = [
    triton.Config({"BK": 32, "BV": 64}, num_warps=8, num_stages=1),
    triton.Config({"BK": 64, "BV": 64}, num_warps=8, num_stages=1),
    triton.Config({"BK": 32, "BV": 64}, num_warps=4, num_stages=1),
]


@tuned(_PREP_CONFIGS, key=["H", "K", "V", "SIZE", "STORE_U", "STORE_A"], clip={"BK": "KP", "BV": "VP"})
@triton.jit
def gdn2_prep_kernel(q, k, g, b, v, w, aqk, amat, y, u, kt, qg, gcl, cu, chunk_info, scale, T, NT, SIZE,
                     H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, KP: tl.constexpr, VP: tl.constexpr,
                     IS_VARLEN: tl.constexpr, STORE_U: tl.constexpr, STORE_A: tl.constexpr,
                     DOT_PREC: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
                     BV: tl.constexpr):
    """One chunk, one head: Aqk (scaled, masked), optionally A, and Y, Kt, Qg, exp2(G_C), optionally U.

    Token-major outputs: aqk / amat [TT, H, 64]; y, kt, qg [TT, H, K]; u [TT, H, V]; gcl [NC, H, K] fp32.
    """
    i_c = tl.program_id(0)
    i_h = tl.program_id(1)
    t0, L = chunk_bounds(i_c, cu, chunk_info, T, NT, IS_VARLEN, BT)
    o_t = tl.arange(0, BT)
    m_t = o_t < L
    row0 = t0.to(tl.int64) * H + i_h  # (token, head) row of the chunk's first token
    blk = o_t // BC
    dt = q.dtype.element_ty

    b_aqk = tl.zeros([BT, BT], dtype=tl.float32)
    b_toff = tl.zeros([BT, BT], dtype=tl.float32)  # T between sub-chunks (levels 4, 5)
    b_tin = tl.zeros([BT, BT], dtype=tl.float32)   # T inside the 16x16 diagonal blocks (levels 0-3)
    for i_k in range(0, tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        b_q, b_k, b_b, b_G = load_chunk_qkbg(q, k, b, g, row0, o_t, o_k, m_t, H, K)
        b_bk = b_b * b_k
        b_aqk += tl.where(o_t[:, None] == o_t[None, :], tl.sum(b_q * b_k, axis=1)[:, None], 0.0)
        # pairs r > s grouped by the highest bit where r and s differ; each level is one masked
        # product with its factors anchored inside the pair (see level_anchor)
        # (levels are spelled out: a static loop variable is not a constexpr under the interpreter)
        a_qk, a_t = prep_level(b_q, b_k, b_bk, b_G, 5, dt, DOT_PREC, BT, BK)
        b_aqk += a_qk
        b_toff += a_t
        a_qk, a_t = prep_level(b_q, b_k, b_bk, b_G, 4, dt, DOT_PREC, BT, BK)
        b_aqk += a_qk
        b_toff += a_t
        a_qk, a_t = prep_level(b_q, b_k, b_bk, b_G, 3, tl.float32, DOT_PREC, BT, BK)
        b_aqk += a_qk
        b_tin += a_t
        a_qk, a_t = prep_level(b_q, b_k, b_bk, b_G, 2, tl.float32, DOT_PREC, BT, BK)
        b_aqk += a_qk
        b_tin += a_t
        a_qk, a_t = prep_level(b_q, b_k, b_bk, b_G, 1, tl.float32, DOT_PREC, BT, BK)
        b_aqk += a_qk
        b_tin += a_t
        a_qk, a_t = prep_level(b_q, b_k, b_bk, b_G, 0, tl.float32, DOT_PREC, BT, BK)
        b_aqk += a_qk
        b_tin += a_t

    valid = m_t[:, None] & m_t[None, :]
    b_aqk = tl.where((o_t[:, None] >= o_t[None, :]) & valid, b_aqk * scale, 0.0)
    p_a = row0 * BT + (o_t[:, None] * (H * BT) + o_t[None, :])
    tl.store(aqk + p_a, b_aqk.to(aqk.dtype.element_ty), mask=m_t[:, None])

    # A = (I + T)^-1: invert the diagonal blocks, then with N = Ad Toff (nilpotent, N^4 = 0)
    # A = (I + N)^-1 Ad = Ad - N (Ad - N (Ad - N Ad)).
    # compress the diagonal blocks to [BT, BC] (row r keeps columns BC*(r//BC) ..)
    b_tdc = tl.sum(tl.reshape(tl.where(valid, b_tin, 0.0), (BT, BT // BC, BC)), axis=1)
    b_ad = invert_diag_blocks(b_tdc, BT, BC)
    b_toff = tl.where((blk[:, None] > blk[None, :]) & valid, b_toff, 0.0)
    b_n = tl.dot(b_ad, b_toff, input_precision=DOT_PREC)
    b_x = b_ad - tl.dot(b_n, b_ad, input_precision=DOT_PREC)
    b_x = b_ad - tl.dot(b_n, b_x, input_precision=DOT_PREC)
    b_a = b_ad - tl.dot(b_n, b_x, input_precision=DOT_PREC)
    if STORE_A:
        tl.store(amat + p_a, b_a.to(amat.dtype.element_ty), mask=m_t[:, None])
    b_ad_t = b_a.to(dt)

    for i_k in range(0, tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = o_k < K
        b_q, b_k, b_b, b_G = load_chunk_qkbg(q, k, b, g, row0, o_t, o_k, m_t, H, K)
        g_last = row_of(b_G, BT - 1, BT)
        b_gam = tl.exp2(b_G)
        offs = row0 * K + (o_t[:, None] * (H * K) + o_k[None, :])
        msk = m_t[:, None] & m_k[None, :]
        b_y = tl.dot(b_ad_t, (b_b * b_k * b_gam).to(dt), input_precision=DOT_PREC)
        tl.store(y + offs, b_y.to(y.dtype.element_ty), mask=msk)
        tl.store(kt + offs, (b_k * exp2_nonpos(g_last[None, :] - b_G)).to(kt.dtype.element_ty), mask=msk)
        tl.store(qg + offs, (b_q * b_gam).to(qg.dtype.element_ty), mask=msk)
        tl.store(gcl + (i_c.to(tl.int64) * H + i_h) * K + o_k, tl.exp2(g_last), mask=m_k)
    if STORE_U:
        for i_v in range(0, tl.cdiv(V, BV)):
            o_v = i_v * BV + tl.arange(0, BV)
            offs = row0 * V + (o_t[:, None] * (H * V) + o_v[None, :])
            msk = m_t[:, None] & (o_v < V)[None, :]
            b_v = tl.load(v + offs, mask=msk, other=0.0).to(tl.float32)
            b_w = tl.load(w + offs, mask=msk, other=0.0).to(tl.float32)
            b_u = tl.dot(b_ad_t, (b_v * b_w).to(dt), input_precision=DOT_PREC)
            tl.store(u + offs, b_u.to(u.dtype.element_ty), mask=msk)


_SCAN_CONFIGS = [
    triton.Config({"BV": 32}, num_warps=4, num_stages=2),
    triton.Config({"BV": 16}, num_warps=4, num_stages=2),
    triton.Config({"BV": 64}, num_warps=4, num_stages=2),
]


@tuned(_SCAN_CONFIGS, key=["H", "K", "V", "SIZE", "SAVE_STATES"], clip={"BV": "VP"})
@triton.jit
def gdn2_fwd_scan_kernel(y, u, kt, qg, aqk, gcl, h0, o, r, hbuf, ht, cu, chunk_off, scale, T, NT, SIZE,
                         H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, KP: tl.constexpr,
                         VP: tl.constexpr, IS_VARLEN: tl.constexpr, SAVE_STATES: tl.constexpr,
                         DOT_PREC: tl.constexpr,
                         BT: tl.constexpr, BV: tl.constexpr):
    """Carry the state over the chunks of one sequence (one head, one value block); write o.

    SAVE_STATES also writes the state at every chunk start (hbuf [NC, H, K, V], input dtype) and R
    (r [TT, H, V]) for the backward.
    """
    i_v = tl.program_id(0)
    i_nh = tl.program_id(1)
    i_n = i_nh // H
    i_h = i_nh % H
    bos, eos, c0 = seq_bounds(i_n, cu, chunk_off, T, NT, IS_VARLEN)
    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, KP)
    m_k = o_k < K
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    m_kv = m_k[:, None] & m_v[None, :]
    dt = y.dtype.element_ty
    p_s = (i_n.to(tl.int64) * H + i_h) * K * V + (o_k[:, None] * V + o_v[None, :])
    # h0 / ht always exist (zeros / a scratch buffer when not asked for): fewer kernel variants
    b_h = tl.load(h0 + p_s, mask=m_kv, other=0.0)
    for i_t in range(0, tl.cdiv(eos - bos, BT)):
        t0 = bos + i_t * BT
        m_t = o_t < eos - t0
        row0 = t0.to(tl.int64) * H + i_h
        i_c = (c0 + i_t).to(tl.int64)
        if SAVE_STATES:
            tl.store(hbuf + (i_c * H + i_h) * K * V + (o_k[:, None] * V + o_v[None, :]),
                     b_h.to(hbuf.dtype.element_ty), mask=m_kv)
        m_tk = m_t[:, None] & m_k[None, :]
        p_k = row0 * K + (o_t[:, None] * (H * K) + o_k[None, :])
        b_y = tl.load(y + p_k, mask=m_tk, other=0.0)
        b_qg = tl.load(qg + p_k, mask=m_tk, other=0.0)
        b_ktt = tl.load(kt + row0 * K + (o_t[None, :] * (H * K) + o_k[:, None]), mask=m_t[None, :] & m_k[:, None],
                        other=0.0)
        b_a = tl.load(aqk + row0 * BT + (o_t[:, None] * (H * BT) + o_t[None, :]), mask=m_t[:, None], other=0.0)
        p_v = row0 * V + (o_t[:, None] * (H * V) + o_v[None, :])
        m_tv = m_t[:, None] & m_v[None, :]
        b_u = tl.load(u + p_v, mask=m_tv, other=0.0).to(tl.float32)
        b_gl = tl.load(gcl + (i_c * H + i_h) * K + o_k, mask=m_k, other=0.0)

        b_hd = b_h.to(dt)
        b_r = b_u - tl.dot(b_y, b_hd, input_precision=DOT_PREC)
        b_rd = b_r.to(dt)
        if SAVE_STATES:
            tl.store(r + p_v, b_rd, mask=m_tv)
        b_o = tl.dot(b_qg, b_hd, input_precision=DOT_PREC) * scale + tl.dot(b_a, b_rd, input_precision=DOT_PREC)
        tl.store(o + p_v, b_o.to(o.dtype.element_ty), mask=m_tv)
        b_h = b_h * b_gl[:, None] + tl.dot(b_ktt, b_rd, input_precision=DOT_PREC)
    tl.store(ht + p_s, b_h, mask=m_kv)
