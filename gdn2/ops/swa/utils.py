"""What the sliding-window attention kernels share: the block a program works on, tile loads (pointer or
TMA), the key-loop bounds, and the Python twins of the in-kernel loop bounds (tests, reasoning).

Every loop bound is computed per block from the window, so the work grows as T x W. The key range of a
query block splits into three loops: a masked left edge (window boundary), an unmasked interior, and a
masked right edge (the causal diagonal); the query range of a key block likewise.
"""

from __future__ import annotations

from typing import Optional

import triton
import triton.language as tl


# --------------------------------------------------------------------------------------------------
# Loop bounds (the Python twins of the in-kernel arithmetic)
# --------------------------------------------------------------------------------------------------

def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def key_block_range(q_start: int, seq_len: int, window: Optional[int], block_m: int,
                    block_n: int) -> tuple[int, int, int, int]:
    """Key loop bounds of the query block starting at ``q_start`` (forward and dq kernels).

    Returns ``(lo, a, b, hi)``: masked key blocks start at ``lo, lo+block_n, ... < a``, unmasked ones
    at ``a, ... < b``, masked ones again at ``b, ... < hi``. Positions are local to the sequence.
    """
    hi = min(q_start + block_m, seq_len)
    if window is None:
        lo, full_lo = 0, 0
    else:
        lo = max(q_start - window + 1, 0) // block_n * block_n
        full_lo = cdiv(max(hi - window, 0), block_n) * block_n
    full_hi = min((q_start + 1) // block_n * block_n, hi)
    a = full_lo
    b = max(a, full_hi)
    return lo, a, b, hi


def query_block_range(k_start: int, seq_len: int, window: Optional[int], block_m: int,
                      block_n: int) -> tuple[int, int, int, int]:
    """Query loop bounds of the key block starting at ``k_start`` (dk/dv kernel).

    Returns ``(lo, a, b, hi)``: masked query blocks at ``lo, lo+block_m, ... < min(a, hi)``, unmasked
    at ``a, ... < b``, masked at ``b, ... < hi``.
    """
    k_end = min(k_start + block_n, seq_len)
    q_hi = seq_len if window is None else min(seq_len, k_end - 1 + window)
    a = k_start + cdiv(max(k_end - 1 - k_start, 0), block_m) * block_m
    last = seq_len - block_m if window is None else min(seq_len - block_m, k_start + window - block_m)
    b = a + max(last - a + block_m, 0) // block_m * block_m
    return k_start, a, b, q_hi


def _range_len(start: int, end: int, step: int) -> int:
    return max(0, cdiv(end - start, step))


def count_key_blocks(q_start, seq_len, window, block_m, block_n) -> int:
    lo, a, b, hi = key_block_range(q_start, seq_len, window, block_m, block_n)
    return _range_len(lo, a, block_n) + _range_len(a, b, block_n) + _range_len(b, hi, block_n)


def count_query_blocks(k_start, seq_len, window, block_m, block_n) -> int:
    lo, a, b, hi = query_block_range(k_start, seq_len, window, block_m, block_n)
    return _range_len(lo, min(a, hi), block_m) + _range_len(a, b, block_m) + _range_len(b, hi, block_m)


# --------------------------------------------------------------------------------------------------
# Shared in-kernel helpers
# --------------------------------------------------------------------------------------------------

@triton.jit
def sequence_of_block(CU, TABLE, pid, b, T, NUM_BLOCKS, IS_VARLEN: tl.constexpr, BLOCK: tl.constexpr,
                       LATE_FIRST: tl.constexpr):
    """(first token row of the sequence, its length, local start of this program's block)."""
    if IS_VARLEN:
        seq = tl.load(TABLE + 2 * pid)
        blk = tl.load(TABLE + 2 * pid + 1)
        valid = seq >= 0
        seq = tl.maximum(seq, 0)
        bos = tl.load(CU + seq).to(tl.int32)
        eos = tl.load(CU + seq + 1).to(tl.int32)
        # spare programs (the grid is an upper bound on the block count) get an empty sequence
        seq_len = tl.where(valid, eos - bos, 0)
        start = blk * BLOCK
    else:
        bos = b * T
        seq_len = T + 0 * pid
        # heaviest blocks first shortens the tail: late query blocks see the most keys, early key
        # blocks are seen by the most queries
        if LATE_FIRST:
            start = (NUM_BLOCKS - 1 - pid) * BLOCK
        else:
            start = pid * BLOCK
    return bos, seq_len, start


@triton.jit
def query_block_program(CU, TABLE, pid, bh, T, H, HKV, NUM_BLOCKS, IS_VARLEN: tl.constexpr,
                         BLOCK_M: tl.constexpr):
    """(batch, query head, KV head, first token row of the sequence, its length, local start of the query
    block) of a program of the forward and dq kernels: query blocks x (batch, query head) rows, heaviest
    blocks first."""
    b = bh // H
    h = bh % H
    hk = h // (H // HKV)
    bos, seq_len, m0 = sequence_of_block(CU, TABLE, pid, b, T, NUM_BLOCKS, IS_VARLEN, BLOCK_M, True)
    return b, h, hk, bos, seq_len, m0


@triton.jit
def query_tile(K, bos, hk, m0, HKV, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_D: tl.constexpr):
    """Row / key / channel offsets, the channel mask, the k row stride and this program's k base of the
    forward and dq kernels."""
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < D
    kv_stride = HKV * D
    k_base = K + bos.to(tl.int64) * kv_stride + hk * D
    return offs_m, offs_n, offs_d, mask_d, kv_stride, k_base


@triton.jit
def tile_offsets(rows, stride, offs_d, WIDE: tl.constexpr):
    # offsets relative to a 64-bit base pointer: 32-bit unless one sequence row spans 2^31 elements
    # (64-bit per-element offsets cost registers the backward does not have)
    if WIDE:
        r = rows.to(tl.int64)
    else:
        r = rows
    return r[:, None] * stride + offs_d[None, :]


@triton.jit
def load_tile(ptrs, rows, seq_len, mask_d, CHECK_ROWS: tl.constexpr, EVEN_D: tl.constexpr):
    if CHECK_ROWS:
        if EVEN_D:
            x = tl.load(ptrs, mask=(rows < seq_len)[:, None], other=0.0)
        else:
            x = tl.load(ptrs, mask=(rows < seq_len)[:, None] & mask_d[None, :], other=0.0)
    else:
        if EVEN_D:
            x = tl.load(ptrs)
        else:
            x = tl.load(ptrs, mask=mask_d[None, :], other=0.0)
    return x


@triton.jit
def load_streamed(base, desc, row0, col0, first, rows, stride, offs_d, mask_d, seq_len,
                   MASKED: tl.constexpr, EVEN_D: tl.constexpr, WIDE: tl.constexpr, TMA: tl.constexpr):
    """One streamed tile at sequence rows ``rows`` (= first + arange)."""
    if TMA:
        x = desc.load([row0 + first, col0])
    else:
        x = load_tile(base + tile_offsets(rows, stride, offs_d, WIDE), rows, seq_len, mask_d, MASKED, EVEN_D)
    return x


@triton.jit
def load_pair(a_base, b_base, a_desc, b_desc, row0, col0, first, rows, stride, offs_d, mask_d, seq_len,
               MASKED: tl.constexpr, EVEN_D: tl.constexpr, WIDE: tl.constexpr, TMA: tl.constexpr):
    """The two tiles a loop step streams (k and v, or q and do) at sequence rows ``rows`` (= first +
    arange): through their TMA descriptors, where rows past the sequence hold the next sequence's data
    (or zeros) and the caller's masks must drop them, or by pointer loads, zeros there."""
    a = load_streamed(a_base, a_desc, row0, col0, first, rows, stride, offs_d, mask_d, seq_len, MASKED, EVEN_D,
                       WIDE, TMA)
    b = load_streamed(b_base, b_desc, row0, col0, first, rows, stride, offs_d, mask_d, seq_len, MASKED, EVEN_D,
                       WIDE, TMA)
    return a, b


@triton.jit
def key_bounds(m0, seq_len, WINDOW, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                HAS_WINDOW: tl.constexpr):
    # mirrors key_block_range()
    hi = tl.minimum(m0 + BLOCK_M, seq_len)
    if HAS_WINDOW:
        lo = tl.maximum(m0 - WINDOW + 1, 0) // BLOCK_N * BLOCK_N
        a = (tl.maximum(hi - WINDOW, 0) + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    else:
        lo = 0 * m0
        a = 0 * m0
    # capped by hi so that an empty sequence (spare varlen program) gets empty loops
    full_hi = tl.minimum((m0 + 1) // BLOCK_N * BLOCK_N, hi)
    b = tl.maximum(a, full_hi)
    return lo, a, b, hi
