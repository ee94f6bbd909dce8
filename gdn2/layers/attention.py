"""Causal (sliding-window) attention with RoPE and grouped KV heads.

A query at position i sees the keys at positions j with ``i - window < j <= i`` (``window`` counts the
query itself; flash-attn ``window_size=(window - 1, 0)``); ``window=None`` is full causal attention.
RoPE: rotate-half (NeoX) style over the whole head dimension, base 10000, fp32 tables.

The layer owns its decode layout (:class:`AttentionCache`, a ring buffer of keys and values) and its
decode step: :meth:`CausalSelfAttention.step_values` computes once per step what every attention layer
shares (they have one window, head size and ring layout), and the step itself is one in-place custom op
(``gdn2::ring_decode_attention``) that rotates, writes the ring slot and attends.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn

from gdn2.config import Config
from gdn2.layout import PackedPrompts, TokenLayout
from gdn2.modules import Linear
from gdn2.ops import ring_decode_attention_op, rope_qkv, sliding_window_attention, sliding_window_attention_reference
from gdn2.stages import rope_qkv_stage


def rope_tables(positions: torch.Tensor, head_size: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin tables [T, head_size] in fp32 for integer ``positions`` [T]."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_size, 2, device=positions.device, dtype=torch.float32) / head_size))
    angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


@dataclass
class AttentionCache:
    """Ring buffer of the last ``capacity`` keys and values (RoPE applied) and their positions.

    With a sliding window the capacity is the window, so memory stays bounded for any generation
    length; with full attention it is the longest sequence the cache was made for.

    ``positions`` are *columns* shared by all rows. A row whose prompt is shorter than the longest one
    in the batch starts at column ``offsets[row]`` (kept by the InferenceCache): its token at position
    ``p`` sits in column ``p + offsets[row]``, and the columns before its start are masked.
    """

    k: torch.Tensor  # [B, capacity, Hkv, D]
    v: torch.Tensor
    positions: torch.Tensor  # [capacity] int64, -1 marks an empty slot
    full_attention: bool

    @property
    def capacity(self) -> int:
        return self.k.shape[1]

    def reset(self) -> None:
        """Empty the cache in place (buffers a CUDA graph captured stay valid)."""
        self.k.zero_()
        self.v.zero_()
        self.positions.fill_(-1)

    def rows(self, n: int) -> "AttentionCache":
        """A cache over the first ``n`` rows that shares this one's memory (and its positions)."""
        return AttentionCache(self.k[:n], self.v[:n], self.positions, self.full_attention)

    def append(self, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> None:
        """Store new keys/values at slots ``position % capacity`` (only the last ``capacity`` fit)."""
        if self.full_attention and int(positions[-1]) >= self.capacity:
            raise ValueError(f"full-attention cache holds {self.capacity} positions; position "
                             f"{int(positions[-1])} does not fit (make the cache with a larger max_length)")
        keep = min(k.shape[1], self.capacity)
        k, v, positions = k[:, -keep:], v[:, -keep:], positions[-keep:]
        slots = positions % self.capacity
        self.k[:, slots] = k.to(self.k.dtype)
        self.v[:, slots] = v.to(self.v.dtype)
        self.positions[slots] = positions


@dataclass
class AttentionStep:
    """A decode step's values shared by every attention layer (see :meth:`CausalSelfAttention.step_values`)."""

    column: torch.Tensor  # int64 0-d, the column every row writes this step
    slot: torch.Tensor  # int64 [1] ring slot ``column % capacity`` of the attention caches
    visible: torch.Tensor  # bool [B, capacity] cache slots each row attends to
    cos: torch.Tensor  # fp32 [B, head_size] RoPE tables at the rows' positions
    sin: torch.Tensor


class CausalSelfAttention(nn.Module):
    def __init__(self, config: Config, layer_idx: int = 0) -> None:
        super().__init__()
        c = config
        self.n_head, self.n_kv = c.n_head, c.n_query_groups
        self.head_size = c.head_size
        self.window = c.sliding_window
        self.rope_base = c.rope_base
        self.qkv = Linear(c.n_embd, (self.n_head + 2 * self.n_kv) * self.head_size, std=0.02)
        self.proj = Linear(self.n_head * self.head_size, c.n_embd, std=0.02 / math.sqrt(2 * c.n_layer))

    def init_cache(self, batch_size: int, device: torch.device, dtype: torch.dtype,
                   max_length: int) -> AttentionCache:
        cap = max_length if self.window is None else min(self.window, max_length)
        shape = (batch_size, cap, self.n_kv, self.head_size)
        return AttentionCache(torch.zeros(shape, device=device, dtype=dtype),
                              torch.zeros(shape, device=device, dtype=dtype),
                              torch.full((cap,), -1, device=device, dtype=torch.long),
                              full_attention=self.window is None)

    def step_values(self, cache: AttentionCache, column: torch.Tensor, offsets: torch.Tensor) -> AttentionStep:
        """What a decode step at ``column`` (int64 0-d) shares across the attention layers, from this layer's
        ``cache`` (every attention cache has the same ring layout and slot positions) and the rows' first
        columns ``offsets`` [B]. No host synchronisation."""
        positions = column - offsets
        slot = torch.remainder(column, cache.capacity).reshape(1)
        kpos = cache.positions.index_copy(0, slot, column.reshape(1))  # as after this step's write
        # every stored column is <= the current one; empty slots hold -1 < any offset
        visible = kpos[None, :] >= offsets[:, None]
        if self.window is not None:
            visible = visible & (column - kpos < self.window)[None, :]
        cos, sin = rope_tables(positions, self.head_size, self.rope_base)
        return AttentionStep(column, slot, visible, cos, sin)

    def forward(self, x: torch.Tensor, layout: TokenLayout, cache: Optional[AttentionCache] = None) -> torch.Tensor:
        """x: [B,T,d] -> [B,T,d]; ``layout.positions`` [T]: absolute positions (RoPE, cache slots).

        ``cache`` is updated in place. ``layout.packed`` (with an empty ``cache``): the prompts of a batch
        packed into one row; after attending as separate documents, each prompt's keys/values go to its
        cache row. ``layout.step`` (T == 1, with ``cache``): one token per row at the rows' own positions,
        through one op that rotates q and k, writes the ring slot and attends (``gdn2::ring_decode_attention``);
        no host synchronisation, so a CUDA graph can capture it.
        """
        B, T, _ = x.shape
        H, Hkv, D = self.n_head, self.n_kv, self.head_size
        positions, cu_seqlens, packed, step = layout.positions, layout.cu_seqlens, layout.packed, layout.step
        qkv = self.qkv(x)
        if step is not None:
            o = ring_decode_attention_op(qkv.reshape(B, -1), step.cos, step.sin, cache.k, cache.v, cache.positions,
                                         step.slot, step.column, step.visible, H)
            return self.proj(o.reshape(B, 1, H * D))
        cos, sin = rope_tables(positions, D, self.rope_base)
        # the Triton kernel where the pointwise operator's backend is Triton (CUDA), else the compiled stage
        q, k, v = rope_qkv(qkv, cos, sin, H, Hkv, torch_path=rope_qkv_stage)
        if packed is not None:
            if cache is None or cu_seqlens is None:
                raise ValueError("packed prompts need cu_seqlens and a cache to fill")
            o = sliding_window_attention(q, k, v, self.window, cu_seqlens=cu_seqlens)
            self._store_packed(cache, k[0], v[0], packed)
            return self.proj(o.reshape(B, T, H * D))
        if cache is None or (int(positions[0]) == 0 and bool((cache.positions < 0).all())):
            # training, or prefill into an empty cache: the fast kernel over the new tokens alone
            o = sliding_window_attention(q, k, v, self.window, cu_seqlens=cu_seqlens)
        else:
            if cu_seqlens is not None:
                raise ValueError("cu_seqlens cannot be combined with a decoding cache")
            # continued prefill: the cached keys, then the new ones, masked by position
            keys = torch.cat([cache.k.to(k.dtype), k], dim=1)
            values = torch.cat([cache.v.to(v.dtype), v], dim=1)
            kpos = torch.cat([cache.positions, positions])
            o = sliding_window_attention_reference(q, keys, values, self.window, q_positions=positions,
                                                   k_positions=kpos)
        if cache is not None:
            cache.append(k, v, positions)
        return self.proj(o.reshape(B, T, H * D))

    @staticmethod
    def _store_packed(cache: AttentionCache, k: torch.Tensor, v: torch.Tensor, packed: PackedPrompts) -> None:
        """Write packed keys/values k, v [total, Hkv, D] to the rows and columns ``packed`` assigns them.

        All prompts end in the same column, so the last ``capacity`` columns are those that stay
        visible; each of them maps to a distinct ring slot, shared by all rows."""
        columns = packed.columns
        if cache.full_attention and packed.num_columns > cache.capacity:
            raise ValueError(f"full-attention cache holds {cache.capacity} positions; the longest prompt has "
                             f"{packed.num_columns} tokens (make the cache with a larger max_length)")
        keep = columns >= packed.num_columns - cache.capacity
        rows, cols = packed.rows[keep], columns[keep]
        slots = cols % cache.capacity
        cache.k[rows, slots] = k[keep].to(cache.k.dtype)
        cache.v[rows, slots] = v[keep].to(cache.v.dtype)
        cache.positions[slots] = cols
