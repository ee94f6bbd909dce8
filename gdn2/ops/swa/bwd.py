"""Backward kernels of sliding-window flash attention (FA2 style).

``delta = rowsum(o * do)``; one dk/dv program per key block and KV head walks over the query blocks
that see it, for every query head of its group, and accumulates dk and dv in registers (so grouped
heads need no repeated K/V and no atomics). dq comes either from ds itself: the dk/dv pass stores each
ds tile (16-bit, as the products use it; TMA stores on Hopper) into a scratch of one [key block, window
+ key block] slab per head, and ``_swa_bwd_dq_ds_kernel`` multiplies it back with k (five products per
block pair, deterministic); or from ``_swa_bwd_dq_kernel``, which walks key blocks per query block,
recomputes ds and runs first, writing delta on the way (seven products). With TMA the streamed tiles
(q and do in the dk/dv kernel, k and v in the dq kernels) come through descriptors, as in the forward.
"""

from __future__ import annotations

import triton
import triton.language as tl

from gdn2.ops.swa.utils import key_bounds, load_pair, load_streamed, load_tile, query_block_program, query_tile, \
    sequence_of_block


@triton.jit
def _bwd_delta_kernel(O, DO, DELTA, T, H, D: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    pid = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    rows = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (rows < T)[:, None] & (offs_d < D)[None, :]
    off = (b * T + rows).to(tl.int64)[:, None] * (H * D) + h * D + offs_d[None, :]
    o = tl.load(O + off, mask=mask, other=0.0).to(tl.float32)
    do = tl.load(DO + off, mask=mask, other=0.0).to(tl.float32)
    tl.store(DELTA + (b * H + h).to(tl.int64) * T + rows, tl.sum(o * do, 1), mask=rows < T)


@triton.jit
def _query_bounds(n0, seq_len, WINDOW, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  HAS_WINDOW: tl.constexpr):
    # mirrors query_block_range()
    k_end = tl.minimum(n0 + BLOCK_N, seq_len)
    a = n0 + (tl.maximum(k_end - 1 - n0, 0) + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    if HAS_WINDOW:
        q_hi = tl.minimum(seq_len, k_end - 1 + WINDOW)
        last = tl.minimum(seq_len - BLOCK_M, n0 + WINDOW - BLOCK_M)
    else:
        q_hi = seq_len
        last = seq_len - BLOCK_M
    b = a + tl.maximum(last - a + BLOCK_M, 0) // BLOCK_M * BLOCK_M
    return a, b, q_hi


@triton.jit
def _dkdv_query_loop(dk, dv, k, v, q_base, do_base, q_desc, do_desc, row0, col0, lse_base, delta_base, ds_ptr,
                     ds_desc, ds_row, q_stride, offs_n, offs_m_tile, offs_d, mask_d, start, end, n0, seq_len,
                     WINDOW, Q_SPAN, qk_scale, BLOCK_M: tl.constexpr, MASKED: tl.constexpr,
                     HAS_WINDOW: tl.constexpr, EVEN_D: tl.constexpr, STORE_DS: tl.constexpr, DS_TMA: tl.constexpr,
                     PRECISION: tl.constexpr, WIDE: tl.constexpr, TMA: tl.constexpr):
    # transposed space: rows are keys, columns are queries, so dk and dv come out without transposes
    for m0 in range(start, end, BLOCK_M):
        rows = m0 + offs_m_tile
        # with TMA, query rows past the sequence carry other data: the mask below zeroes their p and ds
        q, do = load_pair(q_base, do_base, q_desc, do_desc, row0, col0, m0, rows, q_stride, offs_d, mask_d,
                          seq_len, MASKED, EVEN_D, WIDE, TMA)
        if MASKED:
            lse = tl.load(lse_base + rows, mask=rows < seq_len, other=0.0)
            delta = tl.load(delta_base + rows, mask=rows < seq_len, other=0.0)
        else:
            lse = tl.load(lse_base + rows)
            delta = tl.load(delta_base + rows)
        qk_t = tl.dot(k, tl.trans(q), input_precision=PRECISION) * qk_scale
        p_t = tl.math.exp2(qk_t - (lse * 1.4426950408889634)[None, :])
        if MASKED:
            keep = (rows[None, :] >= offs_n[:, None]) & (rows < seq_len)[None, :]
            if HAS_WINDOW:
                keep = keep & (rows[None, :] - offs_n[:, None] < WINDOW)
            p_t = tl.where(keep, p_t, 0.0)
        # dp first: Triton waits for a product whose result is used at once (and for every product
        # issued before it), while an accumulating one (dv, dk) stays in flight until the next such
        # wait, so dv issued after dp runs under the ds arithmetic and the store
        dp_t = tl.dot(v, tl.trans(do), input_precision=PRECISION)
        dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=PRECISION)
        ds_t = (p_t * (dp_t - delta[None, :])).to(q.dtype)
        dk = tl.dot(ds_t, q, dk, input_precision=PRECISION)
        if STORE_DS:
            # the key block's slab is key-major: row = key - n0, column = query - n0 (< Q_SPAN by the
            # loop bounds); masked pairs hold zeros. TMA stores from shared memory; the pointer store's
            # [BLOCK_N, BLOCK_M] 64-bit addresses cost registers
            if DS_TMA:
                ds_desc.store([ds_row, m0 - n0], ds_t)
            else:
                tl.store(ds_ptr + (offs_n - n0)[:, None] * Q_SPAN + (rows - n0)[None, :], ds_t)
    return dk, dv


@triton.jit
def _swa_bwd_dkdv_kernel(Q, K, V, DO, Q_DESC, DO_DESC, LSE, DELTA, DK, DV, DS, DS_DESC, CU, TABLE,
                         T, H, HKV, WINDOW, qk_scale, scale, NUM_BLOCKS, Q_SPAN, ROW0,
                         D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr, IS_VARLEN: tl.constexpr,
                         STORE_DS: tl.constexpr, DS_TMA: tl.constexpr, PRECISION: tl.constexpr,
                         WIDE: tl.constexpr, TMA: tl.constexpr):
    pid = tl.program_id(0)
    # a launch covers the (batch, KV head) rows ROW0 .. ROW0 + grid[1] - 1; DS holds their slabs
    bhk = tl.program_id(1) + ROW0
    b = bhk // HKV
    hk = bhk % HKV
    group = H // HKV
    bos, seq_len, n0 = sequence_of_block(CU, TABLE, pid, b, T, NUM_BLOCKS, IS_VARLEN, BLOCK_N, False)
    EVEN_D: tl.constexpr = BLOCK_D == D

    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_m_tile = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < D
    q_stride = H * D
    kv_stride = HKV * D
    kv_off = (bos + offs_n).to(tl.int64)[:, None] * kv_stride + hk * D + offs_d[None, :]
    k = load_tile(K + kv_off, offs_n, seq_len, mask_d, True, EVEN_D)
    v = load_tile(V + kv_off, offs_n, seq_len, mask_d, True, EVEN_D)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    a, b_int, q_hi = _query_bounds(n0, seq_len, WINDOW, BLOCK_M, BLOCK_N, HAS_WINDOW)
    diag_end = tl.minimum(a, q_hi)
    for g in range(group):
        h = hk * group + g
        q_base = Q + bos.to(tl.int64) * q_stride + h * D
        do_base = DO + bos.to(tl.int64) * q_stride + h * D
        lse_base = LSE + (b * H + h).to(tl.int64) * T + bos - b * T
        delta_base = DELTA + (b * H + h).to(tl.int64) * T + bos - b * T
        # one [BLOCK_N, Q_SPAN] slab per (query head, key block), in launch order
        # first row of this (query head, key block)'s slab in the [slabs * BLOCK_N, Q_SPAN] view of DS
        # (int32: ds_plan caps the launches)
        ds_row = ((tl.program_id(1) * group + g) * NUM_BLOCKS + pid) * BLOCK_N
        ds_ptr = DS + ds_row.to(tl.int64) * Q_SPAN  # the same slab for the pointer stores
        dk, dv = _dkdv_query_loop(dk, dv, k, v, q_base, do_base, Q_DESC, DO_DESC, bos, h * D, lse_base, delta_base,
                                  ds_ptr, DS_DESC, ds_row, q_stride, offs_n, offs_m_tile, offs_d, mask_d, n0,
                                  diag_end, n0, seq_len, WINDOW, Q_SPAN, qk_scale, BLOCK_M, True, HAS_WINDOW,
                                  EVEN_D, STORE_DS, DS_TMA, PRECISION, WIDE, TMA)
        dk, dv = _dkdv_query_loop(dk, dv, k, v, q_base, do_base, Q_DESC, DO_DESC, bos, h * D, lse_base, delta_base,
                                  ds_ptr, DS_DESC, ds_row, q_stride, offs_n, offs_m_tile, offs_d, mask_d, a,
                                  b_int, n0, seq_len, WINDOW, Q_SPAN, qk_scale, BLOCK_M, False, HAS_WINDOW,
                                  EVEN_D, STORE_DS, DS_TMA, PRECISION, WIDE, TMA)
        dk, dv = _dkdv_query_loop(dk, dv, k, v, q_base, do_base, Q_DESC, DO_DESC, bos, h * D, lse_base, delta_base,
                                  ds_ptr, DS_DESC, ds_row, q_stride, offs_n, offs_m_tile, offs_d, mask_d, b_int,
                                  q_hi, n0, seq_len, WINDOW, Q_SPAN, qk_scale, BLOCK_M, True, HAS_WINDOW,
                                  EVEN_D, STORE_DS, DS_TMA, PRECISION, WIDE, TMA)
    # offsets recomputed here rather than kept live (in registers) across the loops
    kv_off = (bos + offs_n).to(tl.int64)[:, None] * kv_stride + hk * D + offs_d[None, :]
    st_mask = (offs_n < seq_len)[:, None] & mask_d[None, :]
    tl.store(DK + kv_off, (dk * scale).to(DK.dtype.element_ty), mask=st_mask)
    tl.store(DV + kv_off, dv.to(DV.dtype.element_ty), mask=st_mask)


@triton.jit
def _dq_key_loop(dq, q, do, lse2, delta, k_base, v_base, k_desc, v_desc, row0, col0, kv_stride, offs_m,
                 offs_n, offs_d, mask_d, start, end, seq_len, WINDOW, qk_scale,
                 BLOCK_N: tl.constexpr, MASKED: tl.constexpr, HAS_WINDOW: tl.constexpr,
                 EVEN_D: tl.constexpr, PRECISION: tl.constexpr, WIDE: tl.constexpr, TMA: tl.constexpr):
    for n0 in range(start, end, BLOCK_N):
        cols = n0 + offs_n
        # with TMA, keys past the sequence: p is masked to zero, so ds is too
        k, v = load_pair(k_base, v_base, k_desc, v_desc, row0, col0, n0, cols, kv_stride, offs_d, mask_d,
                          seq_len, MASKED, EVEN_D, WIDE, TMA)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        p = tl.math.exp2(s - lse2[:, None])
        if MASKED:
            keep = cols[None, :] <= offs_m[:, None]
            if HAS_WINDOW:
                keep = keep & (offs_m[:, None] - cols[None, :] < WINDOW)
            p = tl.where(keep, p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
        ds = (p * (dp - delta[:, None])).to(k.dtype)
        dq = tl.dot(ds, k, dq, input_precision=PRECISION)
    return dq


@triton.jit
def _swa_bwd_dq_kernel(Q, K, V, K_DESC, V_DESC, O, DO, LSE, DELTA, DQ, CU, TABLE, T, H, HKV, WINDOW,
                       qk_scale, scale, NUM_BLOCKS, D: tl.constexpr, BLOCK_D: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr,
                       IS_VARLEN: tl.constexpr, PRECISION: tl.constexpr, WIDE: tl.constexpr,
                       TMA: tl.constexpr):
    pid = tl.program_id(0)
    bh = tl.program_id(1)
    b, h, hk, bos, seq_len, m0 = query_block_program(CU, TABLE, pid, bh, T, H, HKV, NUM_BLOCKS, IS_VARLEN, BLOCK_M)
    EVEN_D: tl.constexpr = BLOCK_D == D

    offs_m, offs_n, offs_d, mask_d, kv_stride, k_base = query_tile(K, bos, hk, m0, HKV, D, BLOCK_M, BLOCK_N,
                                                                    BLOCK_D)
    q_stride = H * D
    row_ok = offs_m < seq_len
    q_off = (bos + offs_m).to(tl.int64)[:, None] * q_stride + h * D + offs_d[None, :]
    q = load_tile(Q + q_off, offs_m, seq_len, mask_d, True, EVEN_D)
    do = load_tile(DO + q_off, offs_m, seq_len, mask_d, True, EVEN_D)
    stat_base = (b * H + h).to(tl.int64) * T + bos - b * T
    lse2 = tl.load(LSE + stat_base + offs_m, mask=row_ok, other=0.0) * 1.4426950408889634
    # delta = rowsum(o * do) is made here (this kernel runs first) and stored for the dk/dv kernel,
    # which saves a separate pass over o and do
    o = load_tile(O + q_off, offs_m, seq_len, mask_d, True, EVEN_D)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(DELTA + stat_base + offs_m, delta, mask=row_ok)
    v_base = V + bos.to(tl.int64) * kv_stride + hk * D

    lo, a, b_int, hi = key_bounds(m0, seq_len, WINDOW, BLOCK_M, BLOCK_N, HAS_WINDOW)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    dq = _dq_key_loop(dq, q, do, lse2, delta, k_base, v_base, K_DESC, V_DESC, bos, hk * D, kv_stride,
                      offs_m, offs_n, offs_d, mask_d, lo, a, seq_len, WINDOW, qk_scale, BLOCK_N, True,
                      HAS_WINDOW, EVEN_D, PRECISION, WIDE, TMA)
    dq = _dq_key_loop(dq, q, do, lse2, delta, k_base, v_base, K_DESC, V_DESC, bos, hk * D, kv_stride,
                      offs_m, offs_n, offs_d, mask_d, a, b_int, seq_len, WINDOW, qk_scale, BLOCK_N, False,
                      HAS_WINDOW, EVEN_D, PRECISION, WIDE, TMA)
    dq = _dq_key_loop(dq, q, do, lse2, delta, k_base, v_base, K_DESC, V_DESC, bos, hk * D, kv_stride,
                      offs_m, offs_n, offs_d, mask_d, b_int, hi, seq_len, WINDOW, qk_scale, BLOCK_N, True,
                      HAS_WINDOW, EVEN_D, PRECISION, WIDE, TMA)
    q_off = (bos + offs_m).to(tl.int64)[:, None] * q_stride + h * D + offs_d[None, :]
    tl.store(DQ + q_off, (dq * scale).to(DQ.dtype.element_ty), mask=row_ok[:, None] & mask_d[None, :])


@triton.jit
def _dq_ds_key_loop(dq, ds_ptr, ds_desc, slab0, kb0, k_base, k_desc, row0, col0, kv_stride, offs_m, offs_n,
                    offs_d, mask_d, m0, start, end, seq_len, WINDOW, Q_SPAN, BLOCK_N: tl.constexpr,
                    MASKED: tl.constexpr, HAS_WINDOW: tl.constexpr, EVEN_D: tl.constexpr,
                    PRECISION: tl.constexpr, WIDE: tl.constexpr, TMA: tl.constexpr, DS_TMA: tl.constexpr):
    row_ok = offs_m < seq_len
    for n0 in range(start, end, BLOCK_N):
        cols = n0 + offs_n
        # ds^T tile [keys, queries] of slab kb0 + n0 / BLOCK_N. The dk/dv pass wrote every visible
        # pair and only those count: the rest of a slab is uninitialised, so masked blocks select
        # the visible pairs, and in an unmasked block (visible to every query row below seq_len) rows
        # past seq_len only reach dq rows that are never stored.
        if MASKED:
            keep = (cols[:, None] <= offs_m[None, :]) & row_ok[None, :]
            if HAS_WINDOW:
                keep = keep & (offs_m[None, :] - cols[:, None] < WINDOW)
        ds_row = (slab0 + kb0 + n0 // BLOCK_N) * BLOCK_N  # the key block's slab, as the dk/dv pass wrote it
        if DS_TMA:  # columns outside [0, Q_SPAN) (a diagonal block's first rows) load as zeros
            ds_t = ds_desc.load([ds_row, m0 - n0])
            if MASKED:
                ds_t = tl.where(keep, ds_t, 0.0)
        else:
            ptrs = ds_ptr + ds_row.to(tl.int64) * Q_SPAN + (offs_n[:, None] * Q_SPAN + (offs_m - n0)[None, :])
            if MASKED:
                ds_t = tl.load(ptrs, mask=keep, other=0.0)
            else:
                ds_t = tl.load(ptrs, mask=row_ok[None, :], other=0.0)
        k = load_streamed(k_base, k_desc, row0, col0, n0, cols, kv_stride, offs_d, mask_d, seq_len, MASKED,
                           EVEN_D, WIDE, TMA)
        dq = tl.dot(tl.trans(ds_t), k, dq, input_precision=PRECISION)
    return dq


@triton.jit
def _swa_bwd_dq_ds_kernel(DS, DS_DESC, K, K_DESC, DQ, CU, TABLE, KB_START, T, H, HKV, WINDOW, scale,
                          NUM_BLOCKS, NUM_SLABS, Q_SPAN, ROW0, D: tl.constexpr, BLOCK_D: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr,
                          IS_VARLEN: tl.constexpr, PRECISION: tl.constexpr, WIDE: tl.constexpr,
                          TMA: tl.constexpr, DS_TMA: tl.constexpr):
    """dq = scale * ds k from the slabs the dk/dv pass stored (BLOCK_N = its key block)."""
    pid = tl.program_id(0)
    # a launch covers the (batch, query head) rows ROW0 .. ROW0 + grid[1] - 1
    bh = tl.program_id(1) + ROW0
    b, h, hk, bos, seq_len, m0 = query_block_program(CU, TABLE, pid, bh, T, H, HKV, NUM_BLOCKS, IS_VARLEN, BLOCK_M)
    if IS_VARLEN:  # the dk/dv launch's program (= slab) of the sequence's first key block
        kb0 = tl.load(KB_START + tl.maximum(tl.load(TABLE + 2 * pid), 0))
    else:
        kb0 = 0 * pid
    EVEN_D: tl.constexpr = BLOCK_D == D

    offs_m, offs_n, offs_d, mask_d, kv_stride, k_base = query_tile(K, bos, hk, m0, HKV, D, BLOCK_M, BLOCK_N,
                                                                    BLOCK_D)
    slab0 = tl.program_id(1) * NUM_SLABS

    lo, a, b_int, hi = key_bounds(m0, seq_len, WINDOW, BLOCK_M, BLOCK_N, HAS_WINDOW)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    dq = _dq_ds_key_loop(dq, DS, DS_DESC, slab0, kb0, k_base, K_DESC, bos, hk * D, kv_stride, offs_m,
                         offs_n, offs_d, mask_d, m0, lo, a, seq_len, WINDOW, Q_SPAN, BLOCK_N, True,
                         HAS_WINDOW, EVEN_D, PRECISION, WIDE, TMA, DS_TMA)
    dq = _dq_ds_key_loop(dq, DS, DS_DESC, slab0, kb0, k_base, K_DESC, bos, hk * D, kv_stride, offs_m,
                         offs_n, offs_d, mask_d, m0, a, b_int, seq_len, WINDOW, Q_SPAN, BLOCK_N, False,
                         HAS_WINDOW, EVEN_D, PRECISION, WIDE, TMA, DS_TMA)
    dq = _dq_ds_key_loop(dq, DS, DS_DESC, slab0, kb0, k_base, K_DESC, bos, hk * D, kv_stride, offs_m,
                         offs_n, offs_d, mask_d, m0, b_int, hi, seq_len, WINDOW, Q_SPAN, BLOCK_N, True,
                         HAS_WINDOW, EVEN_D, PRECISION, WIDE, TMA, DS_TMA)
    q_stride = H * D
    q_off = (bos + offs_m).to(tl.int64)[:, None] * q_stride + h * D + offs_d[None, :]
    tl.store(DQ + q_off, (dq * scale).to(DQ.dtype.element_ty),
             mask=(offs_m < seq_len)[:, None] & mask_d[None, :])
