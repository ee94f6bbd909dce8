"""Triton sliding-window flash attention: forward and backward.

Layout ``[B, T, H, D]`` for q, ``[B, T, Hkv, D]`` for k and v (H a multiple of Hkv). Query ``i`` sees
keys ``j`` with ``i - window < j <= i``; ``window=None`` is full causal attention. ``cu_seqlens``
(B == 1) packs several sequences into one row, each attended separately.

Forward: online softmax over the key blocks a query block can see, never a T x T matrix. Every loop
bound is computed per block from the window, so the work grows as T x W. The key range of a query
block splits into three loops: a masked left edge (window boundary), an unmasked interior, and a
masked right edge (the causal diagonal). The forward stores the log-sum-exp (fp32, natural log) for
the backward.

Backward (FA2 style): ``delta = rowsum(o * do)``; one program per key block and KV head walks over
the query blocks that see it, for every query head of its group, and accumulates dk and dv in
registers (so grouped heads need no repeated K/V and no atomics for dk/dv). dq comes, by default,
from ds itself: the dk/dv pass stores each ds tile (16-bit, as the products use it; TMA stores on
Hopper) into a scratch of one [key block, window + key block] slab per head, and a second kernel
multiplies it back with k (five products per block pair, deterministic; the scratch is bounded by
``GDN2_SWA_DS_SCRATCH_MB``, and the heads run in groups that fit). Otherwise (fp32 inputs on a GPU,
or a head whose slabs alone exceed the bound) dq comes from a kernel that walks key blocks per query
block and runs first, writing delta on the way (seven products), or, as an option, from the dk/dv
pass itself through fp32 atomic adds (slower on an H200).

On Hopper the tiles a loop streams (k and v in the forward and dq kernels, q and do in the dk/dv
kernel) can come through TMA descriptors over the [B*T, H*D] view (``FwdConfig.tma``,
``BwdConfig.dq_tma`` / ``tma``). A TMA tile that runs past its sequence holds the next sequence's
rows (or zeros at the tensor's end) instead of masked-load zeros; only the masked edge loops reach
such rows, and their score masks zero every product with them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Optional

import torch
import triton
import triton.language as tl

try:  # host-side TMA descriptors (triton >= 3.4)
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover
    TensorDescriptor = None

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453

__all__ = [
    "FwdConfig", "BwdConfig", "sliding_window_attention_triton", "swa_forward", "swa_backward",
    "swa_backward_dq", "swa_backward_dkdv", "ds_plan", "ds_scratch_limit",
    "key_block_range", "query_block_range", "default_configs",
]


# --------------------------------------------------------------------------------------------------
# Configurations
# --------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class FwdConfig:
    """Tile shape of the forward kernel: BLOCK_M queries x BLOCK_N keys per step; ``tma``: k and v
    tiles come through Hopper TMA descriptors (falls back to pointer loads where TMA cannot be used)."""
    block_m: int = 128
    block_n: int = 64
    num_warps: int = 8
    num_stages: int = 3
    tma: bool = False


@dataclass(frozen=True)
class BwdConfig:
    """Tile shapes of the backward.

    ``block_n`` keys per dk/dv program, stepping over ``block_m`` queries at a time. With
    ``atomic_dq`` the same pass adds dq into an fp32 buffer (``dq_transposed``: computed as
    k^T ds^T, for small ``block_m``); otherwise a second kernel computes dq with ``dq_block_m``
    queries per program stepping over ``dq_block_n`` keys. ``tma`` / ``dq_tma``: the streamed tiles
    (q and do in the dk/dv kernel, k and v in the dq kernel) come through Hopper TMA descriptors.

    ``dq_from_ds``: the dk/dv pass also stores ds (in the inputs' dtype, as the products use it) into
    a scratch buffer, and dq comes from a kernel of one product per block, ds k, that reads it back
    (``ds_block_m`` queries per program, ``ds_num_warps``, ``ds_num_stages``, stepping over the dk/dv
    kernel's ``block_n`` keys; ``dq_tma``: ds and k tiles through TMA): five products per block pair
    instead of seven, for ~2 bytes per visible (query, key) pair written and read. The scratch is
    bounded by ``GDN2_SWA_DS_SCRATCH_MB`` (the backward then runs in groups of heads that fit it);
    where one head alone does not fit (long full-causal rows), the recomputing dq kernel runs.
    """
    block_m: int = 32
    block_n: int = 128
    num_warps: int = 8
    num_stages: int = 3
    atomic_dq: bool = False
    dq_block_m: int = 128
    dq_block_n: int = 64
    dq_num_warps: int = 8
    dq_num_stages: int = 3
    dq_transposed: bool = False
    tma: bool = False
    dq_tma: bool = False
    dq_from_ds: bool = False
    ds_block_m: int = 128
    ds_num_warps: int = 4
    ds_num_stages: int = 3


def _interpreted(device: torch.device) -> bool:
    return device.type != "cuda" or os.environ.get("TRITON_INTERPRET", "0") == "1"


def default_configs(head_dim: int, device: torch.device,
                    dtype: torch.dtype = torch.bfloat16) -> tuple[FwdConfig, BwdConfig]:
    """The tile shapes used when none are given: small tiles under the interpreter (fast on CPU),
    Hopper-sized tiles on CUDA, shrinking as the head dim grows so that accumulators fit registers.

    D = 128 is the measured one (bench/ops_swa.py sweep on an H200); the others are scaled from it.
    The tiles are sized for 16-bit inputs; for wider ones (fp32) the streamed tiles shrink until the
    pipelined buffers fit the shared memory (see ``fit_shared_memory``).
    """
    if _interpreted(device):
        return (FwdConfig(32, 16, 4, 1),
                BwdConfig(16, 32, 4, 1, False, 32, 16, 4, 1, dq_from_ds=True, ds_block_m=32, ds_num_stages=1))
    if head_dim <= 64:
        return fit_shared_memory(FwdConfig(128, 64, 4, 3),
                                 BwdConfig(32, 128, 8, 3, False, 128, 64, 8, 3), head_dim, dtype)
    if head_dim <= 128:
        # dk/dv: 64-key programs of one warp group stepping over 32 queries keep dk, dv (64 x 128 fp32
        # each) and the two 64 x 32 score tiles in registers, and two programs share an SM, so one's
        # products overlap the other's exponentials: 2.35 -> 2.07 ms at B8 T4096 against 128-key
        # programs of two warp groups (larger query steps spill; the atomic-dq variant ran 15% slower,
        # so dq has its own kernel). TMA loads (per-kernel sweeps, bench/NOTES.md): forward 128 x 128
        # tiles in 3 stages -7%, dq kernel -4%, dk/dv kernel 2.28 -> 2.07 ms. dq from the stored ds
        # (128-query programs of one warp group, 3 stages): forward + backward 4.44 -> 4.09 ms at
        # B8 T4096, 5.42 -> 5.08 ms at B2 T16384 (the dk/dv pass pays ~0.3 ms for the stores).
        return fit_shared_memory(FwdConfig(128, 128, 8, 3, tma=True),
                                 BwdConfig(32, 64, 4, 3, False, 128, 64, 8, 3, tma=True, dq_tma=True,
                                           dq_from_ds=True, ds_block_m=128, ds_num_warps=4, ds_num_stages=3),
                                 head_dim, dtype)
    return fit_shared_memory(FwdConfig(64, 64, 8, 2),
                             BwdConfig(32, 64, 4, 1, False, 64, 32, 4, 1), head_dim, dtype)


# Pipelined buffers per program: the streamed tiles (two of them: k and v, or q and do) times the
# stages. Hopper has 227 KB per block; the rest is left for the compiler's own scratch.
SHARED_MEMORY_BUDGET = 200 * 1024


def streamed_bytes(rows: int, stages: int, head_dim: int, itemsize: int) -> int:
    return 2 * rows * head_dim * itemsize * max(stages, 1)


def fit_shared_memory(fwd: FwdConfig, bwd: BwdConfig, head_dim: int,
                      dtype: torch.dtype) -> tuple[FwdConfig, BwdConfig]:
    """Halve each kernel's streamed tile (forward and dq: keys; dk/dv: queries) until its pipelined
    buffers fit ``SHARED_MEMORY_BUDGET`` for this dtype (fp32 doubles them: a 128 x 128 x 3-stage
    forward needs 384 KB). 16-bit inputs at the measured tile shapes are left as they are."""
    size = torch.empty((), dtype=dtype).element_size()

    def shrink(rows, stages):
        while rows > 16 and streamed_bytes(rows, stages, head_dim, size) > SHARED_MEMORY_BUDGET:
            rows //= 2
        return rows

    fwd = replace(fwd, block_n=shrink(fwd.block_n, fwd.num_stages))
    bwd = replace(bwd, block_m=shrink(bwd.block_m, bwd.num_stages),
                  dq_block_n=shrink(bwd.dq_block_n, bwd.dq_num_stages))
    if size > 2:  # TMA was measured with 16-bit tiles only; wider inputs keep the pointer loads
        fwd, bwd = replace(fwd, tma=False), replace(bwd, tma=False, dq_tma=False)
    return fwd, bwd


# --------------------------------------------------------------------------------------------------
# Loop bounds (the Python twins of the in-kernel arithmetic, for tests and for reasoning)
# --------------------------------------------------------------------------------------------------

def _cdiv(a: int, b: int) -> int:
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
        full_lo = _cdiv(max(hi - window, 0), block_n) * block_n
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
    a = k_start + _cdiv(max(k_end - 1 - k_start, 0), block_m) * block_m
    last = seq_len - block_m if window is None else min(seq_len - block_m, k_start + window - block_m)
    b = a + max(last - a + block_m, 0) // block_m * block_m
    return k_start, a, b, q_hi


def _range_len(start: int, end: int, step: int) -> int:
    return max(0, _cdiv(end - start, step))


def count_key_blocks(q_start, seq_len, window, block_m, block_n) -> int:
    lo, a, b, hi = key_block_range(q_start, seq_len, window, block_m, block_n)
    return _range_len(lo, a, block_n) + _range_len(a, b, block_n) + _range_len(b, hi, block_n)


def count_query_blocks(k_start, seq_len, window, block_m, block_n) -> int:
    lo, a, b, hi = query_block_range(k_start, seq_len, window, block_m, block_n)
    return _range_len(lo, min(a, hi), block_m) + _range_len(a, b, block_m) + _range_len(b, hi, block_m)


# --------------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------------

@triton.jit
def _sequence_of_block(CU, TABLE, pid, b, T, NUM_BLOCKS, IS_VARLEN: tl.constexpr, BLOCK: tl.constexpr,
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
def _query_block_program(CU, TABLE, pid, bh, T, H, HKV, NUM_BLOCKS, IS_VARLEN: tl.constexpr,
                         BLOCK_M: tl.constexpr):
    """(batch, query head, KV head, first token row of the sequence, its length, local start of the query
    block) of a program of the forward and dq kernels: query blocks x (batch, query head) rows, heaviest
    blocks first."""
    b = bh // H
    h = bh % H
    hk = h // (H // HKV)
    bos, seq_len, m0 = _sequence_of_block(CU, TABLE, pid, b, T, NUM_BLOCKS, IS_VARLEN, BLOCK_M, True)
    return b, h, hk, bos, seq_len, m0


@triton.jit
def _query_tile(K, bos, hk, m0, HKV, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
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
def _tile_offsets(rows, stride, offs_d, WIDE: tl.constexpr):
    # offsets relative to a 64-bit base pointer: 32-bit unless one sequence row spans 2^31 elements
    # (64-bit per-element offsets cost registers the backward does not have)
    if WIDE:
        r = rows.to(tl.int64)
    else:
        r = rows
    return r[:, None] * stride + offs_d[None, :]


@triton.jit
def _load_tile(ptrs, rows, seq_len, mask_d, CHECK_ROWS: tl.constexpr, EVEN_D: tl.constexpr):
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
def _load_streamed(base, desc, row0, col0, first, rows, stride, offs_d, mask_d, seq_len,
                   MASKED: tl.constexpr, EVEN_D: tl.constexpr, WIDE: tl.constexpr, TMA: tl.constexpr):
    """One streamed tile at sequence rows ``rows`` (= first + arange)."""
    if TMA:
        x = desc.load([row0 + first, col0])
    else:
        x = _load_tile(base + _tile_offsets(rows, stride, offs_d, WIDE), rows, seq_len, mask_d, MASKED, EVEN_D)
    return x


@triton.jit
def _load_pair(a_base, b_base, a_desc, b_desc, row0, col0, first, rows, stride, offs_d, mask_d, seq_len,
               MASKED: tl.constexpr, EVEN_D: tl.constexpr, WIDE: tl.constexpr, TMA: tl.constexpr):
    """The two tiles a loop step streams (k and v, or q and do) at sequence rows ``rows`` (= first +
    arange): through their TMA descriptors, where rows past the sequence hold the next sequence's data
    (or zeros) and the caller's masks must drop them, or by pointer loads, zeros there."""
    a = _load_streamed(a_base, a_desc, row0, col0, first, rows, stride, offs_d, mask_d, seq_len, MASKED, EVEN_D,
                       WIDE, TMA)
    b = _load_streamed(b_base, b_desc, row0, col0, first, rows, stride, offs_d, mask_d, seq_len, MASKED, EVEN_D,
                       WIDE, TMA)
    return a, b


@triton.jit
def _fwd_key_loop(acc, l_i, m_i, visits, q, k_base, v_base, k_desc, v_desc, row0, col0, kv_stride,
                  offs_m, offs_n, offs_d, mask_d, start, end, seq_len, WINDOW, qk_scale,
                  BLOCK_N: tl.constexpr, MASKED: tl.constexpr, HAS_WINDOW: tl.constexpr,
                  EVEN_D: tl.constexpr, PRECISION: tl.constexpr, WIDE: tl.constexpr, TMA: tl.constexpr):
    for n0 in range(start, end, BLOCK_N):
        cols = n0 + offs_n
        # with TMA, keys past the sequence reach only masked blocks, and the causal mask drops them
        # for every stored query row
        k, v = _load_pair(k_base, v_base, k_desc, v_desc, row0, col0, n0, cols, kv_stride, offs_d, mask_d,
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
        visits += 1
    return acc, l_i, m_i, visits


@triton.jit
def _key_bounds(m0, seq_len, WINDOW, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
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


@triton.jit
def _swa_fwd_kernel(Q, K, V, K_DESC, V_DESC, O, LSE, CU, TABLE, VISITS, T, H, HKV, WINDOW, qk_scale,
                    NUM_BLOCKS, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr, IS_VARLEN: tl.constexpr,
                    RECORD_VISITS: tl.constexpr, PRECISION: tl.constexpr, WIDE: tl.constexpr,
                    TMA: tl.constexpr):
    pid = tl.program_id(0)
    bh = tl.program_id(1)
    b, h, hk, bos, seq_len, m0 = _query_block_program(CU, TABLE, pid, bh, T, H, HKV, NUM_BLOCKS, IS_VARLEN, BLOCK_M)
    EVEN_D: tl.constexpr = BLOCK_D == D

    offs_m, offs_n, offs_d, mask_d, kv_stride, k_base = _query_tile(K, bos, hk, m0, HKV, D, BLOCK_M, BLOCK_N,
                                                                    BLOCK_D)
    q_stride = H * D
    q_ptrs = Q + (bos + offs_m).to(tl.int64)[:, None] * q_stride + h * D + offs_d[None, :]
    q = _load_tile(q_ptrs, offs_m, seq_len, mask_d, True, EVEN_D)
    v_base = V + bos.to(tl.int64) * kv_stride + hk * D

    lo, a, b_int, hi = _key_bounds(m0, seq_len, WINDOW, BLOCK_M, BLOCK_N, HAS_WINDOW)
    # a finite floor keeps fully masked rows of an edge block NaN-free (exp2(-inf - -1e30) = 0)
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    visits = 0 * pid
    acc, l_i, m_i, visits = _fwd_key_loop(acc, l_i, m_i, visits, q, k_base, v_base, K_DESC, V_DESC, bos,
                                          hk * D, kv_stride, offs_m, offs_n, offs_d, mask_d, lo, a,
                                          seq_len, WINDOW, qk_scale, BLOCK_N, True, HAS_WINDOW, EVEN_D,
                                          PRECISION, WIDE, TMA)
    acc, l_i, m_i, visits = _fwd_key_loop(acc, l_i, m_i, visits, q, k_base, v_base, K_DESC, V_DESC, bos,
                                          hk * D, kv_stride, offs_m, offs_n, offs_d, mask_d, a, b_int,
                                          seq_len, WINDOW, qk_scale, BLOCK_N, False, HAS_WINDOW, EVEN_D,
                                          PRECISION, WIDE, TMA)
    acc, l_i, m_i, visits = _fwd_key_loop(acc, l_i, m_i, visits, q, k_base, v_base, K_DESC, V_DESC, bos,
                                          hk * D, kv_stride, offs_m, offs_n, offs_d, mask_d, b_int, hi,
                                          seq_len, WINDOW, qk_scale, BLOCK_N, True, HAS_WINDOW, EVEN_D,
                                          PRECISION, WIDE, TMA)
    row_ok = offs_m < seq_len
    l_safe = tl.where(row_ok, l_i, 1.0)
    o = acc / l_safe[:, None]
    o_ptrs = O + (bos + offs_m).to(tl.int64)[:, None] * q_stride + h * D + offs_d[None, :]
    tl.store(o_ptrs, o.to(O.dtype.element_ty), mask=row_ok[:, None] & mask_d[None, :])
    lse = (m_i + tl.math.log2(l_safe)) * 0.6931471805599453
    lse_base = LSE + (b * H + h).to(tl.int64) * T + bos - b * T
    tl.store(lse_base + offs_m, lse, mask=row_ok)
    if RECORD_VISITS:
        tl.store(VISITS + bh * tl.num_programs(0) + pid, visits)


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
def _dkdv_query_loop(dk, dv, visits, k, v, q_base, do_base, q_desc, do_desc, row0, col0, dq_base,
                     lse_base, delta_base, ds_ptr, ds_desc, ds_row, q_stride, offs_n, offs_m_tile, offs_d,
                     mask_d, start, end, n0, seq_len, WINDOW, Q_SPAN, qk_scale, scale,
                     BLOCK_M: tl.constexpr, MASKED: tl.constexpr, HAS_WINDOW: tl.constexpr,
                     EVEN_D: tl.constexpr, ATOMIC_DQ: tl.constexpr, DQ_TRANSPOSED: tl.constexpr,
                     STORE_DS: tl.constexpr, DS_TMA: tl.constexpr, PRECISION: tl.constexpr,
                     WIDE: tl.constexpr, TMA: tl.constexpr):
    # transposed space: rows are keys, columns are queries, so dk and dv come out without transposes
    for m0 in range(start, end, BLOCK_M):
        rows = m0 + offs_m_tile
        off = _tile_offsets(rows, q_stride, offs_d, WIDE)  # also the atomic dq's offsets
        # with TMA, query rows past the sequence carry other data: the mask below zeroes their p and ds
        q, do = _load_pair(q_base, do_base, q_desc, do_desc, row0, col0, m0, rows, q_stride, offs_d, mask_d,
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
            # loop bounds); masked pairs hold zeros. TMA stores from shared memory; the pointer
            # store's [BLOCK_N, BLOCK_M] 64-bit addresses cost registers (dk/dv pass 2.86 -> 3.23 ms
            # at B2 T16384)
            if DS_TMA:
                ds_desc.store([ds_row, m0 - n0], ds_t)
            else:
                tl.store(ds_ptr + (offs_n - n0)[:, None] * Q_SPAN + (rows - n0)[None, :], ds_t)
        if ATOMIC_DQ and DQ_TRANSPOSED:
            # dq^T = k^T ds^T keeps the long key axis as the product's M dimension, which suits
            # small BLOCK_M (Hopper's warp-group products want M >= 64 per warp group)
            dq_t = tl.dot(tl.trans(k), ds_t, input_precision=PRECISION) * scale
            off_t = offs_d[:, None] + rows[None, :] * q_stride
            if MASKED:
                tl.atomic_add(dq_base + off_t, dq_t, mask=mask_d[:, None] & (rows < seq_len)[None, :],
                              sem="relaxed")
            else:
                if EVEN_D:
                    tl.atomic_add(dq_base + off_t, dq_t, sem="relaxed")
                else:
                    tl.atomic_add(dq_base + off_t, dq_t, mask=mask_d[:, None], sem="relaxed")
        elif ATOMIC_DQ:
            dq = tl.dot(tl.trans(ds_t), k, input_precision=PRECISION) * scale
            if MASKED:
                if EVEN_D:
                    dq_mask = (rows < seq_len)[:, None]
                else:
                    dq_mask = (rows < seq_len)[:, None] & mask_d[None, :]
                tl.atomic_add(dq_base + off, dq, mask=dq_mask, sem="relaxed")
            else:
                if EVEN_D:
                    tl.atomic_add(dq_base + off, dq, sem="relaxed")
                else:
                    tl.atomic_add(dq_base + off, dq, mask=mask_d[None, :], sem="relaxed")
        visits += 1
    return dk, dv, visits


@triton.jit
def _swa_bwd_dkdv_kernel(Q, K, V, DO, Q_DESC, DO_DESC, LSE, DELTA, DK, DV, DQ_ACC, DS, DS_DESC, CU, TABLE,
                         VISITS, T, H, HKV, WINDOW, qk_scale, scale, NUM_BLOCKS, Q_SPAN, ROW0,
                         D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr, IS_VARLEN: tl.constexpr,
                         ATOMIC_DQ: tl.constexpr, DQ_TRANSPOSED: tl.constexpr, STORE_DS: tl.constexpr,
                         DS_TMA: tl.constexpr,
                         RECORD_VISITS: tl.constexpr, PRECISION: tl.constexpr, WIDE: tl.constexpr,
                         TMA: tl.constexpr):
    pid = tl.program_id(0)
    # a launch covers the (batch, KV head) rows ROW0 .. ROW0 + grid[1] - 1; DS holds their slabs
    bhk = tl.program_id(1) + ROW0
    b = bhk // HKV
    hk = bhk % HKV
    group = H // HKV
    bos, seq_len, n0 = _sequence_of_block(CU, TABLE, pid, b, T, NUM_BLOCKS, IS_VARLEN, BLOCK_N, False)
    EVEN_D: tl.constexpr = BLOCK_D == D

    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_m_tile = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < D
    q_stride = H * D
    kv_stride = HKV * D
    kv_off = (bos + offs_n).to(tl.int64)[:, None] * kv_stride + hk * D + offs_d[None, :]
    k = _load_tile(K + kv_off, offs_n, seq_len, mask_d, True, EVEN_D)
    v = _load_tile(V + kv_off, offs_n, seq_len, mask_d, True, EVEN_D)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    a, b_int, q_hi = _query_bounds(n0, seq_len, WINDOW, BLOCK_M, BLOCK_N, HAS_WINDOW)
    diag_end = tl.minimum(a, q_hi)
    visits = 0 * pid
    for g in range(group):
        h = hk * group + g
        q_base = Q + bos.to(tl.int64) * q_stride + h * D
        do_base = DO + bos.to(tl.int64) * q_stride + h * D
        dq_base = DQ_ACC + bos.to(tl.int64) * q_stride + h * D
        lse_base = LSE + (b * H + h).to(tl.int64) * T + bos - b * T
        delta_base = DELTA + (b * H + h).to(tl.int64) * T + bos - b * T
        # one [BLOCK_N, Q_SPAN] slab per (query head, key block), in launch order
        # first row of this (query head, key block)'s slab in the [slabs * BLOCK_N, Q_SPAN] view of DS
        # (int32: ds_plan caps the launches)
        ds_row = ((tl.program_id(1) * group + g) * NUM_BLOCKS + pid) * BLOCK_N
        ds_ptr = DS + ds_row.to(tl.int64) * Q_SPAN  # the same slab for the pointer stores
        dk, dv, visits = _dkdv_query_loop(dk, dv, visits, k, v, q_base, do_base, Q_DESC, DO_DESC, bos,
                                          h * D, dq_base, lse_base, delta_base, ds_ptr, DS_DESC, ds_row,
                                          q_stride, offs_n, offs_m_tile, offs_d, mask_d, n0, diag_end, n0,
                                          seq_len, WINDOW, Q_SPAN, qk_scale, scale, BLOCK_M, True, HAS_WINDOW,
                                          EVEN_D, ATOMIC_DQ, DQ_TRANSPOSED, STORE_DS, DS_TMA, PRECISION, WIDE,
                                          TMA)
        dk, dv, visits = _dkdv_query_loop(dk, dv, visits, k, v, q_base, do_base, Q_DESC, DO_DESC, bos,
                                          h * D, dq_base, lse_base, delta_base, ds_ptr, DS_DESC, ds_row,
                                          q_stride, offs_n, offs_m_tile, offs_d, mask_d, a, b_int, n0,
                                          seq_len, WINDOW, Q_SPAN, qk_scale, scale, BLOCK_M, False, HAS_WINDOW,
                                          EVEN_D, ATOMIC_DQ, DQ_TRANSPOSED, STORE_DS, DS_TMA, PRECISION, WIDE,
                                          TMA)
        dk, dv, visits = _dkdv_query_loop(dk, dv, visits, k, v, q_base, do_base, Q_DESC, DO_DESC, bos,
                                          h * D, dq_base, lse_base, delta_base, ds_ptr, DS_DESC, ds_row,
                                          q_stride, offs_n, offs_m_tile, offs_d, mask_d, b_int, q_hi, n0,
                                          seq_len, WINDOW, Q_SPAN, qk_scale, scale, BLOCK_M, True, HAS_WINDOW,
                                          EVEN_D, ATOMIC_DQ, DQ_TRANSPOSED, STORE_DS, DS_TMA, PRECISION, WIDE,
                                          TMA)
    # offsets recomputed here rather than kept live (in registers) across the loops
    kv_off = (bos + offs_n).to(tl.int64)[:, None] * kv_stride + hk * D + offs_d[None, :]
    st_mask = (offs_n < seq_len)[:, None] & mask_d[None, :]
    tl.store(DK + kv_off, (dk * scale).to(DK.dtype.element_ty), mask=st_mask)
    tl.store(DV + kv_off, dv.to(DV.dtype.element_ty), mask=st_mask)
    if RECORD_VISITS:
        tl.store(VISITS + bhk * tl.num_programs(0) + pid, visits)


@triton.jit
def _dq_key_loop(dq, q, do, lse2, delta, k_base, v_base, k_desc, v_desc, row0, col0, kv_stride, offs_m,
                 offs_n, offs_d, mask_d, start, end, seq_len, WINDOW, qk_scale,
                 BLOCK_N: tl.constexpr, MASKED: tl.constexpr, HAS_WINDOW: tl.constexpr,
                 EVEN_D: tl.constexpr, PRECISION: tl.constexpr, WIDE: tl.constexpr, TMA: tl.constexpr):
    for n0 in range(start, end, BLOCK_N):
        cols = n0 + offs_n
        # with TMA, keys past the sequence: p is masked to zero, so ds is too
        k, v = _load_pair(k_base, v_base, k_desc, v_desc, row0, col0, n0, cols, kv_stride, offs_d, mask_d,
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
    b, h, hk, bos, seq_len, m0 = _query_block_program(CU, TABLE, pid, bh, T, H, HKV, NUM_BLOCKS, IS_VARLEN, BLOCK_M)
    EVEN_D: tl.constexpr = BLOCK_D == D

    offs_m, offs_n, offs_d, mask_d, kv_stride, k_base = _query_tile(K, bos, hk, m0, HKV, D, BLOCK_M, BLOCK_N,
                                                                    BLOCK_D)
    q_stride = H * D
    row_ok = offs_m < seq_len
    q_off = (bos + offs_m).to(tl.int64)[:, None] * q_stride + h * D + offs_d[None, :]
    q = _load_tile(Q + q_off, offs_m, seq_len, mask_d, True, EVEN_D)
    do = _load_tile(DO + q_off, offs_m, seq_len, mask_d, True, EVEN_D)
    stat_base = (b * H + h).to(tl.int64) * T + bos - b * T
    lse2 = tl.load(LSE + stat_base + offs_m, mask=row_ok, other=0.0) * 1.4426950408889634
    # delta = rowsum(o * do) is made here (this kernel runs first) and stored for the dk/dv kernel,
    # which saves a separate pass over o and do
    o = _load_tile(O + q_off, offs_m, seq_len, mask_d, True, EVEN_D)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(DELTA + stat_base + offs_m, delta, mask=row_ok)
    v_base = V + bos.to(tl.int64) * kv_stride + hk * D

    lo, a, b_int, hi = _key_bounds(m0, seq_len, WINDOW, BLOCK_M, BLOCK_N, HAS_WINDOW)
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
        k = _load_streamed(k_base, k_desc, row0, col0, n0, cols, kv_stride, offs_d, mask_d, seq_len, MASKED,
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
    b, h, hk, bos, seq_len, m0 = _query_block_program(CU, TABLE, pid, bh, T, H, HKV, NUM_BLOCKS, IS_VARLEN, BLOCK_M)
    if IS_VARLEN:  # the dk/dv launch's program (= slab) of the sequence's first key block
        kb0 = tl.load(KB_START + tl.maximum(tl.load(TABLE + 2 * pid), 0))
    else:
        kb0 = 0 * pid
    EVEN_D: tl.constexpr = BLOCK_D == D

    offs_m, offs_n, offs_d, mask_d, kv_stride, k_base = _query_tile(K, bos, hk, m0, HKV, D, BLOCK_M, BLOCK_N,
                                                                    BLOCK_D)
    slab0 = tl.program_id(1) * NUM_SLABS

    lo, a, b_int, hi = _key_bounds(m0, seq_len, WINDOW, BLOCK_M, BLOCK_N, HAS_WINDOW)
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


# --------------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------------

_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _check(q, k, v, window, cu_seqlens, scale=None) -> None:
    for name, t in dict(q=q, k=k, v=v).items():
        if t.dim() != 4:
            raise ValueError(f"{name} must be [B, T, H, D], got shape {tuple(t.shape)}")
        if t.dtype not in _SUPPORTED_DTYPES:
            raise ValueError(f"{name} must be float16, bfloat16 or float32, got {t.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k and v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if k.shape != v.shape or k.shape[0] != q.shape[0] or k.shape[1] != q.shape[1] or k.shape[3] != q.shape[3]:
        raise ValueError(f"k and v must be [B, T, Hkv, D] matching q {tuple(q.shape)}, got "
                         f"{tuple(k.shape)} and {tuple(v.shape)}")
    if q.shape[2] % k.shape[2] != 0:
        raise ValueError(f"q heads ({q.shape[2]}) must be a multiple of k/v heads ({k.shape[2]})")
    if q.shape[3] > 256:
        raise ValueError(f"head dim D={q.shape[3]} exceeds the supported maximum 256")
    if window is not None and (not isinstance(window, int) or window < 1):
        raise ValueError(f"window must be a positive int or None, got {window!r}")
    if scale is not None and not scale > 0:
        raise ValueError(f"scale must be positive, got {scale!r}")
    if cu_seqlens is not None:
        if cu_seqlens.dim() != 1 or cu_seqlens.is_floating_point() or cu_seqlens.numel() < 2:
            raise ValueError("cu_seqlens must be a 1-D integer tensor [N+1]")
        if q.shape[0] != 1:
            raise ValueError(f"cu_seqlens requires batch size 1, got B={q.shape[0]}")


def _sequence_blocks(cu_seqlens: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """int64 [N] each: the ``block``-row blocks of each packed sequence, and the index of its first
    block in a varlen launch's table (``_block_table``)."""
    cu = cu_seqlens.long()
    n_blocks = (cu[1:] - cu[:-1] + block - 1) // block
    return n_blocks, torch.cumsum(n_blocks, 0) - n_blocks


def _block_table(cu_seqlens: torch.Tensor, block: int, T: int) -> torch.Tensor:
    """[G, 2] int32 rows (sequence, block in sequence) for each program of a varlen launch.

    Built on the device without a host sync: G = cdiv(T, block) + N bounds the true block count,
    and spare rows carry sequence -1.
    """
    n_seq = cu_seqlens.numel() - 1
    n_blocks, starts = _sequence_blocks(cu_seqlens, block)
    ends = starts + n_blocks
    grid = _grid_size(T, cu_seqlens, block)
    g = torch.arange(grid, device=cu_seqlens.device)
    seq = torch.searchsorted(ends, g, right=True)
    valid = seq < n_seq
    seq_c = seq.clamp(max=n_seq - 1)
    blk = g - starts[seq_c]
    table = torch.stack([torch.where(valid, seq_c, -1), blk], dim=1)
    return table.to(torch.int32).contiguous()


def _precision(dtype: torch.dtype) -> str:
    # fp32 inputs get exact fp32 products (the accuracy tests rely on it); 16-bit inputs ignore this
    return "ieee" if dtype == torch.float32 else "tf32"


def _grid_size(T: int, cu_seqlens: Optional[torch.Tensor], block: int) -> int:
    """Programs per (batch, head) row of a launch over ``block``-row blocks (``_launch_geometry``'s)."""
    return triton.cdiv(T, block) + (0 if cu_seqlens is None else cu_seqlens.numel() - 1)


def _launch_geometry(q, cu_seqlens, block):
    T = q.shape[1]
    if cu_seqlens is None:
        n_blocks = _grid_size(T, None, block)
        return n_blocks, n_blocks, None, q.new_empty(1, dtype=torch.int32)
    table = _block_table(cu_seqlens, block, T)
    return table.shape[0], table.shape[0], table, cu_seqlens


def _wide_offsets(T: int, heads: int, block_d: int) -> bool:
    """Whether one sequence row (plus a tile of overrun) can pass 2^31 elements."""
    return (T + 256) * heads * block_d >= 2 ** 31


def _window_args(window, T):
    # a window covering the whole row is plain causal attention: no window mask needed
    has_window = window is not None and window < T
    return has_window, (int(window) if has_window else 0)


def _tma_descriptor(use: bool, t: torch.Tensor, block_rows: int, D: int):
    """A TMA descriptor over ``t`` viewed as [rows, heads * D], loading [block_rows, D] tiles; or ``t``
    itself (an unused placeholder) where TMA is off or cannot serve this tensor."""
    if not use:
        return t
    t2 = t.view(t.shape[0] * t.shape[1], t.shape[2] * t.shape[3])
    return TensorDescriptor(t2, shape=list(t2.shape), strides=list(t2.stride()), block_shape=[block_rows, D])


def _tma_usable(want: bool, D: int, block_d: int, *tensors: torch.Tensor) -> bool:
    """TMA wants Hopper or newer, a power-of-two head dim, and 16-byte aligned bases and row strides."""
    if not want or TensorDescriptor is None or D != block_d:
        return False
    dev = tensors[0].device
    if not _interpreted(dev) and torch.cuda.get_device_capability(dev)[0] < 9:
        return False
    return all(t.data_ptr() % 16 == 0 and (t.shape[2] * D * t.element_size()) % 16 == 0 for t in tensors)


def _block_d(D: int) -> int:
    """Channel tile of head dim ``D``: the next power of two, at least 16 (the products' minimum)."""
    return max(16, triton.next_power_of_2(D))


def _defaults(q: torch.Tensor, scale: Optional[float], config, backward: bool):
    """(scale, launch config, BLOCK_D) of one call: 1/sqrt(D) when ``scale`` is None, the default tiles
    of q's head dim, device and dtype (the backward's when ``backward``) when ``config`` is None."""
    D = q.shape[-1]
    cfg = config or default_configs(D, q.device, q.dtype)[1 if backward else 0]
    return (D ** -0.5 if scale is None else scale), cfg, _block_d(D)


def swa_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: Optional[int],
                scale: Optional[float] = None, cu_seqlens: Optional[torch.Tensor] = None, *,
                config: Optional[FwdConfig] = None,
                visits: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward pass without autograd.

    q: [B,T,H,D]; k, v: [B,T,Hkv,D], all of one dtype (fp16, bf16 or fp32). Returns ``o`` [B,T,H,D] in
    q's dtype and ``lse`` fp32 [B,H,T], the natural-log log-sum-exp of each query's scaled scores
    (with cu_seqlens, B == 1 and T runs over the packed tokens). ``visits`` (int32 [H*B*grid],
    optional) receives the number of key blocks each program visited.
    """
    _check(q, k, v, window, cu_seqlens, scale)
    B, T, H, D = q.shape
    HKV = k.shape[2]
    scale, cfg, BLOCK_D = _defaults(q, scale, config, backward=False)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    o = torch.empty_like(q)
    lse = torch.empty(B, H, T, device=q.device, dtype=torch.float32)
    if T == 0:
        return o, lse
    grid0, n_blocks, table, cu = _launch_geometry(q, cu_seqlens, cfg.block_m)
    has_window, w = _window_args(window, T)
    if visits is not None and visits.numel() < grid0 * B * H:
        raise ValueError(f"visits must hold at least {grid0 * B * H} int32 counters")
    tma = _tma_usable(cfg.tma, D, BLOCK_D, k, v)
    _swa_fwd_kernel[(grid0, B * H)](
        q, k, v, _tma_descriptor(tma, k, cfg.block_n, D), _tma_descriptor(tma, v, cfg.block_n, D),
        o, lse, cu, table if table is not None else cu, visits if visits is not None else lse,
        T, H, HKV, w, float(scale) * LOG2E, n_blocks,
        D=D, BLOCK_D=BLOCK_D, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        HAS_WINDOW=has_window, IS_VARLEN=cu_seqlens is not None, RECORD_VISITS=visits is not None,
        PRECISION=_precision(q.dtype), WIDE=_wide_offsets(T, H, BLOCK_D), TMA=tma,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return o, lse


def swa_backward_dq(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                    lse: torch.Tensor, window: Optional[int], scale: Optional[float] = None,
                    cu_seqlens: Optional[torch.Tensor] = None, *, config: Optional[BwdConfig] = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """The dq kernel alone (``config.dq_*`` tiles): returns dq and ``delta = rowsum(o * do)`` (fp32
    [B,H,T]), which the dk/dv kernel reads. Contiguous inputs of one dtype expected."""
    B, T, H, D = q.shape
    HKV = k.shape[2]
    scale, cfg, BLOCK_D = _defaults(q, scale, config, backward=True)
    dq = torch.empty_like(q)
    delta = torch.empty(B, H, T, device=q.device, dtype=torch.float32)
    has_window, w = _window_args(window, T)
    grid0, n_blocks, table, cu = _launch_geometry(q, cu_seqlens, cfg.dq_block_m)
    tma = _tma_usable(cfg.dq_tma, D, BLOCK_D, k, v)
    _swa_bwd_dq_kernel[(grid0, B * H)](
        q, k, v, _tma_descriptor(tma, k, cfg.dq_block_n, D), _tma_descriptor(tma, v, cfg.dq_block_n, D),
        o, do, lse, delta, dq, cu, table if table is not None else cu, T, H, HKV, w,
        float(scale) * LOG2E, float(scale), n_blocks,
        D=D, BLOCK_D=BLOCK_D, BLOCK_M=cfg.dq_block_m, BLOCK_N=cfg.dq_block_n, HAS_WINDOW=has_window,
        IS_VARLEN=cu_seqlens is not None, PRECISION=_precision(q.dtype), WIDE=_wide_offsets(T, H, BLOCK_D),
        TMA=tma, num_warps=cfg.dq_num_warps, num_stages=cfg.dq_num_stages)
    return dq, delta


def swa_backward_dkdv(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      lse: torch.Tensor, delta: torch.Tensor, window: Optional[int],
                      scale: Optional[float] = None, cu_seqlens: Optional[torch.Tensor] = None, *,
                      config: Optional[BwdConfig] = None, dq_acc: Optional[torch.Tensor] = None,
                      visits: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The dk/dv kernel alone: returns dk, dv. With ``config.atomic_dq`` it also adds dq (unscaled
    layout [B,T,H,D], fp32) into ``dq_acc``. Contiguous inputs of one dtype expected."""
    scale, cfg, _ = _defaults(q, scale, config, backward=True)
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    _launch_dkdv(do, q, k, v, lse, delta, dk, dv, window, scale, cu_seqlens, cfg, dq_acc=dq_acc,
                 visits=visits)
    return dk, dv


def _launch_dkdv(do, q, k, v, lse, delta, dk, dv, window, scale, cu_seqlens, cfg: BwdConfig, *,
                 dq_acc=None, ds=None, q_span=0, rows=None, visits=None, geometry=None) -> None:
    """One dk/dv launch over the (batch, KV head) rows ``rows`` (start, count; default all), writing
    their dk and dv; with ``ds`` also their ds slabs (``q_span`` queries per key block). ``geometry``:
    ``_launch_geometry`` over ``cfg.block_n`` keys, when the caller launches several times."""
    B, T, H, D = q.shape
    HKV = k.shape[2]
    BLOCK_D = _block_d(D)
    row0, n_rows = rows if rows is not None else (0, B * HKV)
    has_window, w = _window_args(window, T)
    grid0, n_blocks, table, cu = geometry or _launch_geometry(q, cu_seqlens, cfg.block_n)
    if visits is not None and visits.numel() < grid0 * B * HKV:
        raise ValueError(f"visits must hold at least {grid0 * B * HKV} int32 counters")
    tma = _tma_usable(cfg.tma, D, BLOCK_D, q, do)
    ds_tma = ds is not None and tma
    _swa_bwd_dkdv_kernel[(grid0, n_rows)](
        q, k, v, do, _tma_descriptor(tma, q, cfg.block_m, D), _tma_descriptor(tma, do, cfg.block_m, D),
        lse, delta, dk, dv, dq_acc if dq_acc is not None else delta, ds if ds is not None else delta,
        _slab_descriptor(ds, q_span, [cfg.block_n, cfg.block_m]) if ds_tma else delta, cu,
        table if table is not None else cu, visits if visits is not None else delta,
        T, H, HKV, w, float(scale) * LOG2E, float(scale), n_blocks, q_span, row0,
        D=D, BLOCK_D=BLOCK_D, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, HAS_WINDOW=has_window,
        IS_VARLEN=cu_seqlens is not None, ATOMIC_DQ=cfg.atomic_dq, DQ_TRANSPOSED=cfg.dq_transposed,
        STORE_DS=ds is not None, DS_TMA=ds_tma, RECORD_VISITS=visits is not None, PRECISION=_precision(q.dtype),
        WIDE=_wide_offsets(T, H, BLOCK_D), TMA=tma, num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def _launch_dq_from_ds(ds, k, dq, q_span, n_slabs, kb_start, window, scale, cu_seqlens, cfg: BwdConfig,
                       rows, geometry) -> None:
    """dq of the (batch, query head) rows ``rows`` (start, count) from their ds slabs (``n_slabs`` per
    row; ``kb_start``: each packed sequence's first slab; ``geometry``: ``_launch_geometry`` over
    ``cfg.ds_block_m`` queries)."""
    B, T, H, D = dq.shape
    HKV = k.shape[2]
    BLOCK_D = _block_d(D)
    has_window, w = _window_args(window, T)
    grid0, n_blocks, table, cu = geometry
    tma = _tma_usable(cfg.dq_tma, D, BLOCK_D, k)
    _swa_bwd_dq_ds_kernel[(grid0, rows[1])](
        ds, _slab_descriptor(ds, q_span, [cfg.block_n, cfg.ds_block_m]) if tma else ds,
        k, _tma_descriptor(tma, k, cfg.block_n, D), dq, cu, table if table is not None else cu,
        kb_start if kb_start is not None else cu,
        T, H, HKV, w, float(scale), n_blocks, n_slabs, q_span, rows[0],
        D=D, BLOCK_D=BLOCK_D, BLOCK_M=cfg.ds_block_m, BLOCK_N=cfg.block_n, HAS_WINDOW=has_window,
        IS_VARLEN=cu_seqlens is not None, PRECISION=_precision(dq.dtype), WIDE=_wide_offsets(T, H, BLOCK_D),
        TMA=tma, DS_TMA=tma, num_warps=cfg.ds_num_warps, num_stages=cfg.ds_num_stages)


def _slab_descriptor(ds: torch.Tensor, q_span: int, block: list[int]):
    """TMA descriptor over the ds scratch viewed as [slabs * block_n, q_span] (rows are keys)."""
    view = ds.view(-1, q_span)
    return TensorDescriptor(view, shape=list(view.shape), strides=list(view.stride()), block_shape=block)


def ds_scratch_limit() -> int:
    """Bytes the dq-from-ds backward may hold for ds at once (``GDN2_SWA_DS_SCRATCH_MB``, default 2048)."""
    raw = os.environ.get("GDN2_SWA_DS_SCRATCH_MB", "2048")
    try:
        mb = float(raw)
    except ValueError:
        raise ValueError(f"GDN2_SWA_DS_SCRATCH_MB must be a number of MiB, got {raw!r}") from None
    return int(mb * 2 ** 20)


def ds_plan(q: torch.Tensor, k: torch.Tensor, window: Optional[int], cu_seqlens: Optional[torch.Tensor],
            cfg: BwdConfig, limit: Optional[int] = None) -> Optional[tuple[int, int]]:
    """(queries per slab, KV-head rows per launch) of the dq-from-ds backward, or None where it does not
    apply: off in ``cfg``, atomic dq, fp32 inputs on a GPU (its transposed tf32 operand is not a
    Hopper product), or one KV head's slabs over the scratch limit."""
    if not cfg.dq_from_ds or cfg.atomic_dq or (q.element_size() > 2 and not _interpreted(q.device)):
        return None
    B, T, H, _ = q.shape
    HKV = k.shape[2]
    has_window, w = _window_args(window, T)
    span = _cdiv(cfg.block_n - 1 + (w if has_window else T), cfg.block_m) * cfg.block_m
    n_slabs = _grid_size(T, cu_seqlens, cfg.block_n)
    rows_per_row = (H // HKV) * n_slabs * cfg.block_n  # slab rows (keys) per (batch, KV head) row
    per_row = rows_per_row * span * q.element_size()
    limit = ds_scratch_limit() if limit is None else limit
    if per_row > limit:
        return None
    # the kernels address slab rows with 32-bit integers
    fit = min(limit // per_row, (2 ** 31 - 1) // rows_per_row)
    if fit < 1:
        return None
    launches = _cdiv(B * HKV, fit)
    return span, _cdiv(B * HKV, launches)  # equal launches rather than a full one and a remainder


def _ds_scratch(numel: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    # uninitialised: the dk/dv pass writes every pair the dq kernel reads (tests fill it with NaN)
    return torch.empty(numel, device=device, dtype=dtype)


def _delta(o: torch.Tensor, do: torch.Tensor) -> torch.Tensor:
    """fp32 [B,H,T] rowsum(o * do)."""
    B, T, H, D = o.shape
    BLOCK_T = 64
    delta = torch.empty(B, H, T, device=o.device, dtype=torch.float32)
    _bwd_delta_kernel[(triton.cdiv(T, BLOCK_T), B * H)](o, do, delta, T, H, D=D, BLOCK_T=BLOCK_T,
                                                       BLOCK_D=_block_d(D), num_warps=4)
    return delta


def swa_backward(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                 lse: torch.Tensor, window: Optional[int], scale: Optional[float] = None,
                 cu_seqlens: Optional[torch.Tensor] = None, *, config: Optional[BwdConfig] = None,
                 visits: Optional[torch.Tensor] = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (dq [B,T,H,D], dk, dv [B,T,Hkv,D], in the inputs' dtype) from the forward's o and lse.

    ``visits`` (int32 [B*Hkv*grid], optional) receives the number of query blocks each dk/dv program
    visited, summed over the query heads of its group.
    """
    B, T, H, D = q.shape
    HKV = k.shape[2]
    scale, cfg, _ = _defaults(q, scale, config, backward=True)
    q, k, v, o, do = (t.contiguous() for t in (q, k, v, o, do))
    do = do.to(q.dtype)
    if T == 0:
        return torch.zeros_like(q), torch.empty_like(k), torch.empty_like(v)
    if cfg.atomic_dq:
        delta = _delta(o, do)
        dq_acc = torch.zeros(B, T, H, D, device=q.device, dtype=torch.float32)
        dk, dv = swa_backward_dkdv(do, q, k, v, lse, delta, window, scale, cu_seqlens, config=cfg,
                                   dq_acc=dq_acc, visits=visits)
        return dq_acc.to(q.dtype), dk, dv
    plan = ds_plan(q, k, window, cu_seqlens, cfg)
    if plan is not None:
        span, rows_per_launch = plan
        group = H // HKV
        delta = _delta(o, do)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        # the launch geometries (block tables with cu_seqlens) are the same for every group of rows;
        # each dk/dv program (key block) of a row owns one slab
        key_blocks = _launch_geometry(q, cu_seqlens, cfg.block_n)
        query_blocks = _launch_geometry(q, cu_seqlens, cfg.ds_block_m)
        n_slabs = key_blocks[0]
        kb_start = None if cu_seqlens is None else _sequence_blocks(cu_seqlens, cfg.block_n)[1].to(torch.int32)
        n_rows = min(rows_per_launch, B * HKV)
        ds = _ds_scratch(n_rows * group * n_slabs * cfg.block_n * span, q.device, q.dtype)
        for row0 in range(0, B * HKV, n_rows):
            rows = (row0, min(n_rows, B * HKV - row0))
            _launch_dkdv(do, q, k, v, lse, delta, dk, dv, window, scale, cu_seqlens, cfg, ds=ds, q_span=span,
                         rows=rows, visits=visits, geometry=key_blocks)
            _launch_dq_from_ds(ds, k, dq, span, n_slabs, kb_start, window, scale, cu_seqlens, cfg,
                               (rows[0] * group, rows[1] * group), query_blocks)
        return dq, dk, dv
    # the dq kernel also writes delta, so it runs before the dk/dv kernel
    dq, delta = swa_backward_dq(do, q, k, v, o, lse, window, scale, cu_seqlens, config=cfg)
    dk, dv = swa_backward_dkdv(do, q, k, v, lse, delta, window, scale, cu_seqlens, config=cfg,
                               visits=visits)
    return dq, dk, dv


class SlidingWindowAttentionFunction(torch.autograd.Function):
    """Autograd wrapper: saves q, k, v, o and the fp32 lse; the backward recomputes probabilities."""

    @staticmethod
    def forward(ctx, q, k, v, window, scale, cu_seqlens, fwd_config, bwd_config):
        o, lse = swa_forward(q, k, v, window, scale, cu_seqlens, config=fwd_config)
        ctx.save_for_backward(q, k, v, o, lse, cu_seqlens)
        ctx.window, ctx.scale, ctx.bwd_config = window, scale, bwd_config
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse, cu_seqlens = ctx.saved_tensors
        dq, dk, dv = swa_backward(do, q, k, v, o, lse, ctx.window, ctx.scale, cu_seqlens,
                                  config=ctx.bwd_config)
        return dq, dk, dv, None, None, None, None, None


def sliding_window_attention_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                    window: Optional[int], scale: Optional[float] = None,
                                    cu_seqlens: Optional[torch.Tensor] = None, *,
                                    fwd_config: Optional[FwdConfig] = None,
                                    bwd_config: Optional[BwdConfig] = None) -> torch.Tensor:
    """Causal sliding-window attention, differentiable in q, k and v.

    q: [B,T,H,D]; k, v: [B,T,Hkv,D] (H a multiple of Hkv), fp16 / bf16 / fp32, D <= 256. Query i sees
    keys j with ``i - window < j <= i`` (``window=None``: full causal). ``cu_seqlens`` (int [N+1],
    B == 1) keeps packed sequences apart. ``scale`` defaults to D**-0.5. Returns [B,T,H,D] in q's
    dtype. ``fwd_config`` / ``bwd_config`` override the tile shapes (benchmarks).
    """
    _check(q, k, v, window, cu_seqlens, scale)
    if cu_seqlens is not None:
        cu_seqlens = cu_seqlens.to(device=q.device, dtype=torch.int32).contiguous()
    if scale is None:
        scale = q.shape[-1] ** -0.5
    return SlidingWindowAttentionFunction.apply(q, k, v, window, float(scale), cu_seqlens,
                                                fwd_config, bwd_config)
