"""One-token attention over a key/value ring buffer (the decode step of the attention layers).

Each row of a batch brings one new token: its fused projection ``qkv`` ``[B, (H + 2*Hkv) * D]`` (the
queries, keys and values of all heads side by side), the RoPE tables of its position and a mask of
the ring slots it may see. :func:`ring_decode_attention_triton` does in one pass what the plain torch
version (``naive.ring_decode_attention_reference``, the oracle) does in five: split ``qkv`` into heads,
rotate q and k (rotate-half RoPE in fp32, rounded back to the activations' dtype), write the new key
and value into the ring slot ``slot`` (and the column into ``positions[slot]``), and attend each
query head to every visible slot of its key/value head, the new one included.

The kernel: one program per (window split, row, key/value head); it handles all query heads of the
group, so every key and value is read once. With one query head per key/value head, each slot lane of
a block keeps its own online softmax, merged after the loop, so the loop has no reduction across
warps. At batch 1 a 2048-slot window is split over many programs
so that the whole GPU streams the cache, and a second, tiny kernel merges the splits' partial softmax
sums. The program whose split holds ``slot`` takes the new key and value from its registers rather
than from memory and stores them to the cache; no other program reads that slot, so the write needs
no ordering. Scores are computed in fp32 (float64 for float64 inputs) with an online softmax in base 2.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Optional

import torch
import triton
import triton.language as tl

from gdn2.ops.checks import check_decode_inputs

LOG2E = 1.4426950408889634
# the running maximum before any visible slot: finite, so that exp2(m_old - m_new) is never nan
NEG_BIG = tl.constexpr(-1e30)


@triton.jit
def _ring_block(k_base, v_base, visible, i_b, s_vis, s_kn, s_vn, o_n, end, o_d, m_d, slot, k_new, v_new,
                DTYPE: tl.constexpr, ACC: tl.constexpr):
    """Keys and values [BLOCK_N, DP] of ring slots ``o_n`` (the new ones at ``slot``), as the
    activations' dtype ``DTYPE`` rounds them, in ``ACC``; and which of the slots the row sees."""
    m_n = o_n < end
    seen = tl.load(visible + i_b * s_vis + o_n, mask=m_n, other=0) != 0
    m_kv = m_n[:, None] & m_d[None, :]
    k = tl.load(k_base + o_n[:, None].to(tl.int64) * s_kn + o_d[None, :], mask=m_kv, other=0.0)
    v = tl.load(v_base + o_n[:, None].to(tl.int64) * s_vn + o_d[None, :], mask=m_kv, other=0.0)
    here = (o_n == slot)[:, None]
    k = tl.where(here, k_new[None, :], k.to(DTYPE).to(ACC))
    v = tl.where(here, v_new[None, :], v.to(DTYPE).to(ACC))
    return k, v, seen


@triton.jit
def ring_attention_split_kernel(qkv, cos, sin, k_cache, v_cache, positions, slot_ptr, column_ptr, visible,
                                out, part_acc, part_m, part_l,
                                s_qkv, s_kb, s_kn, s_kh, s_vb, s_vn, s_vh, s_vis,
                                C, chunk, scale_log2,
                                H: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, GP: tl.constexpr,
                                D: tl.constexpr, DP: tl.constexpr, BLOCK_N: tl.constexpr, NS: tl.constexpr,
                                ACC: tl.constexpr):
    i_s = tl.program_id(0)
    i_bh = tl.program_id(1)
    i_b = i_bh // HKV
    i_hk = i_bh % HKV
    HALF: tl.constexpr = D // 2

    o_d = tl.arange(0, DP)
    m_d = o_d < D
    # rotate-half: lane d pairs with d + D/2 (first half, negated) or d - D/2 (second half)
    o_rot = tl.where(o_d < HALF, o_d + HALF, o_d - HALF)
    sign = tl.where(o_d < HALF, -1.0, 1.0).to(ACC)
    c = tl.load(cos + i_b * D + o_d, mask=m_d, other=0.0).to(ACC)
    s = tl.load(sin + i_b * D + o_d, mask=m_d, other=0.0).to(ACC)

    row = qkv + i_b.to(tl.int64) * s_qkv
    o_g = tl.arange(0, GP)
    m_g = o_g < G
    h_q = i_hk * G + o_g
    m_q = m_g[:, None] & m_d[None, :]
    q1 = tl.load(row + h_q[:, None] * D + o_d[None, :], mask=m_q, other=0.0).to(ACC)
    q2 = tl.load(row + h_q[:, None] * D + o_rot[None, :], mask=m_q, other=0.0).to(ACC)
    q = q1 * c[None, :] + sign[None, :] * q2 * s[None, :]
    # rounded to the activations' dtype like the unfused rotation, then scaled for exp2
    q = q.to(qkv.dtype.element_ty).to(ACC) * scale_log2

    k_row = row + H * D + i_hk * D
    k1 = tl.load(k_row + o_d, mask=m_d, other=0.0).to(ACC)
    k2 = tl.load(k_row + o_rot, mask=m_d, other=0.0).to(ACC)
    k_new = (k1 * c + sign * k2 * s).to(qkv.dtype.element_ty).to(k_cache.dtype.element_ty)
    v_new = tl.load(row + (H + HKV) * D + i_hk * D + o_d, mask=m_d, other=0.0).to(v_cache.dtype.element_ty)
    k_new_acc = k_new.to(qkv.dtype.element_ty).to(ACC)
    v_new_acc = v_new.to(qkv.dtype.element_ty).to(ACC)
    slot = tl.load(slot_ptr)
    start = i_s * chunk
    end = tl.minimum(start + chunk, C)
    k_base = k_cache + i_b.to(tl.int64) * s_kb + i_hk * s_kh
    v_base = v_cache + i_b.to(tl.int64) * s_vb + i_hk * s_vh

    if GP == 1:
        # one query head: every slot lane of the block keeps its own online softmax (running max,
        # sum and weighted values), merged once after the loop; no reduction across warps inside it
        q_vec = tl.sum(q, axis=0)  # [DP]
        m_n = tl.full([BLOCK_N], NEG_BIG, ACC)
        l_n = tl.zeros([BLOCK_N], ACC)
        acc_n = tl.zeros([BLOCK_N, DP], ACC)
        for n0 in range(start, end, BLOCK_N):
            o_n = n0 + tl.arange(0, BLOCK_N)
            k, v, seen = _ring_block(k_base, v_base, visible, i_b, s_vis, s_kn, s_vn, o_n, end, o_d, m_d, slot,
                                     k_new_acc, v_new_acc, qkv.dtype.element_ty, ACC)
            scores = tl.where(seen, tl.sum(k * q_vec[None, :], axis=1), float("-inf"))
            m_new = tl.maximum(m_n, scores)
            alpha = tl.exp2(m_n - m_new)
            p = tl.exp2(scores - m_new)
            l_n = l_n * alpha + p
            acc_n = acc_n * alpha[:, None] + p[:, None] * v
            m_n = m_new
        m_top = tl.max(m_n, axis=0)
        w = tl.exp2(m_n - m_top)
        m_i = tl.zeros([GP], ACC) + m_top
        l_i = tl.zeros([GP], ACC) + tl.sum(w * l_n, axis=0)
        acc = tl.zeros([GP, DP], ACC) + tl.sum(w[:, None] * acc_n, axis=0)[None, :]
    else:
        m_i = tl.full([GP], NEG_BIG, ACC)
        l_i = tl.zeros([GP], ACC)
        acc = tl.zeros([GP, DP], ACC)
        for n0 in range(start, end, BLOCK_N):
            o_n = n0 + tl.arange(0, BLOCK_N)
            k, v, seen = _ring_block(k_base, v_base, visible, i_b, s_vis, s_kn, s_vn, o_n, end, o_d, m_d, slot,
                                     k_new_acc, v_new_acc, qkv.dtype.element_ty, ACC)
            scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2)
            scores = tl.where(seen[None, :], scores, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, axis=1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(scores - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
            m_i = m_new

    if (slot >= start) & (slot < end):
        tl.store(k_base + slot * s_kn + o_d, k_new, mask=m_d)
        tl.store(v_base + slot * s_vn + o_d, v_new, mask=m_d)
        if i_bh == 0:
            tl.store(positions + slot, tl.load(column_ptr))

    bh = i_b * H + h_q  # [GP] rows of out (and of the partial buffers) that this program owns
    if NS == 1:
        o = acc / l_i[:, None]
        tl.store(out + bh[:, None] * D + o_d[None, :], o.to(out.dtype.element_ty), mask=m_q)
    else:
        tl.store(part_acc + (bh[:, None] * NS + i_s) * D + o_d[None, :], acc, mask=m_q)
        tl.store(part_m + bh * NS + i_s, m_i, mask=m_g)
        tl.store(part_l + bh * NS + i_s, l_i, mask=m_g)


@triton.jit
def ring_attention_merge_kernel(part_acc, part_m, part_l, out, NS: tl.constexpr, NSP: tl.constexpr,
                                D: tl.constexpr, DP: tl.constexpr):
    bh = tl.program_id(0)
    o_s = tl.arange(0, NSP)
    m_s = o_s < NS
    o_d = tl.arange(0, DP)
    m_d = o_d < D
    m = tl.load(part_m + bh * NS + o_s, mask=m_s, other=float("-inf"))
    l = tl.load(part_l + bh * NS + o_s, mask=m_s, other=0.0)
    acc = tl.load(part_acc + (bh * NS + o_s[:, None]) * D + o_d[None, :], mask=m_s[:, None] & m_d[None, :],
                  other=0.0)
    w = tl.exp2(m - tl.max(m, axis=0))
    o = tl.sum(w[:, None] * acc, axis=0) / tl.sum(w * l, axis=0)
    tl.store(out + bh * D + o_d, o.to(out.dtype.element_ty), mask=m_d)


@lru_cache(maxsize=None)
def _multiprocessors(index: Optional[int]) -> int:
    if index is None:  # CPU (the interpreter): a few splits, so that tests exercise the merge
        return 2
    return torch.cuda.get_device_properties(index).multi_processor_count


def split_count(batch: int, kv_heads: int, capacity: int, block_n: int, multiprocessors: int) -> tuple[int, int]:
    """(splits, slots per split): enough programs to give every multiprocessor about four, each split
    a whole number of ``block_n`` slot blocks; one split when the rows and heads fill the GPU already."""
    blocks = triton.cdiv(capacity, block_n)
    want = max(1, min(blocks, triton.cdiv(4 * multiprocessors, batch * kv_heads)))
    chunk = triton.cdiv(blocks, want) * block_n
    return triton.cdiv(capacity, chunk), chunk


def ring_decode_attention_triton(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                                 k_cache: torch.Tensor, v_cache: torch.Tensor, positions: torch.Tensor,
                                 slot: torch.Tensor, column: torch.Tensor, visible: torch.Tensor,
                                 n_head: int, num_splits: Optional[int] = None) -> torch.Tensor:
    """Rotate, store and attend one new token per row (see the module doc); caches updated in place.

    qkv [B, (n_head + 2*Hkv) * D] (rows contiguous); cos, sin fp32 [B, D]; k_cache, v_cache
    [B, C, Hkv, D] with contiguous heads; positions int64 [C]; slot int64 [1] (the ring slot this
    step writes); column int64 0-d (stored at ``positions[slot]``); visible bool [B, C] (every row
    must see at least one slot). ``num_splits`` overrides the window split (tests). Returns
    o [B, n_head * D] in qkv's dtype.
    """
    B, C, Hkv, D, G = check_decode_inputs(qkv, cos, sin, k_cache, v_cache, positions, slot, visible, n_head)
    if qkv.stride(1) != 1 or k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError("qkv rows and the cache heads must be contiguous")
    fp64 = qkv.dtype == torch.float64
    acc_dtype = torch.float64 if fp64 else torch.float32
    DP = triton.next_power_of_2(D)
    GP = triton.next_power_of_2(G)
    # one query head a group: [64, DP] tiles of keys, values and per-lane sums over 8 warps; grouped
    # heads: [GP, BLOCK_N, DP] products, kept to 8K elements
    BLOCK_N = 64 if GP == 1 else max(16, min(64, 8192 // (GP * DP)))
    warps = 8 if GP == 1 and DP >= 128 else 4
    if num_splits is None:
        index = qkv.device.index if qkv.is_cuda else None
        if qkv.is_cuda and index is None:
            index = torch.cuda.current_device()
        NS, chunk = split_count(B, Hkv, C, BLOCK_N, _multiprocessors(index))
    else:
        chunk = triton.cdiv(triton.cdiv(C, max(1, num_splits)), BLOCK_N) * BLOCK_N
        NS = triton.cdiv(C, chunk)
    H = n_head
    out = torch.empty(B, H * D, device=qkv.device, dtype=qkv.dtype)
    if NS > 1:
        part_acc = torch.empty(B * H * NS * D, device=qkv.device, dtype=acc_dtype)
        part_m = torch.empty(B * H * NS, device=qkv.device, dtype=acc_dtype)
        part_l = torch.empty(B * H * NS, device=qkv.device, dtype=acc_dtype)
    else:
        part_acc = part_m = part_l = out
    cos = cos.to(acc_dtype).contiguous()
    sin = sin.to(acc_dtype).contiguous()
    seen = visible.contiguous().view(torch.uint8)
    ring_attention_split_kernel[(NS, B * Hkv)](
        qkv, cos, sin, k_cache, v_cache, positions, slot.reshape(1), column.reshape(1), seen,
        out, part_acc, part_m, part_l,
        qkv.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), seen.stride(0),
        C, chunk, LOG2E / math.sqrt(D),
        H=H, HKV=Hkv, G=G, GP=GP, D=D, DP=DP, BLOCK_N=BLOCK_N, NS=NS,
        ACC=tl.float64 if fp64 else tl.float32, num_warps=warps)
    if NS > 1:
        ring_attention_merge_kernel[(B * H,)](part_acc, part_m, part_l, out, NS=NS,
                                              NSP=max(2, triton.next_power_of_2(NS)), D=D, DP=DP,
                                              num_warps=4 if DP >= 128 else 2)
    return out
