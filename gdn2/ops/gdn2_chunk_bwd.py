"""Backward kernels of the chunked (WY) GDN-2 operator.

With dR the total gradient of the chunk's R (see ``gdn2_chunk_fwd``), per chunk:

    dR = Aqk^T dO + Kt dS_C                     dS0 = Diag(gamma_C) dS_C + scale Qg^T dO - Y^T dR
    dZ = A^T dR  (dv = dZ*w, dw = dZ*v)         dAqk = dO R^T           dT = -tril-1(dZ R^T)
    dQg = scale dO S0^T    dKt = R dS_C^T       dEb = A^T dY with dY = -dR S0^T

``dT = -A^T dA A^T`` collapses to ``-dZ R^T`` because ``dA = dR (Z - Eb S0)^T`` and ``R = A (Z - Eb S0)``,
so the gates stay inside the products without any transposed inverse. Kernels:

- ``gdn2_bwd_scan_kernel``: the one reverse scan over chunks (dS at every chunk end, dR, d initial state);
- ``gdn2_bwd_wy_kernel`` (chunk-parallel): dv, dw, dAqk, dT;
- ``gdn2_bwd_qkbg_kernel`` (chunk- and key-block-parallel): dq, dk, db, dg, with the pairwise decays of
  Aqk and T differentiated level by level as the forward built them (``level_anchor``), and dg as a
  reverse cumulative sum of dG inside the chunk.
"""

from __future__ import annotations

import triton
import triton.language as tl

from gdn2.ops.gdn2_chunk_fwd import load_chunk_qkbg
from gdn2.ops.gdn2_triton_utils import chunk_bounds, exp2_nonpos, level_anchor, row_of, seq_bounds, tuned

_SCAN_CONFIGS = [
    triton.Config({"BV": 32}, num_warps=4, num_stages=2),
    triton.Config({"BV": 16}, num_warps=4, num_stages=2),
    triton.Config({"BV": 64}, num_warps=4, num_stages=2),
]


@tuned(_SCAN_CONFIGS, key=["H", "K", "V", "SIZE"], clip={"BV": "VP"})
@triton.jit
def gdn2_bwd_scan_kernel(qg, y, kt, aqk, gcl, do, dht, dhbuf, dr, dh0, cu, chunk_off, scale, T, NT, SIZE,
                         H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, KP: tl.constexpr,
                         VP: tl.constexpr, IS_VARLEN: tl.constexpr, DOT_PREC: tl.constexpr, BT: tl.constexpr,
                         BV: tl.constexpr):
    """Reverse scan for one sequence, head and value block.

    Writes dS_C of every chunk (dhbuf [NC, H, K, V], input dtype), dR (dr [TT, H, V]) and the gradient
    of the initial state (dh0 [N, H, K, V] fp32).
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
    dt = qg.dtype.element_ty
    p_s = (i_n.to(tl.int64) * H + i_h) * K * V + (o_k[:, None] * V + o_v[None, :])
    # dht / dh0 always exist (zeros / a scratch buffer when absent): fewer kernel variants
    b_dh = tl.load(dht + p_s, mask=m_kv, other=0.0)
    n_t = tl.cdiv(eos - bos, BT)
    for i_r in range(0, n_t):
        i_t = n_t - 1 - i_r
        t0 = bos + i_t * BT
        m_t = o_t < eos - t0
        row0 = t0.to(tl.int64) * H + i_h
        i_c = (c0 + i_t).to(tl.int64)
        tl.store(dhbuf + (i_c * H + i_h) * K * V + (o_k[:, None] * V + o_v[None, :]),
                 b_dh.to(dhbuf.dtype.element_ty), mask=m_kv)
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


_WY_CONFIGS = [
    triton.Config({"BV": 32}, num_warps=4, num_stages=2),
    triton.Config({"BV": 64}, num_warps=8, num_stages=2),
]


@tuned(_WY_CONFIGS, key=["H", "V", "SIZE"], clip={"BV": "VP"})
@triton.jit
def gdn2_bwd_wy_kernel(v, w, amat, r, dr, do, dv, dw, daqk, dtm, cu, chunk_info, scale, T, NT, SIZE,
                       H: tl.constexpr, V: tl.constexpr, VP: tl.constexpr, IS_VARLEN: tl.constexpr,
                       DOT_PREC: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr):
    """One chunk, one head: dv, dw, and the fp32 [TT, H, 64] tiles dAqk (times scale) and dT."""
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
    tl.store(daqk + p_a, b_daqk, mask=m_t[:, None])
    tl.store(dtm + p_a, b_dtm, mask=m_t[:, None])


@triton.jit
def qkbg_level(b_q, b_k, b_bk, b_G, b_da, b_dtm, d: tl.constexpr, op_dt: tl.constexpr,
               DOT_PREC: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr):
    """Level d of the Aqk / T pairwise decays, differentiated: (dq, d(b*k), dk) contributions.

    ``b_da`` / ``b_dtm`` are dAqk (times scale) and dT [BT, BT] fp32. Factors and operand dtypes as in
    the forward's ``prep_level``.
    """
    o_t = tl.arange(0, BT)
    g_an = level_anchor(b_G, d, BT, BK)
    up = (o_t & (1 << d)) != 0
    f = tl.exp2(tl.minimum(tl.where(up[:, None], b_G - g_an, g_an - b_G), 0.0))
    f_r = tl.where(up[:, None], f, 0.0)
    f_c = tl.where(up[:, None], 0.0, f)
    # (row r in the upper half, column s in the lower half) of one group
    m_rs = up[:, None] & ((o_t & (1 << d)) == 0)[None, :]
    if d < 5:
        m_rs = m_rs & ((o_t[:, None] >> (d + 1)) == (o_t[None, :] >> (d + 1)))
    b_kc = (b_k * f_c).to(op_dt)
    x_da = tl.where(m_rs, b_da, 0.0).to(op_dt)
    x_dt = tl.where(m_rs, b_dtm, 0.0).to(op_dt)
    x_q = f_r * tl.dot(x_da, b_kc, input_precision=DOT_PREC)
    x_b = f_r * tl.dot(x_dt, b_kc, input_precision=DOT_PREC)
    # column side: the transposes are of loaded tiles, never of a dot result
    x_k = f_c * (tl.dot(tl.trans(x_da), (b_q * f_r).to(op_dt), input_precision=DOT_PREC)
                 + tl.dot(tl.trans(x_dt), (b_bk * f_r).to(op_dt), input_precision=DOT_PREC))
    return x_q, x_b, x_k


# ptxas (sm_90, K = V = 128) spills per thread: BK 32 / 8 warps 1.4 KB, BK 16 / 8 warps 0.4 KB,
# BK 32 / 4 warps 5 KB; the [64, 64] fp32 dAqk / dT tiles dominate. Autotuning picks on the GPU.
_QKBG_CONFIGS = [
    triton.Config({"BK": 32, "BV": 64}, num_warps=8, num_stages=2),
    triton.Config({"BK": 16, "BV": 64}, num_warps=8, num_stages=2),
    triton.Config({"BK": 32, "BV": 64}, num_warps=4, num_stages=2),
]


@tuned(_QKBG_CONFIGS, key=["H", "K", "V", "SIZE"], clip={"BK": "KP", "BV": "VP"})
@triton.jit
def gdn2_bwd_qkbg_kernel(q, k, b, g, amat, hbuf, dhbuf, do, r, dr, daqk, dtm, dq, dk, db, dg,
                         cu, chunk_info, scale, T, NT, SIZE,
                         H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, KP: tl.constexpr,
                         VP: tl.constexpr, IS_VARLEN: tl.constexpr, DOT_PREC: tl.constexpr,
                         BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    """One chunk, one head, one key block: dq, dk, db, dg (grid: chunks * key blocks, heads).

    The key blocks of one chunk are neighbours in launch order, so the value-side tiles they all read
    (dO, R, dR, dAqk, dT) come from L2 after the first.
    """
    NK = tl.cdiv(K, BK)
    i_c = tl.program_id(0) // NK
    i_k = tl.program_id(0) % NK
    i_h = tl.program_id(1)
    t0, L = chunk_bounds(i_c, cu, chunk_info, T, NT, IS_VARLEN, BT)
    o_t = tl.arange(0, BT)
    m_t = o_t < L
    row0 = t0.to(tl.int64) * H + i_h
    dt = q.dtype.element_ty
    o_k = i_k * BK + tl.arange(0, BK)
    m_k = o_k < K
    b_q, b_k, b_b, b_G = load_chunk_qkbg(q, k, b, g, row0, o_t, o_k, m_t, H, K)
    b_bk = b_b * b_k

    # intra-chunk part first (its [BT, BT] tiles die before the value loop): gradients of Aqk and T
    # through their pairwise decays, level by level as the forward built them (see level_anchor)
    p_a = row0 * BT + (o_t[:, None] * (H * BT) + o_t[None, :])
    b_da = tl.load(daqk + p_a, mask=m_t[:, None], other=0.0)
    b_dtm = tl.load(dtm + p_a, mask=m_t[:, None], other=0.0)
    da_diag = tl.sum(tl.where(o_t[:, None] == o_t[None, :], b_da, 0.0), axis=1)
    b_dq_i = da_diag[:, None] * b_k
    b_dkc = da_diag[:, None] * b_q
    # (levels are spelled out: a static loop variable is not a constexpr under the interpreter)
    b_dq_x, b_dbk, b_dk_x = qkbg_level(b_q, b_k, b_bk, b_G, b_da, b_dtm, 5, dt, DOT_PREC, BT, BK)
    b_dq_i += b_dq_x
    b_dkc += b_dk_x
    b_dq_x, b_db_x, b_dk_x = qkbg_level(b_q, b_k, b_bk, b_G, b_da, b_dtm, 4, dt, DOT_PREC, BT, BK)
    b_dq_i += b_dq_x
    b_dbk += b_db_x
    b_dkc += b_dk_x
    b_dq_x, b_db_x, b_dk_x = qkbg_level(b_q, b_k, b_bk, b_G, b_da, b_dtm, 3, tl.float32, DOT_PREC,
                                        BT, BK)
    b_dq_i += b_dq_x
    b_dbk += b_db_x
    b_dkc += b_dk_x
    b_dq_x, b_db_x, b_dk_x = qkbg_level(b_q, b_k, b_bk, b_G, b_da, b_dtm, 2, tl.float32, DOT_PREC,
                                        BT, BK)
    b_dq_i += b_dq_x
    b_dbk += b_db_x
    b_dkc += b_dk_x
    b_dq_x, b_db_x, b_dk_x = qkbg_level(b_q, b_k, b_bk, b_G, b_da, b_dtm, 1, tl.float32, DOT_PREC,
                                        BT, BK)
    b_dq_i += b_dq_x
    b_dbk += b_db_x
    b_dkc += b_dk_x
    b_dq_x, b_db_x, b_dk_x = qkbg_level(b_q, b_k, b_bk, b_G, b_da, b_dtm, 0, tl.float32, DOT_PREC,
                                        BT, BK)
    b_dq_i += b_dq_x
    b_dbk += b_db_x
    b_dkc += b_dk_x

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
    b_at = tl.load(amat + row0 * BT + (o_t[None, :] * (H * BT) + o_t[:, None]), mask=m_t[None, :], other=0.0).to(dt)
    b_deb = tl.dot(b_at, b_dy.to(dt), input_precision=DOT_PREC)
    g_last = row_of(b_G, BT - 1, BT)
    b_gam = tl.exp2(b_G)
    b_tail = exp2_nonpos(g_last[None, :] - b_G)

    b_dq = b_dqg * scale * b_gam + b_dq_i
    b_dk_kt = b_dkt * b_tail             # through Kt = k * gamma_C / gamma
    b_dk_eb = b_deb * b_b * b_gam        # through Eb = b * k * gamma
    b_dk = b_dk_kt + b_dk_eb + b_dkc + b_b * b_dbk
    b_db = b_deb * b_k * b_gam + b_k * b_dbk
    # dG per row and channel; gamma_C enters through Kt and through the state decay
    b_dG = b_q * b_dq + b_k * (b_dk_eb - b_dk_kt - b_dkc) + b_bk * b_dbk
    extra = tl.sum(b_k * b_dk_kt, axis=0) + tl.exp2(g_last) * b_dgl
    b_dG += tl.where((o_t == L - 1)[:, None], extra[None, :], 0.0)
    b_dg = tl.sum(b_dG, axis=0)[None, :] - tl.cumsum(b_dG, axis=0) + b_dG

    offs = row0 * K + (o_t[:, None] * (H * K) + o_k[None, :])
    msk = m_t[:, None] & m_k[None, :]
    tl.store(dq + offs, b_dq.to(dq.dtype.element_ty), mask=msk)
    tl.store(dk + offs, b_dk.to(dk.dtype.element_ty), mask=msk)
    tl.store(db + offs, b_db.to(db.dtype.element_ty), mask=msk)
    tl.store(dg + offs, b_dg.to(dg.dtype.element_ty), mask=msk)
