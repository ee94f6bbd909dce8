"""Argument checks shared by the operator entry points: each raises ValueError naming the argument.

They run before any backend, read no tensor values on the device except ``cu_seqlens`` (whose offsets
the launch needs on the host anyway), and so add no host synchronisation to a training step.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from typing import Optional

import torch

# Dtypes the Triton kernels take; float64 runs on the torch path only (backend="torch").
TRITON_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def device_of(name: str, t) -> torch.device:
    """The device of tensor argument ``name`` (which picks the backend), or a ValueError naming it."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a tensor, got {type(t).__name__}")
    return t.device


def check_tensors(named: Mapping[str, object], rank: int, layout: str) -> None:
    """Every value a floating tensor of ``rank`` dimensions on one device, none of them empty."""
    device = None
    for name, t in named.items():
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a tensor, got {type(t).__name__}")
        if t.dim() != rank:
            raise ValueError(f"{name} must have rank {rank} {layout}, got shape {tuple(t.shape)}")
        if not t.is_floating_point():
            raise ValueError(f"{name} must be a floating tensor, got {t.dtype}")
        if t.numel() == 0:
            raise ValueError(f"{name} must not be empty, got shape {tuple(t.shape)}")
        if device is None:
            device, first = t.device, name
        elif t.device != device:
            raise ValueError(f"{name} is on {t.device}, {first} on {device}: all inputs must share a device")


def check_triton_dtypes(named: Mapping[str, torch.Tensor]) -> None:
    for name, t in named.items():
        if t.dtype not in TRITON_DTYPES:
            raise ValueError(f"{name} is {t.dtype}, which the Triton kernels do not take (float32, float16, "
                             f"bfloat16); use backend='torch' for {t.dtype}")


def check_scale(scale) -> None:
    """``scale`` is None (the default) or a finite real number."""
    if scale is None:
        return
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not math.isfinite(float(scale)):
        raise ValueError(f"scale must be a finite number or None, got {scale!r}")


def check_cu_seqlens(cu_seqlens, batch: int, length: int) -> Optional[int]:
    """The number of packed sequences ``cu_seqlens`` describes (None when it is None)."""
    if cu_seqlens is None:
        return None
    if (not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.is_floating_point()
            or cu_seqlens.is_complex() or cu_seqlens.dtype == torch.bool):
        described = (f"{cu_seqlens.dtype} of shape {tuple(cu_seqlens.shape)}" if isinstance(cu_seqlens, torch.Tensor)
                     else type(cu_seqlens).__name__)
        raise ValueError(f"cu_seqlens must be a 1-D integer tensor [N+1], got {described}")
    if batch != 1:
        raise ValueError(f"cu_seqlens requires batch size 1, got B={batch}")
    if cu_seqlens.numel() < 2:
        raise ValueError("cu_seqlens must hold at least two offsets")
    cu = cu_seqlens.tolist()
    if cu[0] != 0 or cu[-1] != length:
        raise ValueError(f"cu_seqlens must start at 0 and end at T={length}, got {cu[0]} .. {cu[-1]}")
    if any(a >= c for a, c in zip(cu[:-1], cu[1:])):
        raise ValueError("cu_seqlens must be strictly increasing")
    return len(cu) - 1


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
