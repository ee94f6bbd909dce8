"""Forward kernel of sliding-window flash attention.

Online softmax over the key blocks a query block can see, never a T x T matrix, in three loops (masked
left edge, unmasked interior, masked right edge; see ``utils``). The forward stores the log-sum-exp
(fp32, natural log) for the backward. With TMA the k and v tiles come through descriptors over the
[B*T, H*D] view; a tile that runs past its sequence holds the next sequence's rows (or zeros at the
tensor's end), which only the masked edge loops reach, and their score masks zero every product with
them.
"""

from __future__ import annotations

import triton
import triton.language as tl

from gdn2.ops.swa.utils import key_bounds, load_pair, load_tile, query_block_program, query_tile


@triton.jit
def _fwd_key_loop(acc, l_i, m_i, q, k_base, v_base, k_desc, v_desc, row0, col0, kv_stride,
                  offs_m, offs_n, offs_d, mask_d, start, end, seq_len, WINDOW, qk_scale,
                  BLOCK_N: tl.constexpr, MASKED: tl.constexpr, HAS_WINDOW: tl.constexpr,
                  EVEN_D: tl.constexpr, PRECISION: tl.constexpr, WIDE: tl.constexpr, TMA: tl.constexpr):
    for n0 in range(start, end, BLOCK_N):
        cols = n0 + offs_n
        # with TMA, keys past the sequence reach only masked blocks, and the causal mask drops them
        # for every stored query row
        k, v = load_pair(k_base, v_base, k_desc, v_desc, row0, col0, n0, cols, kv_stride, offs_d, mask_d,
                         seq_len, MASKED, EVEN_D, WIDE, TMA)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        if MASKED:
            keep = cols[None, :] <= offs_m[:, None]
            if HAS_WINDOW:
                keep = keep & (offs_m[:, None] - cols[None, :] < WINDOW)
            s = tl.where(keep, s, float("-inf"))
        # raw scores: the row max scales afterwards (qk_scale > 0) and the exponent is one FMA
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        p = tl.math.exp2(s * qk_scale - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _swa_fwd_kernel(Q, K, V, K_DESC, V_DESC, O, LSE, CU, TABLE, T, H, HKV, WINDOW, qk_scale,
                    NUM_BLOCKS, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr, IS_VARLEN: tl.constexpr,
                    PRECISION: tl.constexpr, WIDE: tl.constexpr, TMA: tl.constexpr):
    pid = tl.program_id(0)
    bh = tl.program_id(1)
    b, h, hk, bos, seq_len, m0 = query_block_program(CU, TABLE, pid, bh, T, H, HKV, NUM_BLOCKS, IS_VARLEN, BLOCK_M)
    EVEN_D: tl.constexpr = BLOCK_D == D

    offs_m, offs_n, offs_d, mask_d, kv_stride, k_base = query_tile(K, bos, hk, m0, HKV, D, BLOCK_M, BLOCK_N,
                                                                   BLOCK_D)
    q_stride = H * D
    q_ptrs = Q + (bos + offs_m).to(tl.int64)[:, None] * q_stride + h * D + offs_d[None, :]
    q = load_tile(q_ptrs, offs_m, seq_len, mask_d, True, EVEN_D)
    v_base = V + bos.to(tl.int64) * kv_stride + hk * D

    lo, a, b_int, hi = key_bounds(m0, seq_len, WINDOW, BLOCK_M, BLOCK_N, HAS_WINDOW)
    # a finite floor keeps fully masked rows of an edge block NaN-free (exp2(-inf - -1e30) = 0)
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    acc, l_i, m_i = _fwd_key_loop(acc, l_i, m_i, q, k_base, v_base, K_DESC, V_DESC, bos, hk * D, kv_stride,
                                  offs_m, offs_n, offs_d, mask_d, lo, a, seq_len, WINDOW, qk_scale, BLOCK_N,
                                  True, HAS_WINDOW, EVEN_D, PRECISION, WIDE, TMA)
    acc, l_i, m_i = _fwd_key_loop(acc, l_i, m_i, q, k_base, v_base, K_DESC, V_DESC, bos, hk * D, kv_stride,
                                  offs_m, offs_n, offs_d, mask_d, a, b_int, seq_len, WINDOW, qk_scale, BLOCK_N,
                                  False, HAS_WINDOW, EVEN_D, PRECISION, WIDE, TMA)
    acc, l_i, m_i = _fwd_key_loop(acc, l_i, m_i, q, k_base, v_base, K_DESC, V_DESC, bos, hk * D, kv_stride,
                                  offs_m, offs_n, offs_d, mask_d, b_int, hi, seq_len, WINDOW, qk_scale, BLOCK_N,
                                  True, HAS_WINDOW, EVEN_D, PRECISION, WIDE, TMA)
    row_ok = offs_m < seq_len
    l_safe = tl.where(row_ok, l_i, 1.0)
    o = acc / l_safe[:, None]
    o_ptrs = O + (bos + offs_m).to(tl.int64)[:, None] * q_stride + h * D + offs_d[None, :]
    tl.store(o_ptrs, o.to(O.dtype.element_ty), mask=row_ok[:, None] & mask_d[None, :])
    lse = (m_i + tl.math.log2(l_safe)) * 0.6931471805599453
    lse_base = LSE + (b * H + h).to(tl.int64) * T + bos - b * T
    tl.store(lse_base + offs_m, lse, mask=row_ok)
