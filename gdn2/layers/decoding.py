"""What one decode step shares across layers, and its two in-place cache updates as custom ops.

``GPT.decode_step`` computes the RoPE tables and the attention mask once per step (every attention
layer has the same window, head size and ring-buffer layout) and hands them to the layers in a
:class:`DecodeContext`. The steps that write into the cache (a key/value slot, the GDN-2 state) are
registered as custom ops that declare what they mutate, so ``torch.compile`` sees the whole step as one
graph and still updates the cache in place, which a captured CUDA graph relies on.

:func:`optimizer_step_count` lets the fused decode-time weight copies (``gdn2.model.DecodeWeights``)
notice optimizer steps that bypass version counters (fused optimizers).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from gdn2.ops import fused_recurrent_gdn2


_optimizer_steps = 0
_step_hook = None


def _count_optimizer_step(optimizer, args, kwargs) -> None:
    global _optimizer_steps
    _optimizer_steps += 1


def optimizer_step_count() -> int:
    """How many ``torch.optim`` optimizer steps this process has taken since the first call.

    The first call registers a global post-step hook (an integer increment per step). Fused optimizers
    (``AdamW(fused=True)``, the trainer's default on CUDA) write the parameters without bumping their
    version counters, so this count is how copies of the weights learn that they may be stale.
    """
    global _step_hook
    if _step_hook is None:
        _step_hook = register_optimizer_step_post_hook(_count_optimizer_step)
    return _optimizer_steps


@dataclass
class DecodeContext:
    positions: torch.Tensor  # int64 [B] position of the new token in each row (RoPE)
    column: torch.Tensor  # int64 0-d, the column every row writes this step
    slot: Optional[torch.Tensor] = None  # int64 [1] ring slot ``column % capacity`` of the attention caches
    visible: Optional[torch.Tensor] = None  # bool [B, capacity] cache slots each row attends to
    cos: Optional[torch.Tensor] = None  # fp32 [B, head_size] RoPE tables at ``positions``
    sin: Optional[torch.Tensor] = None


@torch.library.custom_op("gdn2::write_kv_slot", mutates_args=("k_cache", "v_cache", "positions"))
def write_kv_slot(k_cache: torch.Tensor, v_cache: torch.Tensor, positions: torch.Tensor, slot: torch.Tensor,
                  column: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """k_cache, v_cache: [B, capacity, Hkv, D]; positions: int64 [capacity]; slot: int64 [1];
    column: int64 0-d; k, v: [B, 1, Hkv, D]. Writes k, v and the column at ``slot``, in place."""
    k_cache.index_copy_(1, slot, k.to(k_cache.dtype))
    v_cache.index_copy_(1, slot, v.to(v_cache.dtype))
    positions.index_copy_(0, slot, column.reshape(1))


@write_kv_slot.register_fake
def _write_kv_slot_fake(k_cache, v_cache, positions, slot, column, k, v) -> None:
    return None


@torch.library.custom_op("gdn2::recurrent_decode", mutates_args=("state",))
def recurrent_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, b: torch.Tensor,
                     w: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """One GDN-2 step with the recurrent kernel (q, k L2-normalised inside): q, k, g, b [B,1,H,K];
    v, w [B,1,HV,V]; state fp32 [B,HV,K,V] advanced in place. Returns o [B,1,HV,V] in q's dtype."""
    o, _ = fused_recurrent_gdn2(q, k, v, g, b, w, initial_state=state, use_qk_l2norm_in_kernel=True,
                                inplace_final_state=True)
    return o


@recurrent_decode.register_fake
def _recurrent_decode_fake(q, k, v, g, b, w, state) -> torch.Tensor:
    return q.new_empty(v.shape)
