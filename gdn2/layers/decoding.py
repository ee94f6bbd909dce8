"""What one decode step shares across layers, and its two in-place cache updates as custom ops.

``gdn2.inference.decode_step`` computes the RoPE tables and the attention mask once per step (every
attention layer has the same window, head size and ring-buffer layout) and hands them to the layers in
a :class:`DecodeContext`. The steps that write into the cache (attention with its key/value slot write,
the GDN-2 state) are registered as custom ops that declare what they mutate, so ``torch.compile`` sees
the whole step as one graph and still updates the cache in place, which a captured CUDA graph relies on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from gdn2.ops import fused_recurrent_gdn2, ring_decode_attention as ring_decode_attention_op


@dataclass
class DecodeContext:
    positions: torch.Tensor  # int64 [B] position of the new token in each row (RoPE)
    column: torch.Tensor  # int64 0-d, the column every row writes this step
    slot: Optional[torch.Tensor] = None  # int64 [1] ring slot ``column % capacity`` of the attention caches
    visible: Optional[torch.Tensor] = None  # bool [B, capacity] cache slots each row attends to
    cos: Optional[torch.Tensor] = None  # fp32 [B, head_size] RoPE tables at ``positions``
    sin: Optional[torch.Tensor] = None


@torch.library.custom_op("gdn2::ring_decode_attention", mutates_args=("k_cache", "v_cache", "positions"))
def ring_decode_attention(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                          v_cache: torch.Tensor, positions: torch.Tensor, slot: torch.Tensor, column: torch.Tensor,
                          visible: torch.Tensor, n_head: int) -> torch.Tensor:
    """The attention layer's decode step after its qkv projection: RoPE on q and k, the new key and
    value written to ring slot ``slot`` (and ``column`` to ``positions[slot]``), in place, and each row's
    query attending to the slots ``visible`` marks. qkv [B, (n_head + 2*Hkv) * D]; cos, sin fp32
    [B, D]; k_cache, v_cache [B, C, Hkv, D]; positions int64 [C]; slot int64 [1]; column int64 0-d;
    visible bool [B, C]. Returns o [B, n_head * D]. See ``gdn2.ops.decode_attention``."""
    return ring_decode_attention_op(qkv, cos, sin, k_cache, v_cache, positions, slot, column, visible, n_head)


@ring_decode_attention.register_fake
def _ring_decode_attention_fake(qkv, cos, sin, k_cache, v_cache, positions, slot, column, visible,
                                n_head) -> torch.Tensor:
    return qkv.new_empty(qkv.shape[0], n_head * k_cache.shape[-1])


@torch.library.custom_op("gdn2::recurrent_decode", mutates_args=("state",))
def recurrent_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, b: torch.Tensor,
                     w: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """GDN-2 over a few tokens with the recurrent kernel (q, k L2-normalised inside): q, k, g, b
    [B,T,H,K]; v, w [B,T,HV,V]; state fp32 [B,HV,K,V] advanced in place. Returns o [B,T,HV,V] in
    q's dtype."""
    o, _ = fused_recurrent_gdn2(q, k, v, g, b, w, initial_state=state, use_qk_l2norm_in_kernel=True,
                                inplace_final_state=True)
    return o


@recurrent_decode.register_fake
def _recurrent_decode_fake(q, k, v, g, b, w, state) -> torch.Tensor:
    return q.new_empty(v.shape)
