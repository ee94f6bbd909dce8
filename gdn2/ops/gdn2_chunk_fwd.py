"""Forward kernels of the chunked (WY) GDN-2 operator.

Per chunk of 64 rows (S0 = state at the chunk start, G = in-chunk cumulative log2-decay):

    Aqk = scale * tril0((q*gamma)(k/gamma)^T)     T = tril-1((b*k*gamma)(k/gamma)^T)
    A = (I + T)^-1,  Y = A (b*k*gamma),  U = A (w*v),  R = U - Y S0
    O = scale * (q*gamma) S0 + Aqk R,     S_C = Diag(gamma_C) S0 + (k*gamma_C/gamma)^T R

``gdn2_prep_kernel`` (chunk-parallel) builds Aqk and A and the chunk-local operands of the scan;
``gdn2_fwd_scan_kernel`` (one program per sequence, head and value block) carries S across chunks,
writes o, and optionally the per-chunk state checkpoints and R for the backward.

No factor k/gamma is ever formed: off-diagonal 16x16 blocks are anchored at the first row of the later
sub-chunk (both factors <= 1) and diagonal blocks use exact pairwise decays, built as running products
of per-token decays, so log-decays of -20 per token (and far below) stay finite.
"""

from __future__ import annotations

import triton
import triton.language as tl

from gdn2.ops.gdn2_triton_utils import (LOG2E, chunk_bounds, exp2_nonpos, pick_rows, row_of, seq_bounds,
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

    Also returns the per-token decays exp2(g2) (rows past the sequence end have g = 0, so G there
    stays at the last valid row's value).
    """
    base = row0 * K  # scalar int64; the in-tile offsets stay int32
    offs = o_t[:, None] * (H * K) + o_k[None, :]
    msk = m_t[:, None] & (o_k < K)[None, :]
    b_q = tl.load(q + base + offs, mask=msk, other=0.0).to(tl.float32)
    b_k = tl.load(k + base + offs, mask=msk, other=0.0).to(tl.float32)
    b_b = tl.load(b + base + offs, mask=msk, other=0.0).to(tl.float32)
    b_g = tl.load(g + base + offs, mask=msk, other=0.0).to(tl.float32) * LOG2E
    return b_q, b_k, b_b, tl.cumsum(b_g, axis=0), tl.exp2(b_g)


# 4 warps spill a few hundred bytes at K = 128, 8 warps none (ptxas, sm_90)
_PREP_CONFIGS = [
    triton.Config({"BK": 32, "BV": 64}, num_warps=4, num_stages=1),
    triton.Config({"BK": 32, "BV": 64}, num_warps=8, num_stages=1),
    triton.Config({"BK": 64, "BV": 64}, num_warps=8, num_stages=1),
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
    r16 = o_t % BC
    cb = tl.arange(0, BC)
    dt = q.dtype.element_ty
    odd = (blk % 2) == 1
    m_pair = (blk[:, None] == blk[None, :] + 1) & odd[:, None]  # blocks (1,0) and (3,2)

    b_aqk = tl.zeros([BT, BT], dtype=tl.float32)
    b_toff = tl.zeros([BT, BT], dtype=tl.float32)
    b_tdc = tl.zeros([BT, BC], dtype=tl.float32)
    for i_k in range(0, tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        b_q, b_k, b_b, b_G, b_eg = load_chunk_qkbg(q, k, b, g, row0, o_t, o_k, m_t, H, K)
        b_bk = b_b * b_k
        # sub-chunks 2,3 x 0,1: one product anchored at row 32
        g32 = row_of(b_G, 2 * BC, BT)
        f_r = tl.where((o_t >= 2 * BC)[:, None], exp2_nonpos(b_G - g32[None, :]), 0.0)
        f_c = tl.where((o_t < 2 * BC)[:, None], exp2_nonpos(g32[None, :] - b_G), 0.0)
        b_kc = tl.trans((b_k * f_c).to(dt))
        b_aqk += tl.dot((b_q * f_r).to(dt), b_kc, input_precision=DOT_PREC)
        b_toff += tl.dot((b_bk * f_r).to(dt), b_kc, input_precision=DOT_PREC)
        # blocks (1,0) anchored at row 16 and (3,2) at row 48, in one masked product
        g_an = tl.where((o_t < 2 * BC)[:, None], row_of(b_G, BC, BT)[None, :], row_of(b_G, 3 * BC, BT)[None, :])
        f_r = tl.where(odd[:, None], exp2_nonpos(b_G - g_an), 0.0)
        f_c = tl.where(odd[:, None], 0.0, exp2_nonpos(g_an - b_G))
        b_kc = tl.trans((b_k * f_c).to(dt))
        b_aqk += tl.where(m_pair, tl.dot((b_q * f_r).to(dt), b_kc, input_precision=DOT_PREC), 0.0)
        b_toff += tl.where(m_pair, tl.dot((b_bk * f_r).to(dt), b_kc, input_precision=DOT_PREC), 0.0)
        # diagonal blocks in fp32, column j of every sub-chunk at once, j descending so that the
        # pairwise decay E[r] = exp2(G_r - G_{sel_j(r)}) is a running product of per-token decays
        b_e = tl.zeros([BT, BK], dtype=tl.float32)
        for jj in range(0, BC):
            j = BC - 1 - jj
            b_e = tl.where((r16 > j)[:, None], b_e * pick_rows(b_eg, j + 1, BT, BC, BK),
                           tl.where((r16 == j)[:, None], 1.0, 0.0))
            b_ke = pick_rows(b_k, j, BT, BC, BK) * b_e
            c_qk = tl.sum(b_q * b_ke, axis=1)
            c_t = tl.where(r16 > j, tl.sum(b_bk * b_ke, axis=1), 0.0)
            b_aqk += tl.where(o_t[None, :] == (blk * BC + j)[:, None], c_qk[:, None], 0.0)
            b_tdc += tl.where(cb[None, :] == j, c_t[:, None], 0.0)

    valid = m_t[:, None] & m_t[None, :]
    b_aqk = tl.where((o_t[:, None] >= o_t[None, :]) & valid, b_aqk * scale, 0.0)
    p_a = row0 * BT + (o_t[:, None] * (H * BT) + o_t[None, :])
    tl.store(aqk + p_a, b_aqk.to(aqk.dtype.element_ty), mask=m_t[:, None])

    # A = (I + T)^-1: invert the diagonal blocks, then with N = Ad Toff (nilpotent, N^4 = 0)
    # A = (I + N)^-1 Ad = Ad - N (Ad - N (Ad - N Ad)).
    b_ad = invert_diag_blocks(tl.where(m_t[:, None], b_tdc, 0.0), BT, BC)
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
        b_q, b_k, b_b, b_G, b_eg = load_chunk_qkbg(q, k, b, g, row0, o_t, o_k, m_t, H, K)
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
