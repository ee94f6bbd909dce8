"""The decode-attention entry point: the contract both implementations check, and backend dispatch
(``gdn2.ops.backend``). See ``ring.py`` for what the operator does.

The Triton module is imported on the first Triton call, so this module (and ``gdn2.ops``) imports
without Triton.
"""

from __future__ import annotations

from typing import Optional

import torch

from gdn2.ops.backend import select_backend


def check_decode_inputs(qkv, cos, sin, k_cache, v_cache, positions, slot, visible,
                        n_head) -> tuple[int, int, int, int, int]:
    """Raise ValueError for inputs outside the contract; else (B, C, Hkv, D, query heads per key/value head)."""
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(f"k_cache and v_cache must both be [B, capacity, Hkv, D], got {tuple(k_cache.shape)} "
                         f"and {tuple(v_cache.shape)}")
    B, C, Hkv, D = k_cache.shape
    if n_head % Hkv:
        raise ValueError(f"n_head={n_head} is not a multiple of the {Hkv} key/value heads")
    if qkv.shape != (B, (n_head + 2 * Hkv) * D):
        raise ValueError(f"qkv must be [B, (n_head + 2*Hkv) * D] = [{B}, {(n_head + 2 * Hkv) * D}], "
                         f"got {tuple(qkv.shape)}")
    if cos.shape != (B, D) or sin.shape != (B, D):
        raise ValueError(f"cos and sin must be [B, D] = [{B}, {D}], got {tuple(cos.shape)}, {tuple(sin.shape)}")
    if D % 2:
        raise ValueError(f"rotate-half RoPE needs an even head size, got {D}")
    if positions.shape != (C,) or slot.numel() != 1 or visible.shape != (B, C):
        raise ValueError(f"positions [C], slot [1] and visible [B, C] expected for C={C}, got "
                         f"{tuple(positions.shape)}, {tuple(slot.shape)}, {tuple(visible.shape)}")
    return B, C, Hkv, D, n_head // Hkv


def ring_decode_attention(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                          v_cache: torch.Tensor, positions: torch.Tensor, slot: torch.Tensor, column: torch.Tensor,
                          visible: torch.Tensor, n_head: int, backend: Optional[str] = None) -> torch.Tensor:
    """One new token per row: RoPE on its q and k, its key and value written to ring slot ``slot`` of
    the caches (and ``column`` to ``positions[slot]``), in place, and its queries attending to the slots
    ``visible`` marks. qkv [B, (n_head + 2*Hkv) * D]; cos, sin fp32 [B, D]; k_cache, v_cache
    [B, C, Hkv, D]; positions int64 [C]; slot int64 [1]; column int64 0-d; visible bool [B, C].
    Returns o [B, n_head * D] in qkv's dtype."""
    if select_backend("decode_attention", qkv.device, backend, qkv.dtype) == "triton":
        from gdn2.ops.decode_attention.ring import ring_decode_attention_triton

        return ring_decode_attention_triton(qkv, cos, sin, k_cache, v_cache, positions, slot, column, visible,
                                            n_head)
    from gdn2.ops.decode_attention.naive import ring_decode_attention_reference

    return ring_decode_attention_reference(qkv, cos, sin, k_cache, v_cache, positions, slot, column, visible,
                                           n_head)


# Registered as a custom op that declares what it writes, so that ``torch.compile`` sees a decode step
# as one graph and still updates the cache in place, which a captured CUDA graph relies on.
@torch.library.custom_op("gdn2::ring_decode_attention", mutates_args=("k_cache", "v_cache", "positions"))
def ring_decode_attention_op(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                             v_cache: torch.Tensor, positions: torch.Tensor, slot: torch.Tensor, column: torch.Tensor,
                             visible: torch.Tensor, n_head: int) -> torch.Tensor:
    """:func:`ring_decode_attention` (default backend) as the custom op ``gdn2::ring_decode_attention``."""
    return ring_decode_attention(qkv, cos, sin, k_cache, v_cache, positions, slot, column, visible, n_head)


@ring_decode_attention_op.register_fake
def _ring_decode_attention_fake(qkv, cos, sin, k_cache, v_cache, positions, slot, column, visible,
                                n_head) -> torch.Tensor:
    return qkv.new_empty(qkv.shape[0], n_head * k_cache.shape[-1])
