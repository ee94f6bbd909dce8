"""The decode-attention entry point: backend dispatch (the contract both implementations check is
``gdn2.ops.checks.check_decode_inputs``; ``gdn2.ops.backend`` picks the backend). See ``ring.py`` for what the
operator does.

The Triton module is imported on the first Triton call, so this module (and ``gdn2.ops``) imports
without Triton.
"""

from __future__ import annotations

from typing import Optional

import torch

from gdn2.ops.backend import select_backend


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
