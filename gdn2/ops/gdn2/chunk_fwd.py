"""Forward kernels of the chunked (WY) GDN-2 operator.

Per chunk of 64 rows (S0 = state at the chunk start, G = in-chunk cumulative log2-decay):

    Aqk = scale * tril0((q*gamma)(k/gamma)^T)     T = tril-1((b*k*gamma)(k/gamma)^T)
    A = (I + T)^-1,  Y = A (b*k*gamma),  U = A (w*v),  R = U - Y S0
    O = scale * (q*gamma) S0 + Aqk R,     S_C = Diag(gamma_C) S0 + (k*gamma_C/gamma)^T R

``gdn2_intra_kernel`` (chunk-parallel) builds Aqk and A, ``gdn2_prep_kernel`` the other chunk-local
operands of the scan;
``gdn2_fwd_scan_kernel`` (one program per sequence, head and value block) carries S across chunks,
writes o, and R when training. The backward keeps Aqk, A and R from the forward and rebuilds the
per-chunk states from them with ``gdn2_state_scan_kernel`` (a lighter scan: one product per chunk).

No factor k/gamma is ever formed. The chunk is handled as four sub-chunks of 16 rows; a_i is G at the
row before sub-chunk i (a_0 = 0) and e_i = a_{i+1} is G at its last row. With

    F_i(r) = exp2(G_r - a_i) <= 1 (r in i),     H_j(s) = exp2(e_j - G_s) <= 1 (s in j),

a pair r in i > j of s is exp2(G_r - G_s) = F_i(r) * exp2(a_i - e_j) * H_j(s), every factor <= 1:
the off-diagonal 16x16 blocks are products of [16, BK] tiles with no overflow at any decay (operands in
the input dtype). The diagonal blocks are anchored at the sub-chunk's middle row m: factors
exp2(G_r - G_m) and exp2(G_m - G_s) lie within [2^-FAST_SPAN, 2^FAST_SPAN] as long as each half of the
sub-chunk decays by at most FAST_SPAN (log2), which holds for realistic gates; for steeper ones (per
key block) a second launch of the intra kernel redoes the chunk with an exact column-by-column path,
pairwise exp2(G_r - G_s), exponent <= 0. Diagonal blocks are
built with fp32 operands (tf32 at most for 16-bit inputs) and inverted by fp32 forward substitution;
the off-diagonal blocks of A follow by block substitution. Qg = q*gamma, Kt = k*gamma_C/gamma and
Eb = b*k*gamma come from the same tiles times per-channel factors exp2(a_i), exp2(G_C - e_i) (<= 1).
"""

from __future__ import annotations

import triton
import triton.language as tl

from gdn2.ops.gdn2.utils import (FAST_SPAN, LOG2E, chunk_bounds, chunk_identity, exp2_nonpos, flag_at,
                                 load_rows_raw, load_rows_t, row_of, scan_chunk, scan_program, steep_flags,
                                 store_chunk_state, store_rows, tuned)


@triton.jit
def diag_columns(b_q, b_k, b_bk, b_G, o_c, BC: tl.constexpr):
    """Exact diagonal block, one key column s at a time: sum_c q_rc k_sc exp2(G_rc - G_sc) for r >= s
    (Aqk) and the same with b*k for r > s (T); every exponent is <= 0."""
    d_qk = tl.zeros([BC, BC], dtype=tl.float32)
    d_t = tl.zeros([BC, BC], dtype=tl.float32)
    for s in range(0, BC):
        sel = (o_c == s)[:, None]
        g_s = tl.sum(tl.where(sel, b_G, 0.0), axis=0)
        k_s = tl.sum(tl.where(sel, b_k, 0.0), axis=0)
        b_ke = exp2_nonpos(b_G - g_s[None, :]) * k_s[None, :]
        col = (o_c == s)[None, :]
        d_qk = tl.where(col & (o_c >= s)[:, None], tl.sum(b_q * b_ke, axis=1)[:, None], d_qk)
        d_t = tl.where(col & (o_c > s)[:, None], tl.sum(b_bk * b_ke, axis=1)[:, None], d_t)
    return d_qk, d_t


@triton.jit
def load_sub_chunk_raw(q, k, b, g, base, i, o_c, o_k, L, H: tl.constexpr, K: tl.constexpr, BC: tl.constexpr):
    """q, k, b, g of sub-chunk i ([BC, BK], their own dtypes): all four loads issued together."""
    rows = i * BC + o_c
    return (load_rows_raw(q, base, rows, o_k, L, H, K), load_rows_raw(k, base, rows, o_k, L, H, K),
            load_rows_raw(b, base, rows, o_k, L, H, K), load_rows_raw(g, base, rows, o_k, L, H, K))


@triton.jit
def widen_sub_chunk(r_q, r_k, r_b, r_g, a, BC: tl.constexpr):
    """q, k, b (fp32) of a sub-chunk loaded by ``load_sub_chunk_raw`` and its cumulative log2-decay
    G = a + cumsum(g*log2 e); also e (G at the last row), m (G at the middle row) and whether the
    anchored diagonal is safe."""
    b_G = a[None, :] + tl.cumsum(r_g.to(tl.float32) * LOG2E, axis=0)
    e = row_of(b_G, BC - 1, BC)
    m = row_of(b_G, BC // 2 - 1, BC)
    fast = tl.max(tl.maximum(a - m, m - e), axis=0) <= FAST_SPAN
    return r_q.to(tl.float32), r_k.to(tl.float32), r_b.to(tl.float32), b_G, e, m, fast


@triton.jit
def load_sub_chunk(q, k, b, g, base, i, a, o_c, o_k, L, H: tl.constexpr, K: tl.constexpr,
                   BC: tl.constexpr):
    """``load_sub_chunk_raw`` then ``widen_sub_chunk``."""
    r_q, r_k, r_b, r_g = load_sub_chunk_raw(q, k, b, g, base, i, o_c, o_k, L, H, K, BC)
    return widen_sub_chunk(r_q, r_k, r_b, r_g, a, BC)


@triton.jit
def sub_chunk_factors(b_G, a, e, m, fast):
    """fp32 [BC, BK] factors of one sub-chunk: F = exp2(G - a) and H = exp2(e - G) (<= 1, off-diagonal
    products) and the middle-row anchored pair exp2(G - m), exp2(m - G) of the fast diagonal. The
    latter are clamped to 2^FAST_SPAN, so a sub-chunk past the fast bound yields finite values that
    the exact path later replaces; within the bound F and H are derived from them (no more exp2)."""
    b_fm = tl.exp2(tl.minimum(b_G - m[None, :], FAST_SPAN))
    b_km = tl.exp2(tl.minimum(m[None, :] - b_G, FAST_SPAN))
    if fast:
        # within the bound both products are normal numbers or truly negligible
        b_f = b_fm * tl.exp2(m - a)[None, :]
        b_h = b_km * tl.exp2(e - m)[None, :]
    else:
        b_f = tl.exp2(b_G - a[None, :])
        b_h = tl.exp2(e[None, :] - b_G)
    return b_fm, b_km, b_f, b_h


@triton.jit
def intra_sub_chunk(q, k, b, g, base, i: tl.constexpr, a, o_c, o_k, L, H: tl.constexpr, K: tl.constexpr,
                    EXACT: tl.constexpr, DOT_PREC: tl.constexpr, BC: tl.constexpr):
    """Sub-chunk i, one key block: its share of the diagonal blocks of Aqk (unscaled, r >= s) and T
    (r > s; fp32 [BC, BC], upper triangle not cleared), the tiles q*F, b*k*F, k*H of the off-diagonal
    products, e, and whether the anchored product is exact here (``fast``). The share comes from the
    anchored product, except with EXACT where this key block's decay is too steep for it: then from
    the exact column path (each key block's share is a sum over its own channels, so the two paths may
    mix within one block)."""
    b_q, b_k, b_b, b_G, e, m, fast = load_sub_chunk(q, k, b, g, base, i, a, o_c, o_k, L, H, K, BC)
    b_bk = b_b * b_k
    b_fm, b_km, b_f, b_h = sub_chunk_factors(b_G, a, e, m, fast)
    if EXACT:
        if fast:
            d_qk, d_t = anchored_diag(b_q, b_k, b_bk, b_fm, b_km, DOT_PREC)
        else:
            d_qk, d_t = diag_columns(b_q, b_k, b_bk, b_G, o_c, BC)
    else:
        d_qk, d_t = anchored_diag(b_q, b_k, b_bk, b_fm, b_km, DOT_PREC)
    return b_q * b_f, b_bk * b_f, b_k * b_h, e, d_qk, d_t, fast.to(tl.int32)


@triton.jit
def anchored_diag(b_q, b_k, b_bk, b_fm, b_km, DOT_PREC: tl.constexpr):
    """The diagonal blocks of Aqk and T as one product anchored at the middle row (see
    ``sub_chunk_factors``); exact within the fast bound, finite past it."""
    b_kd = tl.trans(b_k * b_km)
    return (tl.dot(b_q * b_fm, b_kd, input_precision=DOT_PREC),
            tl.dot(b_bk * b_fm, b_kd, input_precision=DOT_PREC))


@triton.jit
def invert4(t0, t1, t2, t3, o_c, BC: tl.constexpr):
    """(I + t)^-1 of four strictly lower [BC, BC] fp32 blocks by forward substitution, side by side."""
    x0 = tl.zeros([BC, BC], dtype=tl.float32)  # (I + t)^-1 - I, filled row by row
    x1 = tl.zeros([BC, BC], dtype=tl.float32)
    x2 = tl.zeros([BC, BC], dtype=tl.float32)
    x3 = tl.zeros([BC, BC], dtype=tl.float32)
    for i in range(1, BC):
        rm = (o_c == i)[:, None]
        r0 = -tl.sum(tl.where(rm, t0, 0.0), axis=0)
        r1 = -tl.sum(tl.where(rm, t1, 0.0), axis=0)
        r2 = -tl.sum(tl.where(rm, t2, 0.0), axis=0)
        r3 = -tl.sum(tl.where(rm, t3, 0.0), axis=0)
        x0 = tl.where(rm, (r0 + tl.sum(r0[:, None] * x0, axis=0))[None, :], x0)
        x1 = tl.where(rm, (r1 + tl.sum(r1[:, None] * x1, axis=0))[None, :], x1)
        x2 = tl.where(rm, (r2 + tl.sum(r2[:, None] * x2, axis=0))[None, :], x2)
        x3 = tl.where(rm, (r3 + tl.sum(r3[:, None] * x3, axis=0))[None, :], x3)
    eye = o_c[:, None] == o_c[None, :]
    return tl.where(eye, x0 + 1.0, x0), tl.where(eye, x1 + 1.0, x1), tl.where(eye, x2 + 1.0, x2), \
        tl.where(eye, x3 + 1.0, x3)


@triton.jit
def offdiag_pair(a, t, qf, bf, kh, dt, DOT_PREC: tl.constexpr):
    """Blocks (i, j < i) of Aqk and T plus one key block's share: ``qF (kH)^T`` and ``bkF (kH)^T``."""
    x_k = tl.trans(kh.to(dt))
    return (a + tl.dot(qf.to(dt), x_k, input_precision=DOT_PREC),
            t + tl.dot(bf.to(dt), x_k, input_precision=DOT_PREC))


@triton.jit
def store_block(ptr, row0, i: tl.constexpr, j: tl.constexpr, x, o_c, L, H: tl.constexpr, BT: tl.constexpr,
                BC: tl.constexpr):
    """Block (i, j) of a token-major [TT, H, BT] chunk matrix; rows at or past L are not written."""
    rows = i * BC + o_c
    p = row0 * BT + (rows[:, None] * (H * BT) + (j * BC + o_c)[None, :])
    tl.store(ptr + p, x.to(ptr.dtype.element_ty), mask=(rows < L)[:, None])


# pinned first (bench/sweep_gdn2.py; timings in bench/NOTES.md): the [16, 16] products fill one warp's
# mma tile, so more warps only replicate them, and one warp per program lets several programs share an SM
_INTRA_CONFIGS = [
    triton.Config({"BK": 32}, num_warps=1, num_stages=2),
    triton.Config({"BK": 16}, num_warps=2, num_stages=1),
    triton.Config({"BK": 32}, num_warps=8, num_stages=1),
]


# Integer arguments that vary from call to call are not specialised (one compiled variant for every
# length).
@tuned(_INTRA_CONFIGS, key=["H", "K", "EXACT"], clip={"BK": "KP"})
@triton.jit(do_not_specialize=["T", "NT", "NC"])
def gdn2_intra_kernel(q, k, g, b, aqk, amat, steep, cu, chunk_info, scale, T, NT, NC,
                      H: tl.constexpr, K: tl.constexpr, KP: tl.constexpr,
                      IS_VARLEN: tl.constexpr, EXACT: tl.constexpr, DOT_PREC: tl.constexpr,
                      BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, SPAN: tl.constexpr):
    """One chunk, one head: Aqk (scaled, masked) and A, token-major [TT, H, 64] each. The scan operands
    that need A (Y, U) or only the gates (Qg, Kt) come from ``gdn2_prep_kernel``.

    Launched twice. The first launch (EXACT off) builds every diagonal block by the anchored product and
    records in ``steep`` (int32 [NC, H]) the chunks where some sub-chunk and key block decays too fast
    for it; their outputs are finite but not yet right. The second launch (EXACT on; grid: NC / SPAN,
    heads) redoes only those chunks, with the exact column path where needed: each of its programs loads
    the flags of SPAN chunks at once and returns when none is set. Keeping the rarely taken exact path
    out of the first launch's code spares it registers.
    """
    i_c = tl.program_id(0)
    i_h = tl.program_id(1)
    if EXACT:
        flags = steep_flags(steep, i_c * SPAN, i_h, NC, H, 1, SPAN)
        if tl.max(flags, axis=0) != 0:
            for s in range(0, SPAN):
                if flag_at(flags, s, SPAN) != 0:
                    intra_chunk(q, k, g, b, aqk, amat, steep, cu, chunk_info, scale, T, NT,
                                i_c * SPAN + s, i_h, H, K, IS_VARLEN, True, DOT_PREC, BT, BC, BK)
    else:
        intra_chunk(q, k, g, b, aqk, amat, steep, cu, chunk_info, scale, T, NT,
                    i_c, i_h, H, K, IS_VARLEN, False, DOT_PREC, BT, BC, BK)


@triton.jit
def intra_chunk(q, k, g, b, aqk, amat, steep, cu, chunk_info, scale, T, NT, i_c, i_h,
                H: tl.constexpr, K: tl.constexpr, IS_VARLEN: tl.constexpr, EXACT: tl.constexpr,
                DOT_PREC: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr):
    """The work of ``gdn2_intra_kernel`` for chunk i_c, head i_h."""
    t0, L = chunk_bounds(i_c, cu, chunk_info, T, NT, IS_VARLEN, BT)
    row0 = t0.to(tl.int64) * H + i_h  # (token, head) row of the chunk's first token
    base = row0 * K
    o_c = tl.arange(0, BC)
    dt = q.dtype.element_ty

    # Aqk (a..) and T (t..) as ten lower 16x16 blocks each, fp32 accumulators over the key blocks
    a00 = tl.zeros([BC, BC], dtype=tl.float32)
    a10 = tl.zeros([BC, BC], dtype=tl.float32)
    a11 = tl.zeros([BC, BC], dtype=tl.float32)
    a20 = tl.zeros([BC, BC], dtype=tl.float32)
    a21 = tl.zeros([BC, BC], dtype=tl.float32)
    a22 = tl.zeros([BC, BC], dtype=tl.float32)
    a30 = tl.zeros([BC, BC], dtype=tl.float32)
    a31 = tl.zeros([BC, BC], dtype=tl.float32)
    a32 = tl.zeros([BC, BC], dtype=tl.float32)
    a33 = tl.zeros([BC, BC], dtype=tl.float32)
    t00 = tl.zeros([BC, BC], dtype=tl.float32)
    t10 = tl.zeros([BC, BC], dtype=tl.float32)
    t11 = tl.zeros([BC, BC], dtype=tl.float32)
    t20 = tl.zeros([BC, BC], dtype=tl.float32)
    t21 = tl.zeros([BC, BC], dtype=tl.float32)
    t22 = tl.zeros([BC, BC], dtype=tl.float32)
    t30 = tl.zeros([BC, BC], dtype=tl.float32)
    t31 = tl.zeros([BC, BC], dtype=tl.float32)
    t32 = tl.zeros([BC, BC], dtype=tl.float32)
    t33 = tl.zeros([BC, BC], dtype=tl.float32)
    slow = 0  # some sub-chunk and key block too steep for the anchored diagonal product
    for i_k in range(0, tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        a0 = tl.zeros([BK], dtype=tl.float32)
        # (sub-chunks are spelled out: a static loop variable is not a constexpr under the interpreter)
        qf, bf, kh0, e0, d_qk, d_t, f_ok = intra_sub_chunk(q, k, b, g, base, 0, a0, o_c, o_k, L, H, K, EXACT, DOT_PREC, BC)
        a00 += d_qk
        t00 += d_t
        slow = slow | (1 - f_ok)
        qf, bf, kh1, e1, d_qk, d_t, f_ok = intra_sub_chunk(q, k, b, g, base, 1, e0, o_c, o_k, L, H, K, EXACT, DOT_PREC, BC)
        a11 += d_qk
        t11 += d_t
        slow = slow | (1 - f_ok)
        a10, t10 = offdiag_pair(a10, t10, qf, bf, kh0, dt, DOT_PREC)
        qf, bf, kh2, e2, d_qk, d_t, f_ok = intra_sub_chunk(q, k, b, g, base, 2, e1, o_c, o_k, L, H, K, EXACT, DOT_PREC, BC)
        a22 += d_qk
        t22 += d_t
        slow = slow | (1 - f_ok)
        a21, t21 = offdiag_pair(a21, t21, qf, bf, kh1, dt, DOT_PREC)
        a20, t20 = offdiag_pair(a20, t20, qf, bf, kh0 * tl.exp2(e1 - e0)[None, :], dt, DOT_PREC)
        qf, bf, _, _, d_qk, d_t, f_ok = intra_sub_chunk(q, k, b, g, base, 3, e2, o_c, o_k, L, H, K, EXACT, DOT_PREC, BC)
        a33 += d_qk
        t33 += d_t
        slow = slow | (1 - f_ok)
        a32, t32 = offdiag_pair(a32, t32, qf, bf, kh2, dt, DOT_PREC)
        a31, t31 = offdiag_pair(a31, t31, qf, bf, kh1 * tl.exp2(e2 - e1)[None, :], dt, DOT_PREC)
        a30, t30 = offdiag_pair(a30, t30, qf, bf, kh0 * tl.exp2(e2 - e0)[None, :], dt, DOT_PREC)
    if not EXACT:
        tl.store(steep + i_c * H + i_h, slow)

    low = o_c[:, None] >= o_c[None, :]
    zero = tl.zeros([BC, BC], dtype=tl.float32)
    store_block(aqk, row0, 0, 0, tl.where(low, a00 * scale, 0.0), o_c, L, H, BT, BC)
    store_block(aqk, row0, 0, 1, zero, o_c, L, H, BT, BC)
    store_block(aqk, row0, 0, 2, zero, o_c, L, H, BT, BC)
    store_block(aqk, row0, 0, 3, zero, o_c, L, H, BT, BC)
    store_block(aqk, row0, 1, 0, a10 * scale, o_c, L, H, BT, BC)
    store_block(aqk, row0, 1, 1, tl.where(low, a11 * scale, 0.0), o_c, L, H, BT, BC)
    store_block(aqk, row0, 1, 2, zero, o_c, L, H, BT, BC)
    store_block(aqk, row0, 1, 3, zero, o_c, L, H, BT, BC)
    store_block(aqk, row0, 2, 0, a20 * scale, o_c, L, H, BT, BC)
    store_block(aqk, row0, 2, 1, a21 * scale, o_c, L, H, BT, BC)
    store_block(aqk, row0, 2, 2, tl.where(low, a22 * scale, 0.0), o_c, L, H, BT, BC)
    store_block(aqk, row0, 2, 3, zero, o_c, L, H, BT, BC)
    store_block(aqk, row0, 3, 0, a30 * scale, o_c, L, H, BT, BC)
    store_block(aqk, row0, 3, 1, a31 * scale, o_c, L, H, BT, BC)
    store_block(aqk, row0, 3, 2, a32 * scale, o_c, L, H, BT, BC)
    store_block(aqk, row0, 3, 3, tl.where(low, a33 * scale, 0.0), o_c, L, H, BT, BC)

    solve_and_store(t00, t10, t11, t20, t21, t22, t30, t31, t32, t33, amat, row0, L, H, DOT_PREC, BT, BC)


@triton.jit
def solve_and_store(t00, t10, t11, t20, t21, t22, t30, t31, t32, t33, amat, row0, L, H: tl.constexpr,
                    DOT_PREC: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    """From the ten lower 16x16 blocks of T (fp32; diagonal ones with their upper triangle not yet
    cleared): A = (I + T)^-1 into amat."""
    o_c = tl.arange(0, BC)
    strict = o_c[:, None] > o_c[None, :]
    zero = tl.zeros([BC, BC], dtype=tl.float32)
    # A = (I + T)^-1: diagonal blocks by fp32 forward substitution, then block rows in order,
    # A_ij = -A_ii sum_{j <= l < i} T_il A_lj
    x00, x11, x22, x33 = invert4(tl.where(strict, t00, 0.0), tl.where(strict, t11, 0.0),
                                 tl.where(strict, t22, 0.0), tl.where(strict, t33, 0.0), o_c, BC)
    x10 = -tl.dot(x11, tl.dot(t10, x00, input_precision=DOT_PREC), input_precision=DOT_PREC)
    x21 = -tl.dot(x22, tl.dot(t21, x11, input_precision=DOT_PREC), input_precision=DOT_PREC)
    x32 = -tl.dot(x33, tl.dot(t32, x22, input_precision=DOT_PREC), input_precision=DOT_PREC)
    x20 = -tl.dot(x22, tl.dot(t20, x00, input_precision=DOT_PREC) + tl.dot(t21, x10, input_precision=DOT_PREC),
                  input_precision=DOT_PREC)
    x31 = -tl.dot(x33, tl.dot(t31, x11, input_precision=DOT_PREC) + tl.dot(t32, x21, input_precision=DOT_PREC),
                  input_precision=DOT_PREC)
    x30 = -tl.dot(x33, tl.dot(t30, x00, input_precision=DOT_PREC) + tl.dot(t31, x10, input_precision=DOT_PREC)
                  + tl.dot(t32, x20, input_precision=DOT_PREC), input_precision=DOT_PREC)
    store_block(amat, row0, 0, 0, x00, o_c, L, H, BT, BC)
    store_block(amat, row0, 0, 1, zero, o_c, L, H, BT, BC)
    store_block(amat, row0, 0, 2, zero, o_c, L, H, BT, BC)
    store_block(amat, row0, 0, 3, zero, o_c, L, H, BT, BC)
    store_block(amat, row0, 1, 0, x10, o_c, L, H, BT, BC)
    store_block(amat, row0, 1, 1, x11, o_c, L, H, BT, BC)
    store_block(amat, row0, 1, 2, zero, o_c, L, H, BT, BC)
    store_block(amat, row0, 1, 3, zero, o_c, L, H, BT, BC)
    store_block(amat, row0, 2, 0, x20, o_c, L, H, BT, BC)
    store_block(amat, row0, 2, 1, x21, o_c, L, H, BT, BC)
    store_block(amat, row0, 2, 2, x22, o_c, L, H, BT, BC)
    store_block(amat, row0, 2, 3, zero, o_c, L, H, BT, BC)
    store_block(amat, row0, 3, 0, x30, o_c, L, H, BT, BC)
    store_block(amat, row0, 3, 1, x31, o_c, L, H, BT, BC)
    store_block(amat, row0, 3, 2, x32, o_c, L, H, BT, BC)
    store_block(amat, row0, 3, 3, x33, o_c, L, H, BT, BC)


# pinned first (bench/sweep_gdn2.py; timings in bench/NOTES.md)
_PREP_CONFIGS = [
    triton.Config({"BK": 64, "BV": 64}, num_warps=4, num_stages=2),
    triton.Config({"BK": 32, "BV": 32}, num_warps=4, num_stages=2),
    triton.Config({"BK": 128, "BV": 128}, num_warps=8, num_stages=2),
]


@tuned(_PREP_CONFIGS, key=["H", "K", "V", "WITH_U"], clip={"BK": "KP", "BV": "VP"})
@triton.jit(do_not_specialize=["T", "NT"])
def gdn2_prep_kernel(q, k, b, g, v, w, amat, y, kt, qg, u, gcl, cu, chunk_info, T, NT,
                     H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, KP: tl.constexpr, VP: tl.constexpr,
                     IS_VARLEN: tl.constexpr, WITH_U: tl.constexpr, DOT_PREC: tl.constexpr, BT: tl.constexpr,
                     BK: tl.constexpr, BV: tl.constexpr):
    """The chunk-local scan operands that need A (``gdn2_intra_kernel``'s, or the one the training forward
    saved, in the backward) or only the gates. Grid: (chunks * (key blocks [+ value blocks]), heads).
    A key-block program writes Qg = q*gamma, Y = A (b*k*gamma), Kt = k*gamma_C/gamma and exp2(G_C), with
    G one cumulative sum over the chunk (rows past L load g = 0, so the last row holds G_C; every factor
    is exp2 of an exponent <= 0); with WITH_U a value-block program writes U = A (w*v)."""
    NK = tl.cdiv(K, BK)
    NB = NK + tl.cdiv(V, BV) * WITH_U
    i_c = tl.program_id(0) // NB
    j = tl.program_id(0) % NB
    i_h = tl.program_id(1)
    t0, L = chunk_bounds(i_c, cu, chunk_info, T, NT, IS_VARLEN, BT)
    row0 = t0.to(tl.int64) * H + i_h
    o_t = tl.arange(0, BT)
    dt = q.dtype.element_ty
    b_a = tl.load(amat + row0 * BT + (o_t[:, None] * (H * BT) + o_t[None, :]), mask=(o_t < L)[:, None], other=0.0)
    if j < NK:
        base = row0 * K
        o_k = j * BK + tl.arange(0, BK)
        r_g = load_rows_raw(g, base, o_t, o_k, L, H, K)
        r_k = load_rows_raw(k, base, o_t, o_k, L, H, K)
        r_q = load_rows_raw(q, base, o_t, o_k, L, H, K)
        r_b = load_rows_raw(b, base, o_t, o_k, L, H, K)
        b_G = tl.cumsum(r_g.to(tl.float32) * LOG2E, axis=0)
        e_c = row_of(b_G, BT - 1, BT)
        b_gam = tl.exp2(b_G)
        b_k = r_k.to(tl.float32)
        store_rows(qg, base, o_t, o_k, L, r_q.to(tl.float32) * b_gam, H, K)
        store_rows(kt, base, o_t, o_k, L, b_k * exp2_nonpos(e_c[None, :] - b_G), H, K)
        b_eb = (r_b.to(tl.float32) * b_k * b_gam).to(dt)
        store_rows(y, base, o_t, o_k, L, tl.dot(b_a, b_eb, input_precision=DOT_PREC), H, K)
        tl.store(gcl + (i_c.to(tl.int64) * H + i_h) * K + o_k, tl.exp2(e_c), mask=o_k < K)
    else:
        o_v = (j - NK) * BV + tl.arange(0, BV)
        r_w = load_rows_raw(w, row0 * V, o_t, o_v, L, H, V)
        r_v = load_rows_raw(v, row0 * V, o_t, o_v, L, H, V)
        b_wv = r_w.to(tl.float32) * r_v.to(tl.float32)
        store_rows(u, row0 * V, o_t, o_v, L, tl.dot(b_a, b_wv.to(dt), input_precision=DOT_PREC), H, V)


SCAN_CONFIGS = [
    triton.Config({"BV": 64}, num_warps=4, num_stages=3),
    triton.Config({"BV": 32}, num_warps=4, num_stages=3),
    triton.Config({"BV": 16}, num_warps=4, num_stages=3),
]
# the backward scan also takes the whole value axis in one program (8 warps; 2 stages fit in shared
# memory) where that still gives enough programs; it paid there and not in the forward scan (bench/NOTES.md)
BWD_SCAN_CONFIGS = [triton.Config({"BV": 128}, num_warps=8, num_stages=2)] + SCAN_CONFIGS


def scan_picker(min_programs: int, configs=SCAN_CONFIGS):
    """Launch config of a scan: the first (widest value block) of ``configs`` but the last that still
    gives at least ``min_programs`` programs, else the last (BV 16). The scan is a chain of per-chunk
    steps, so at few sequences x heads splitting V is the only parallelism; with enough of them wider
    blocks do fewer, larger products. The thresholds (128 programs for the forward and backward scans,
    256 for the lighter state scan) come from ``bench/sweep_gdn2.py --shape`` (bench/NOTES.md)."""
    def pick(named: dict) -> triton.Config:
        size, v = int(named["SIZE"]), int(named["V"])
        # fp32 inputs (ieee products on the FMA units, a correctness path) keep the smallest tiles
        if named.get("DOT_PREC") != "ieee":
            for cfg in configs[:-1]:
                if size * triton.cdiv(v, cfg.kwargs["BV"]) >= min_programs:
                    return cfg
        return configs[-1]
    return pick


scan_config = scan_picker(128)
bwd_scan_config = scan_picker(128, BWD_SCAN_CONFIGS)
state_scan_config = scan_picker(256)


@triton.jit
def fwd_scan_chunk(y, u, kt, qg, aqk, gcl, o, r, b_h, scale, bos, eos, c0, i_t, i_h, o_t, o_k, m_k, o_v, m_v,
                   H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, SAVE_R: tl.constexpr,
                   DOT_PREC: tl.constexpr, BT: tl.constexpr):
    """One step of the forward scan: chunk i_t's o (and R with SAVE_R) from the state b_h at its start;
    returns the state at its end."""
    m_t, row0, i_c = scan_chunk(bos, eos, c0, i_t, i_h, H, BT)
    m_tk = m_t[:, None] & m_k[None, :]
    p_k = row0 * K + (o_t[:, None] * (H * K) + o_k[None, :])
    dt = y.dtype.element_ty
    b_y = tl.load(y + p_k, mask=m_tk, other=0.0)
    b_qg = tl.load(qg + p_k, mask=m_tk, other=0.0)
    b_ktt = load_rows_t(kt, row0, o_t, o_k, m_t, m_k, H, K)
    b_a = tl.load(aqk + row0 * BT + (o_t[:, None] * (H * BT) + o_t[None, :]), mask=m_t[:, None], other=0.0)
    p_v = row0 * V + (o_t[:, None] * (H * V) + o_v[None, :])
    m_tv = m_t[:, None] & m_v[None, :]
    b_u = tl.load(u + p_v, mask=m_tv, other=0.0).to(tl.float32)
    b_gl = tl.load(gcl + (i_c * H + i_h) * K + o_k, mask=m_k, other=0.0)

    b_hd = b_h.to(dt)
    b_r = b_u - tl.dot(b_y, b_hd, input_precision=DOT_PREC)
    b_rd = b_r.to(dt)
    if SAVE_R:
        tl.store(r + p_v, b_rd, mask=m_tv)
    b_o = tl.dot(b_qg, b_hd, input_precision=DOT_PREC) * scale + tl.dot(b_a, b_rd, input_precision=DOT_PREC)
    tl.store(o + p_v, b_o.to(o.dtype.element_ty), mask=m_tv)
    return b_h * b_gl[:, None] + tl.dot(b_ktt, b_rd, input_precision=DOT_PREC)


@tuned(SCAN_CONFIGS, key=["H", "K", "V", "SIZE", "SAVE_R"], clip={"BV": "VP"}, pick=scan_config)
@triton.jit(do_not_specialize=["T", "NT", "SIZE"])
def gdn2_fwd_scan_kernel(y, u, kt, qg, aqk, gcl, h0, o, r, ht, hseg, cu, chunk_off, scale, T, NT, SIZE,
                         H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, KP: tl.constexpr,
                         VP: tl.constexpr, IS_VARLEN: tl.constexpr, SAVE_R: tl.constexpr,
                         DOT_PREC: tl.constexpr, BT: tl.constexpr, SEG: tl.constexpr, BV: tl.constexpr):
    """Carry the state over the chunks of one sequence (one head, one value block); write o, and R
    (r [TT, H, V], input dtype) when SAVE_R (training: the backward rebuilds the states from it). With
    SAVE_R the state at the start of every global chunk i_c = j * SEG that lies inside a sequence (not at
    its start) also goes to hseg[j] (fp32 [NC / SEG, H, K, V]): the starting points of the backward's
    windowed state scan."""
    i_h, bos, eos, c0, o_k, m_k, o_v, m_v, p_s = scan_program(cu, chunk_off, T, NT, H, K, V, KP, IS_VARLEN, BV)
    o_t = tl.arange(0, BT)
    m_kv = m_k[:, None] & m_v[None, :]
    # h0 / ht always exist (zeros / a scratch buffer when not asked for): fewer kernel variants
    b_h = tl.load(h0 + p_s, mask=m_kv, other=0.0)
    n_t = tl.cdiv(eos - bos, BT)
    # the chunks in pieces that end where a window starts (local chunk `first`, then every SEG), so that
    # the window-start states are stored between the pieces, outside the pipelined loop
    if SAVE_R:
        first = SEG - c0 % SEG
    else:
        first = n_t
    n_pieces = 1 + tl.maximum(tl.cdiv(n_t - first, SEG), 0)
    for i_p in range(0, n_pieces):
        lo = tl.where(i_p > 0, first + (i_p - 1) * SEG, 0)
        if i_p > 0:
            store_chunk_state(hseg, (c0 + lo) // SEG, i_h, o_k, o_v, m_kv, b_h, H, K, V)
        for i_t in range(lo, tl.minimum(first + i_p * SEG, n_t)):
            b_h = fwd_scan_chunk(y, u, kt, qg, aqk, gcl, o, r, b_h, scale, bos, eos, c0, i_t, i_h, o_t, o_k, m_k,
                                 o_v, m_v, H, K, V, SAVE_R, DOT_PREC, BT)
    tl.store(ht + p_s, b_h, mask=m_kv)


@tuned(SCAN_CONFIGS, key=["H", "K", "V", "SIZE"], clip={"BV": "VP"}, pick=state_scan_config)
@triton.jit(do_not_specialize=["T", "NT", "NC", "SIZE"])
def gdn2_state_scan_kernel(kt, r, gcl, h0, hseg, hbuf, cu, chunk_info, T, NT, NC, SIZE,
                           H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, KP: tl.constexpr,
                           VP: tl.constexpr, IS_VARLEN: tl.constexpr, DOT_PREC: tl.constexpr,
                           BT: tl.constexpr, SEG: tl.constexpr, BV: tl.constexpr):
    """The states alone, from the R the training forward saved: S_C = Diag(gamma_C) S0 + Kt^T R, the
    state at every chunk start into hbuf ([NC, H, K, V], input dtype). Same products, in the same
    precision, as the forward scan's state update, without the output and R.

    Grid: (value blocks, windows * heads). A program walks the SEG global chunks of its window, not a
    whole sequence, so long sequences give as many programs as short ones: it starts from the initial
    state where a sequence starts (also inside the window) and from the forward's hseg where the window
    starts inside a sequence."""
    i_v = tl.program_id(0)
    i_w = tl.program_id(1) // H
    i_h = tl.program_id(1) % H
    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, KP)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    m_kv = m_k[:, None] & m_v[None, :]
    p_kv = o_k[:, None] * V + o_v[None, :]
    c_lo = i_w * SEG
    _, l_lo, _, _ = chunk_identity(c_lo, cu, chunk_info, T, NT, IS_VARLEN, BT)
    # read only where the window starts inside a sequence (hseg is a placeholder when none does)
    inside = (p_kv * 0 + l_lo) != 0
    b_h = tl.load(hseg + (i_w.to(tl.int64) * H + i_h) * K * V + p_kv, mask=m_kv & inside, other=0.0)
    for i_c in range(c_lo, tl.minimum(c_lo + SEG, NC)):
        i_n, i_l, t0, L = chunk_identity(i_c, cu, chunk_info, T, NT, IS_VARLEN, BT)
        if i_l == 0:
            b_h = tl.load(h0 + (i_n.to(tl.int64) * H + i_h) * K * V + p_kv, mask=m_kv, other=0.0)
        row0 = t0.to(tl.int64) * H + i_h
        m_t = o_t < L
        store_chunk_state(hbuf, i_c, i_h, o_k, o_v, m_kv, b_h, H, K, V)
        b_ktt = load_rows_t(kt, row0, o_t, o_k, m_t, m_k, H, K)
        b_r = tl.load(r + row0 * V + (o_t[:, None] * (H * V) + o_v[None, :]), mask=m_t[:, None] & m_v[None, :],
                      other=0.0)
        b_gl = tl.load(gcl + (i_c * H + i_h) * K + o_k, mask=m_k, other=0.0)
        b_h = b_h * b_gl[:, None] + tl.dot(b_ktt, b_r, input_precision=DOT_PREC)
