"""Plain-PyTorch oracle of the decode-attention operator; also its CPU execution path.

Five steps where the kernel does one pass: split ``qkv`` into heads, rotate q and k (rotate-half RoPE in
fp32, rounded back to the activations' dtype), write the new key and value into ring slot ``slot`` (and
the column into ``positions[slot]``), and attend with ``F.scaled_dot_product_attention`` under the
``visible`` mask.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from gdn2.ops.checks import check_decode_inputs


def _rope_rows(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B,1,heads,D], cos/sin [B,D]: rotate-half RoPE in fp32 (float64 stays), back in x's dtype."""
    xf = x.float() if x.dtype != torch.float64 else x
    half = x.shape[-1] // 2
    rotated = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
    cos, sin = cos[:, None, None, :].to(xf.dtype), sin[:, None, None, :].to(xf.dtype)
    return (xf * cos + rotated * sin).to(x.dtype)


def ring_decode_attention_reference(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                                    k_cache: torch.Tensor, v_cache: torch.Tensor, positions: torch.Tensor,
                                    slot: torch.Tensor, column: torch.Tensor, visible: torch.Tensor,
                                    n_head: int) -> torch.Tensor:
    """Plain torch: the same contract as ``ring.ring_decode_attention_triton`` (caches updated in place).

    qkv [B, (n_head + 2*Hkv) * D]; cos, sin [B, D]; k_cache, v_cache [B, C, Hkv, D]; positions int64
    [C]; slot int64 [1]; column int64 0-d; visible bool [B, C]. Returns o [B, n_head * D] in qkv's dtype.
    """
    B, C, Hkv, D, _ = check_decode_inputs(qkv, cos, sin, k_cache, v_cache, positions, slot, visible, n_head)
    H = n_head
    q, k, v = qkv.reshape(B, 1, -1).split([H * D, Hkv * D, Hkv * D], dim=-1)
    q, k, v = q.reshape(B, 1, H, D), k.reshape(B, 1, Hkv, D), v.reshape(B, 1, Hkv, D)
    q, k = _rope_rows(q, cos, sin), _rope_rows(k, cos, sin)
    k_cache.index_copy_(1, slot, k.to(k_cache.dtype))
    v_cache.index_copy_(1, slot, v.to(v_cache.dtype))
    positions.index_copy_(0, slot, column.reshape(1))
    o = F.scaled_dot_product_attention(
        q.transpose(1, 2), k_cache.to(q.dtype).transpose(1, 2), v_cache.to(q.dtype).transpose(1, 2),
        attn_mask=visible[:, None, None, :], enable_gqa=Hkv != H)
    return o.transpose(1, 2).reshape(B, H * D)
