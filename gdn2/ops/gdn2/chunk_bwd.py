"""Backward kernels of the chunked (WY) GDN-2 operator.

With dR the total gradient of the chunk's R (see ``chunk_fwd``), per chunk:

    dR = Aqk^T dO + Kt dS_C                     dS0 = Diag(gamma_C) dS_C + scale Qg^T dO - Y^T dR
    dZ = A^T dR  (dv = dZ*w, dw = dZ*v)         dAqk = dO R^T           dT = -tril-1(dZ R^T)
    dQg = scale dO S0^T    dKt = R dS_C^T       dEb = A^T dY with dY = -dR S0^T

``dT = -A^T dA A^T`` collapses to ``-dZ R^T`` because ``dA = dR (Z - Eb S0)^T`` and ``R = A (Z - Eb S0)``,
so the gates stay inside the products without any transposed inverse. Kernels:

- ``gdn2_prep_kernel`` and ``gdn2_state_scan_kernel`` (in ``chunk_fwd``): Qg, Y, Kt, exp2(G_C) again
  from the A the forward saved (one cumulative sum and one product; the forward's intra kernel is not
  re-run), then the state at every chunk start from the saved R;
- ``gdn2_bwd_scan_kernel``: the one reverse scan over chunks (dS at every chunk end, dR, d initial state);
- ``gdn2_bwd_wy_kernel`` (chunk-parallel): dv, dw, dAqk, dT;
- ``gdn2_bwd_intra_kernel`` (chunk- and key-block-parallel, one warp; row side and column side in
  separate launches): the gradients through the pairwise decays of Aqk and T, block by block as the
  forward built them (16-row sub-chunks, the same anchors and the same fast / exact diagonal paths), to
  fp32 scratch;
- ``gdn2_bwd_qkbg_kernel`` (chunk- and key-block-parallel): dq, dk, db, dg from those and the
  value-axis contractions, dg as a reverse cumulative sum of dG inside the chunk. For every pair the
  decay's gradient is +x*dx on the row side and -k*dk on the column side, so dG needs only the
  intra-chunk dq, d(b*k), dk tiles, whatever the factorisation.
"""

from __future__ import annotations

import triton
import triton.language as tl

from gdn2.ops.gdn2.chunk_fwd import (BWD_SCAN_CONFIGS, LOG2E, bwd_scan_config, load_sub_chunk_raw, sub_chunk_factors,
                                     widen_sub_chunk)
from gdn2.ops.gdn2.utils import (chunk_bounds, exp2_nonpos, flag_at, key_block_at, key_block_program,
                                 load_block, load_rows, row_of, scan_chunk, scan_program, steep_flags,
                                 store_chunk_state, store_rows, tuned)


@tuned(BWD_SCAN_CONFIGS, key=["H", "K", "V", "SIZE"], clip={"BV": "VP"}, pick=bwd_scan_config)
@triton.jit(do_not_specialize=["T", "NT", "SIZE"])
def gdn2_bwd_scan_kernel(qg, y, kt, aqk, gcl, do, dht, dhbuf, dr, dh0, cu, chunk_off, scale, T, NT, SIZE,
                         H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, KP: tl.constexpr,
                         VP: tl.constexpr, IS_VARLEN: tl.constexpr, DOT_PREC: tl.constexpr, BT: tl.constexpr,
                         BV: tl.constexpr):
    """Reverse scan for one sequence, head and value block.

    Writes dS_C of every chunk (dhbuf [NC, H, K, V], input dtype), dR (dr [TT, H, V]) and the gradient
    of the initial state (dh0 [N, H, K, V] fp32).
    """
    i_h, bos, eos, c0, o_k, m_k, o_v, m_v, p_s = scan_program(cu, chunk_off, T, NT, H, K, V, KP, IS_VARLEN, BV)
    o_t = tl.arange(0, BT)
    m_kv = m_k[:, None] & m_v[None, :]
    dt = qg.dtype.element_ty
    # dht / dh0 always exist (zeros / a scratch buffer when absent): fewer kernel variants
    b_dh = tl.load(dht + p_s, mask=m_kv, other=0.0)
    n_t = tl.cdiv(eos - bos, BT)
    for i_r in range(0, n_t):
        m_t, row0, i_c = scan_chunk(bos, eos, c0, n_t - 1 - i_r, i_h, H, BT)
        store_chunk_state(dhbuf, i_c, i_h, o_k, o_v, m_kv, b_dh, H, K, V)
        p_v = row0 * V + (o_t[:, None] * (H * V) + o_v[None, :])
        m_tv = m_t[:, None] & m_v[None, :]
        b_do = tl.load(do + p_v, mask=m_tv, other=0.0).to(dt)
        # Aqk^T, Qg^T, Y^T straight from memory in transposed order
        b_at = tl.load(aqk + row0 * BT + (o_t[None, :] * (H * BT) + o_t[:, None]), mask=m_t[None, :], other=0.0)
        m_kt = m_k[:, None] & m_t[None, :]
        p_kt = row0 * K + (o_t[None, :] * (H * K) + o_k[:, None])
        b_qgt = tl.load(qg + p_kt, mask=m_kt, other=0.0)
        b_yt = tl.load(y + p_kt, mask=m_kt, other=0.0)
        b_kt = tl.load(kt + row0 * K + (o_t[:, None] * (H * K) + o_k[None, :]), mask=m_t[:, None] & m_k[None, :],
                       other=0.0)
        b_gl = tl.load(gcl + (i_c * H + i_h) * K + o_k, mask=m_k, other=0.0)

        b_dr = tl.dot(b_at, b_do, input_precision=DOT_PREC) + tl.dot(b_kt, b_dh.to(dt), input_precision=DOT_PREC)
        b_drd = b_dr.to(dt)
        tl.store(dr + p_v, b_drd, mask=m_tv)
        b_dh = (b_dh * b_gl[:, None] + tl.dot(b_qgt, b_do, input_precision=DOT_PREC) * scale
                - tl.dot(b_yt, b_drd, input_precision=DOT_PREC))
    tl.store(dh0 + p_s, b_dh, mask=m_kv)


# pinned first (bench/sweep_gdn2.py; timings in bench/NOTES.md)
_WY_CONFIGS = [
    triton.Config({"BV": 128}, num_warps=4, num_stages=3),
    triton.Config({"BV": 64}, num_warps=4, num_stages=2),
    triton.Config({"BV": 32}, num_warps=4, num_stages=2),
]


@tuned(_WY_CONFIGS, key=["H", "V", "SIZE"], clip={"BV": "VP"})
@triton.jit(do_not_specialize=["T", "NT", "SIZE"])
def gdn2_bwd_wy_kernel(v, w, amat, r, dr, do, dv, dw, daqk, dtm, cu, chunk_info, scale, T, NT, SIZE,
                       H: tl.constexpr, V: tl.constexpr, VP: tl.constexpr, IS_VARLEN: tl.constexpr,
                       DOT_PREC: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr):
    """One chunk, one head: dv, dw, and the [TT, H, 64] tiles dAqk (times scale) and dT (fp32 accumulators,
    stored in the scratch dtype: bf16 for bf16 inputs, else fp32)."""
    i_c = tl.program_id(0)
    i_h = tl.program_id(1)
    t0, L = chunk_bounds(i_c, cu, chunk_info, T, NT, IS_VARLEN, BT)
    o_t = tl.arange(0, BT)
    m_t = o_t < L
    row0 = t0.to(tl.int64) * H + i_h
    dt = dr.dtype.element_ty
    b_at = tl.load(amat + row0 * BT + (o_t[None, :] * (H * BT) + o_t[:, None]), mask=m_t[None, :], other=0.0).to(dt)
    b_daqk = tl.zeros([BT, BT], dtype=tl.float32)
    b_dtm = tl.zeros([BT, BT], dtype=tl.float32)
    for i_v in range(0, tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = o_v < V
        p_v = row0 * V + (o_t[:, None] * (H * V) + o_v[None, :])
        m_tv = m_t[:, None] & m_v[None, :]
        b_dr = tl.load(dr + p_v, mask=m_tv, other=0.0)
        b_rt = tl.load(r + row0 * V + (o_t[None, :] * (H * V) + o_v[:, None]), mask=m_v[:, None] & m_t[None, :],
                       other=0.0)
        b_do = tl.load(do + p_v, mask=m_tv, other=0.0).to(dt)
        b_v = tl.load(v + p_v, mask=m_tv, other=0.0).to(tl.float32)
        b_w = tl.load(w + p_v, mask=m_tv, other=0.0).to(tl.float32)
        b_dz = tl.dot(b_at, b_dr, input_precision=DOT_PREC)
        tl.store(dv + p_v, (b_dz * b_w).to(dv.dtype.element_ty), mask=m_tv)
        tl.store(dw + p_v, (b_dz * b_v).to(dw.dtype.element_ty), mask=m_tv)
        b_dtm -= tl.dot(b_dz.to(dt), b_rt, input_precision=DOT_PREC)
        b_daqk += tl.dot(b_do, b_rt, input_precision=DOT_PREC)
    valid = m_t[:, None] & m_t[None, :]
    b_daqk = tl.where((o_t[:, None] >= o_t[None, :]) & valid, b_daqk * scale, 0.0)
    b_dtm = tl.where((o_t[:, None] > o_t[None, :]) & valid, b_dtm, 0.0)
    p_a = row0 * BT + (o_t[:, None] * (H * BT) + o_t[None, :])
    tl.store(daqk + p_a, b_daqk.to(daqk.dtype.element_ty), mask=m_t[:, None])
    tl.store(dtm + p_a, b_dtm.to(dtm.dtype.element_ty), mask=m_t[:, None])


@triton.jit
def diag_columns_grad(b_q, b_k, b_bk, b_G, d_a, d_t, o_c, BC: tl.constexpr, BK: tl.constexpr):
    """Gradients of the exact diagonal block (see the forward's ``diag_columns``): dq, d(b*k), dk."""
    b_dq = tl.zeros([BC, BK], dtype=tl.float32)
    b_dbk = tl.zeros([BC, BK], dtype=tl.float32)
    b_dk = tl.zeros([BC, BK], dtype=tl.float32)
    for s in range(0, BC):
        sel = o_c == s
        g_s = tl.sum(tl.where(sel[:, None], b_G, 0.0), axis=0)
        k_s = tl.sum(tl.where(sel[:, None], b_k, 0.0), axis=0)
        b_e = exp2_nonpos(b_G - g_s[None, :])
        c_a = tl.sum(tl.where(sel[None, :], d_a, 0.0), axis=1)  # column s (rows r >= s are nonzero)
        c_t = tl.sum(tl.where(sel[None, :], d_t, 0.0), axis=1)
        b_dq += c_a[:, None] * b_e * k_s[None, :]
        b_dbk += c_t[:, None] * b_e * k_s[None, :]
        dk_s = tl.sum((c_a[:, None] * b_q + c_t[:, None] * b_bk) * b_e, axis=0)
        b_dk = tl.where(sel[:, None], dk_s[None, :], b_dk)
    return b_dq, b_dbk, b_dk


@triton.jit
def grad_blocks(daqk, dtm, row0, i, j, o_c, L, H: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
                TRANS: tl.constexpr):
    """Block (i, j) of dAqk and of dT, as loaded (see ``load_block``)."""
    return (load_block(daqk, row0, i, j, o_c, L, H, BT, BC, TRANS),
            load_block(dtm, row0, i, j, o_c, L, H, BT, BC, TRANS))


@triton.jit
def grad_sub_chunk(q, k, b, g, daqk, dtm, base, row0, i, a, o_c, o_k, L, H: tl.constexpr,
                   K: tl.constexpr, EXACT: tl.constexpr, DOT_PREC: tl.constexpr, BT: tl.constexpr,
                   BC: tl.constexpr, BK: tl.constexpr):
    """Sub-chunk i: gradients through its diagonal blocks (dq, d(b*k), dk, fp32 [BC, BK]), the factors
    the off-diagonal blocks need (k*H and F for the row side, H for the column side), e and ``fast``
    (int32), as in ``intra_sub_chunk``:
    the anchored product's gradient, except with EXACT where this key block is too steep for it."""
    # every load of the sub-chunk issued before any of them is used
    r_q, r_k, r_b, r_g = load_sub_chunk_raw(q, k, b, g, base, i, o_c, o_k, L, H, K, BC)
    r_a, r_t = grad_blocks(daqk, dtm, row0, i, i, o_c, L, H, BT, BC, False)
    r_at, r_tt = grad_blocks(daqk, dtm, row0, i, i, o_c, L, H, BT, BC, True)
    b_q, b_k, b_b, b_G, e, m, fast = widen_sub_chunk(r_q, r_k, r_b, r_g, a, BC)
    b_bk = b_b * b_k
    b_fm, b_km, b_f, b_h = sub_chunk_factors(b_G, a, e, m, fast)
    d_a = r_a.to(tl.float32)
    d_t = r_t.to(tl.float32)
    if EXACT:
        if fast:
            b_dq, b_dbk, b_dk = anchored_diag_grad(b_q, b_k, b_bk, b_fm, b_km, d_a, d_t, r_at, r_tt, DOT_PREC)
        else:
            b_dq, b_dbk, b_dk = diag_columns_grad(b_q, b_k, b_bk, b_G, d_a, d_t, o_c, BC, BK)
    else:
        b_dq, b_dbk, b_dk = anchored_diag_grad(b_q, b_k, b_bk, b_fm, b_km, d_a, d_t, r_at, r_tt, DOT_PREC)
    return b_k * b_h, b_f, b_h, e, b_dq, b_dbk, b_dk, fast.to(tl.int32)


@triton.jit
def anchored_diag_grad(b_q, b_k, b_bk, b_fm, b_km, d_a, d_t, r_at, r_tt, DOT_PREC: tl.constexpr):
    """Gradients (dq, d(b*k), dk) of the anchored diagonal product (the forward's ``anchored_diag``); r_at,
    r_tt are the diagonal blocks of dAqk and dT read in transposed order."""
    x_k = b_k * b_km
    b_dq = b_fm * tl.dot(d_a, x_k, input_precision=DOT_PREC)
    b_dbk = b_fm * tl.dot(d_t, x_k, input_precision=DOT_PREC)
    d_at = r_at.to(tl.float32)
    d_tt = r_tt.to(tl.float32)
    b_dk = b_km * (tl.dot(d_at, b_q * b_fm, input_precision=DOT_PREC)
                   + tl.dot(d_tt, b_bk * b_fm, input_precision=DOT_PREC))
    return b_dq, b_dbk, b_dk


@triton.jit
def offdiag_row_grad(r_a, r_t, kh_j, f_i, rho, dq_i, dbk_i, op_dt: tl.constexpr, DOT_PREC: tl.constexpr):
    """Row side of block (i, j), i > j, of Aqk and T differentiated (r_a, r_t: that block of dAqk and dT,
    as loaded): its contributions added to the accumulators (dq_i, d(b*k)_i), which it returns, with
    operands in ``op_dt`` (the input dtype, as in the forward). ``rho`` = exp2(a_i - e_j) <= 1 links the
    two sub-chunks' anchors."""
    x_k = (kh_j * rho[None, :]).to(op_dt)
    dq_i = dq_i + f_i * tl.dot(r_a.to(op_dt), x_k, input_precision=DOT_PREC)
    dbk_i = dbk_i + f_i * tl.dot(r_t.to(op_dt), x_k, input_precision=DOT_PREC)
    return dq_i, dbk_i


@triton.jit
def qkbg_finish(q, k, b, amat, hbuf, dhbuf, do, r, dr, dq, dk, db, dg, scale, b_dq_i, b_dbk, b_dkc, b_G, e3,
                i_c, i_h, row0, base, o_k, L, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                DOT_PREC: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    """The value-axis part of dq, dk, db, dg and their final combination for one chunk and key block,
    given the intra-chunk gradients (dq, d(b*k), dk through Aqk and T; fp32 [BT, BK]), G [BT, BK] and
    G_C (e3, [BK]). q, k, b and A^T are loaded before the value loop and widened after it, so their
    round trip overlaps the loop's."""
    o_t = tl.arange(0, BT)
    m_t = o_t < L
    m_k = o_k < K
    dt = q.dtype.element_ty
    offs = base + (o_t[:, None] * (H * K) + o_k[None, :])
    msk = m_t[:, None] & m_k[None, :]
    r_q = tl.load(q + offs, mask=msk, other=0.0)
    r_k = tl.load(k + offs, mask=msk, other=0.0)
    r_b = tl.load(b + offs, mask=msk, other=0.0)
    b_at = tl.load(amat + row0 * BT + (o_t[None, :] * (H * BT) + o_t[:, None]), mask=m_t[None, :], other=0.0)
    # inter-chunk part: contractions over the value axis against the state checkpoints
    b_dqg = tl.zeros([BT, BK], dtype=tl.float32)
    b_dkt = tl.zeros([BT, BK], dtype=tl.float32)
    b_dy = tl.zeros([BT, BK], dtype=tl.float32)
    b_dgl = tl.zeros([BK], dtype=tl.float32)
    p_st = (i_c.to(tl.int64) * H + i_h) * K * V
    for i_v in range(0, tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = o_v < V
        m_vk = m_v[:, None] & m_k[None, :]
        p_hT = p_st + (o_k[None, :] * V + o_v[:, None])
        b_ht = tl.load(hbuf + p_hT, mask=m_vk, other=0.0).to(dt)
        b_dht = tl.load(dhbuf + p_hT, mask=m_vk, other=0.0).to(dt)
        p_v = row0 * V + (o_t[:, None] * (H * V) + o_v[None, :])
        m_tv = m_t[:, None] & m_v[None, :]
        b_do = tl.load(do + p_v, mask=m_tv, other=0.0).to(dt)
        b_r = tl.load(r + p_v, mask=m_tv, other=0.0).to(dt)
        b_dr = tl.load(dr + p_v, mask=m_tv, other=0.0).to(dt)
        b_dqg += tl.dot(b_do, b_ht, input_precision=DOT_PREC)
        b_dkt += tl.dot(b_r, b_dht, input_precision=DOT_PREC)
        b_dy -= tl.dot(b_dr, b_ht, input_precision=DOT_PREC)
        b_dgl += tl.sum(b_ht.to(tl.float32) * b_dht.to(tl.float32), axis=0)
    b_deb = tl.dot(b_at.to(dt), b_dy.to(dt), input_precision=DOT_PREC)
    b_q = r_q.to(tl.float32)
    b_k = r_k.to(tl.float32)
    b_b = r_b.to(tl.float32)
    b_bk = b_b * b_k
    b_gam = tl.exp2(b_G)
    b_tail = exp2_nonpos(e3[None, :] - b_G)

    b_dq = b_dqg * scale * b_gam + b_dq_i
    b_dk_kt = b_dkt * b_tail             # through Kt = k * gamma_C / gamma
    b_dk_eb = b_deb * b_b * b_gam        # through Eb = b * k * gamma
    b_dk = b_dk_kt + b_dk_eb + b_dkc + b_b * b_dbk
    b_db = b_deb * b_k * b_gam + b_k * b_dbk
    # dG per row and channel; gamma_C enters through Kt and through the state decay
    b_dG = b_q * b_dq + b_k * (b_dk_eb - b_dk_kt - b_dkc) + b_bk * b_dbk
    extra = tl.sum(b_k * b_dk_kt, axis=0) + tl.exp2(e3) * b_dgl
    b_dG += tl.where((o_t == L - 1)[:, None], extra[None, :], 0.0)
    b_dg = tl.sum(b_dG, axis=0)[None, :] - tl.cumsum(b_dG, axis=0) + b_dG

    tl.store(dq + offs, b_dq.to(dq.dtype.element_ty), mask=msk)
    tl.store(dk + offs, b_dk.to(dk.dtype.element_ty), mask=msk)
    tl.store(db + offs, b_db.to(db.dtype.element_ty), mask=msk)
    tl.store(dg + offs, b_dg.to(dg.dtype.element_ty), mask=msk)


# pinned first (see gdn2_intra_kernel: [16, 16] products want one warp per program; timings in
# bench/NOTES.md)
_BWD_INTRA_CONFIGS = [
    triton.Config({"BK": 32}, num_warps=1, num_stages=1),
    triton.Config({"BK": 16}, num_warps=2, num_stages=1),
    triton.Config({"BK": 64}, num_warps=1, num_stages=1),
]


@tuned(_BWD_INTRA_CONFIGS, key=["H", "K", "EXACT", "SIDE"], clip={"BK": "KP"})
@triton.jit(do_not_specialize=["T", "NT", "NC"])
def gdn2_bwd_intra_kernel(q, k, b, g, daqk, dtm, dqi, dbki, dki, steep, cu, chunk_info, T, NT, NC,
                          H: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, IS_VARLEN: tl.constexpr,
                          EXACT: tl.constexpr, SIDE: tl.constexpr, DOT_PREC: tl.constexpr, BT: tl.constexpr,
                          BC: tl.constexpr, BK: tl.constexpr, SPAN: tl.constexpr):
    """One chunk, one head, one key block: the intra-chunk gradients through Aqk and T (grid: chunks *
    key blocks, heads), fp32 [TT, H, K] each: dqi (unscaled by ``scale``: dAqk carries it), d(b*k)
    in dbki and the column-side dk in dki. The pairwise decays are differentiated block by block as
    the forward built them (16-row sub-chunks, the same anchors, the anchored diagonal product or the
    exact column path). Each side is launched twice, like ``gdn2_intra_kernel``: anchored diagonal
    blocks everywhere, the programs that needed the exact path flagged in ``steep`` (int32, one per
    program and side), then those programs again with the exact path (that launch's programs take SPAN
    of the first launch's each, as in the forward).

    Each launch does one side of every pair (i, j): SIDE 0 the row side (dqi, dbki), walking the
    sub-chunks in order; SIDE 1 the column side (dki), one sub-chunk j at a time against every later
    one, so that one dk tile is live. Apart, neither side spills, at the price of reloading the inputs
    (both sides in one kernel spilled and were slower: bench/NOTES.md, v8).
    """
    N0 = NC * tl.cdiv(K, BK)  # programs per head of the first launch
    i_h = tl.program_id(1)
    if EXACT:
        flags = steep_flags(steep, tl.program_id(0) * SPAN, i_h, N0, 1, N0, SPAN)
        if tl.max(flags, axis=0) != 0:
            for s in range(0, SPAN):
                if flag_at(flags, s, SPAN) != 0:
                    intra_grad_side(q, k, b, g, daqk, dtm, dqi, dbki, dki, steep, cu, chunk_info, T, NT,
                                    tl.program_id(0) * SPAN + s, i_h, N0, H, K, IS_VARLEN, True, SIDE,
                                    DOT_PREC, BT, BC, BK)
    else:
        intra_grad_side(q, k, b, g, daqk, dtm, dqi, dbki, dki, steep, cu, chunk_info, T, NT, tl.program_id(0), i_h,
                        N0, H, K, IS_VARLEN, False, SIDE, DOT_PREC, BT, BC, BK)


@triton.jit
def intra_grad_side(q, k, b, g, daqk, dtm, dqi, dbki, dki, steep, cu, chunk_info, T, NT, p0, i_h, N0,
                    H: tl.constexpr, K: tl.constexpr, IS_VARLEN: tl.constexpr, EXACT: tl.constexpr,
                    SIDE: tl.constexpr, DOT_PREC: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
                    BK: tl.constexpr):
    """The work of ``gdn2_bwd_intra_kernel`` for the first launch's program (p0, i_h): one chunk, head and
    key block; its steep flag sits at ``steep[i_h * N0 + p0]``."""
    if SIDE == 0:
        intra_grad_rows(q, k, b, g, daqk, dtm, dqi, dbki, steep, cu, chunk_info, T, NT, p0, i_h, N0, H, K,
                        IS_VARLEN, EXACT, DOT_PREC, BT, BC, BK)
    else:
        intra_grad_columns(q, k, b, g, daqk, dtm, dki, steep, cu, chunk_info, T, NT, p0, i_h, N0, H, K,
                           IS_VARLEN, EXACT, DOT_PREC, BT, BC, BK)


@triton.jit
def intra_grad_columns(q, k, b, g, daqk, dtm, dki, steep, cu, chunk_info, T, NT, p0, i_h, N0,
                       H: tl.constexpr, K: tl.constexpr, IS_VARLEN: tl.constexpr, EXACT: tl.constexpr,
                       DOT_PREC: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr):
    """Column side, one sub-chunk j at a time: dk_j from its diagonal block, then from every later
    sub-chunk i (reloaded, its decays taken against e_j: q_i exp2(G_i - e_j) <= q_i), so that only
    one dk tile is live."""
    _, _, L, row0, base, o_k = key_block_at(p0, i_h, cu, chunk_info, T, NT, H, K, IS_VARLEN, BT, BK)
    o_c = tl.arange(0, BC)
    dt = q.dtype.element_ty
    a = tl.zeros([BK], dtype=tl.float32)
    slow = 0
    for j in range(0, BT // BC):
        kh_j, f_j, b_h, e, dq_j, dbk_j, b_dk, ok = grad_sub_chunk(
            q, k, b, g, daqk, dtm, base, row0, j, a, o_c, o_k, L, H, K, EXACT, DOT_PREC, BT, BC, BK)
        slow = slow | (1 - ok)
        run = e
        acc = tl.zeros([BC, BK], dtype=tl.float32)
        for i in range(j + 1, BT // BC):
            r_q, r_k, r_b, r_g = load_sub_chunk_raw(q, k, b, g, base, i, o_c, o_k, L, H, K, BC)
            d_at, d_tt = grad_blocks(daqk, dtm, row0, i, j, o_c, L, H, BT, BC, True)
            b_G = run[None, :] + tl.cumsum(r_g.to(tl.float32) * LOG2E, axis=0)
            run = row_of(b_G, BC - 1, BC)
            b_x = exp2_nonpos(b_G - e[None, :])
            b_qx = r_q.to(tl.float32) * b_x
            b_bkx = r_b.to(tl.float32) * r_k.to(tl.float32) * b_x
            acc += tl.dot(d_at.to(dt), b_qx.to(dt), input_precision=DOT_PREC)
            acc += tl.dot(d_tt.to(dt), b_bkx.to(dt), input_precision=DOT_PREC)
        store_rows(dki, base, j * BC + o_c, o_k, L, b_dk + b_h * acc, H, K)
        a = e
    if not EXACT:
        tl.store(steep + i_h * N0 + p0, slow)


@triton.jit
def intra_grad_rows(q, k, b, g, daqk, dtm, dqi, dbki, steep, cu, chunk_info, T, NT, p0, i_h, N0,
                    H: tl.constexpr, K: tl.constexpr, IS_VARLEN: tl.constexpr, EXACT: tl.constexpr,
                    DOT_PREC: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr):
    """Row side: dq and d(b*k) of each sub-chunk i, complete once its own row of blocks is done, so the
    sub-chunks are walked in order with the earlier ones' k*H tiles kept (spelled out: see
    gdn2_intra_kernel)."""
    _, _, L, row0, base, o_k = key_block_at(p0, i_h, cu, chunk_info, T, NT, H, K, IS_VARLEN, BT, BK)
    o_c = tl.arange(0, BC)
    dt = q.dtype.element_ty
    a0 = tl.zeros([BK], dtype=tl.float32)
    kh0, _, _, e0, dq0, dbk0, _, ok0 = grad_sub_chunk(
        q, k, b, g, daqk, dtm, base, row0, 0, a0, o_c, o_k, L, H, K, EXACT, DOT_PREC, BT, BC, BK)
    store_rows(dqi, base, o_c, o_k, L, dq0, H, K)
    store_rows(dbki, base, o_c, o_k, L, dbk0, H, K)
    # the off-diagonal blocks of each row of blocks are loaded before that row's sub-chunk is widened
    a10, t10 = grad_blocks(daqk, dtm, row0, 1, 0, o_c, L, H, BT, BC, False)
    kh1, f1, _, e1, dq1, dbk1, _, ok1 = grad_sub_chunk(
        q, k, b, g, daqk, dtm, base, row0, 1, e0, o_c, o_k, L, H, K, EXACT, DOT_PREC, BT, BC, BK)
    one = tl.full([BK], 1.0, dtype=tl.float32)
    dq1, dbk1 = offdiag_row_grad(a10, t10, kh0, f1, one, dq1, dbk1, dt, DOT_PREC)
    store_rows(dqi, base, BC + o_c, o_k, L, dq1, H, K)
    store_rows(dbki, base, BC + o_c, o_k, L, dbk1, H, K)
    a21, t21 = grad_blocks(daqk, dtm, row0, 2, 1, o_c, L, H, BT, BC, False)
    a20, t20 = grad_blocks(daqk, dtm, row0, 2, 0, o_c, L, H, BT, BC, False)
    kh2, f2, _, e2, dq2, dbk2, _, ok2 = grad_sub_chunk(
        q, k, b, g, daqk, dtm, base, row0, 2, e1, o_c, o_k, L, H, K, EXACT, DOT_PREC, BT, BC, BK)
    dq2, dbk2 = offdiag_row_grad(a21, t21, kh1, f2, one, dq2, dbk2, dt, DOT_PREC)
    dq2, dbk2 = offdiag_row_grad(a20, t20, kh0, f2, tl.exp2(e1 - e0), dq2, dbk2, dt, DOT_PREC)
    store_rows(dqi, base, 2 * BC + o_c, o_k, L, dq2, H, K)
    store_rows(dbki, base, 2 * BC + o_c, o_k, L, dbk2, H, K)
    a32, t32 = grad_blocks(daqk, dtm, row0, 3, 2, o_c, L, H, BT, BC, False)
    a31, t31 = grad_blocks(daqk, dtm, row0, 3, 1, o_c, L, H, BT, BC, False)
    a30, t30 = grad_blocks(daqk, dtm, row0, 3, 0, o_c, L, H, BT, BC, False)
    _, f3, _, _, dq3, dbk3, _, ok3 = grad_sub_chunk(
        q, k, b, g, daqk, dtm, base, row0, 3, e2, o_c, o_k, L, H, K, EXACT, DOT_PREC, BT, BC, BK)
    dq3, dbk3 = offdiag_row_grad(a32, t32, kh2, f3, one, dq3, dbk3, dt, DOT_PREC)
    dq3, dbk3 = offdiag_row_grad(a31, t31, kh1, f3, tl.exp2(e2 - e1), dq3, dbk3, dt, DOT_PREC)
    dq3, dbk3 = offdiag_row_grad(a30, t30, kh0, f3, tl.exp2(e2 - e0), dq3, dbk3, dt, DOT_PREC)
    store_rows(dqi, base, 3 * BC + o_c, o_k, L, dq3, H, K)
    store_rows(dbki, base, 3 * BC + o_c, o_k, L, dbk3, H, K)
    if not EXACT:
        slow = (1 - ok0) | (1 - ok1) | (1 - ok2) | (1 - ok3)
        tl.store(steep + i_h * N0 + p0, slow)


# pinned first (bench/sweep_gdn2.py; timings in bench/NOTES.md). Not offered: configs Triton 3.6
# miscompiles here (BK 32 / BV 64 / 4 warps / 1 stage, and BV 128, one value step: wrong gradients)
_QKBG_CONFIGS = [
    triton.Config({"BK": 32, "BV": 64}, num_warps=4, num_stages=3),
    triton.Config({"BK": 32, "BV": 32}, num_warps=4, num_stages=3),
    triton.Config({"BK": 64, "BV": 64}, num_warps=8, num_stages=3),
]


@tuned(_QKBG_CONFIGS, key=["H", "K", "V"], clip={"BK": "KP", "BV": "VP"})
@triton.jit(do_not_specialize=["T", "NT"])
def gdn2_bwd_qkbg_kernel(q, k, b, g, amat, hbuf, dhbuf, do, r, dr, dqi, dbki, dki, dq, dk, db, dg,
                         cu, chunk_info, scale, T, NT,
                         H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, KP: tl.constexpr,
                         VP: tl.constexpr, IS_VARLEN: tl.constexpr, DOT_PREC: tl.constexpr,
                         BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    """One chunk, one head, one key block: dq, dk, db, dg (grid: chunks * key blocks, heads), from the
    intra-chunk gradients of ``gdn2_bwd_intra_kernel`` and the value-axis contractions.

    The key blocks of one chunk are neighbours in launch order, so the value-side tiles they all read
    (dO, R, dR, the state checkpoints) come from L2 after the first.
    """
    i_c, i_h, L, row0, base, o_k = key_block_program(cu, chunk_info, T, NT, H, K, IS_VARLEN, BT, BK)
    o_t = tl.arange(0, BT)
    b_dq_i = load_rows(dqi, base, o_t, o_k, L, H, K)
    b_dbk = load_rows(dbki, base, o_t, o_k, L, H, K)
    b_dkc = load_rows(dki, base, o_t, o_k, L, H, K)
    # G from one cumulative sum (rows past L load g = 0, so the last row holds G_C)
    b_G = tl.cumsum(load_rows(g, base, o_t, o_k, L, H, K) * LOG2E, axis=0)
    e3 = tl.sum(tl.where((o_t == BT - 1)[:, None], b_G, 0.0), axis=0)
    qkbg_finish(q, k, b, amat, hbuf, dhbuf, do, r, dr, dq, dk, db, dg, scale, b_dq_i, b_dbk, b_dkc, b_G, e3,
                i_c, i_h, row0, base, o_k, L, H, K, V, DOT_PREC, BT, BK, BV)
