"""The torch oracles of the row-wise stages (also their CPU path, see ``gdn2.stages``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def apply_rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B,T,H,D]; cos, sin: [T,D]. Rotate-half RoPE computed in fp32 (fp64 for fp64 x), returned in
    x's dtype."""
    xf = x.float() if x.dtype != torch.float64 else x
    half = x.shape[-1] // 2
    rotated = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
    cos, sin = cos[None, :, None, :].to(xf.dtype), sin[None, :, None, :].to(xf.dtype)
    return (xf * cos + rotated * sin).to(x.dtype)


def rope_qkv_reference(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_head: int, n_kv: int
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [B,T,n_head,D], k and v [B,T,n_kv,D] from the joint projection qkv [B,T,(n_head + 2 n_kv) D]:
    q and k rotated (:func:`apply_rope_reference`), v a dense copy."""
    B, T, C = qkv.shape
    D = C // (n_head + 2 * n_kv)
    q, k, v = qkv.split([n_head * D, n_kv * D, n_kv * D], dim=-1)
    q = apply_rope_reference(q.reshape(B, T, n_head, D), cos, sin)
    k = apply_rope_reference(k.reshape(B, T, n_kv, D), cos, sin)
    return q, k, v.reshape(B, T, n_kv, D).contiguous()


def swiglu_joined_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of one tensor whose last axis is gate then up."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
