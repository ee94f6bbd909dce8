"""The sliding-window attention entry point: input validation and backend dispatch
(``gdn2.ops.backend``: flash-attn, our Triton kernels or the torch path).

The Triton modules are imported on the first Triton call, so this module (and ``gdn2.ops``) imports
without Triton.
"""

from __future__ import annotations

from typing import Optional

import torch

from gdn2.ops.backend import select_backend
from gdn2.ops.checks import check_cu_seqlens, device_of, check_scale, check_tensors, check_triton_dtypes
from gdn2.ops.swa.naive import sliding_window_attention_torch


def check_swa_inputs(q, k, v, window, scale, cu_seqlens, torch_path: bool) -> None:
    """Raise ValueError naming the argument for any input the attention operator cannot take."""
    named = dict(q=q, k=k, v=v)
    check_tensors(named, 4, "[B, T, H, D]")
    B, T, H, D = q.shape
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if k.shape[0] != B or k.shape[1] != T or k.shape[3] != D:
        raise ValueError(f"k must be [B={B}, T={T}, Hkv, D={D}], got {tuple(k.shape)}")
    if H % k.shape[2] != 0:
        raise ValueError(f"q heads ({H}) must be a multiple of k/v heads ({k.shape[2]})")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k and v must share a dtype, got {q.dtype}, {k.dtype} and {v.dtype}")
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"window must be a positive int (keys seen, the query included) or None, got {window!r}")
    check_scale(scale)
    check_cu_seqlens(cu_seqlens, B, T)
    if not torch_path:
        check_triton_dtypes(named)


def sliding_window_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: Optional[int], scale: Optional[float] = None,
    cu_seqlens: Optional[torch.Tensor] = None, backend: Optional[str] = None,
) -> torch.Tensor:
    """Causal sliding-window attention.

    q: [B,T,H,D]; k, v: [B,T,Hkv,D] (H a multiple of Hkv). ``window`` is the number of keys a query
    sees, itself included: query i attends to keys j with ``i - window < j <= i`` (flash-attn
    ``window_size=(window - 1, 0)``); ``window=None`` is full causal attention. ``cu_seqlens`` (int32
    [N+1], B == 1) keeps packed documents apart. ``scale`` defaults to D**-0.5. Returns [B,T,H,D] in
    q's dtype.
    """
    be = select_backend("swa", device_of("q", q), backend, q.dtype)
    check_swa_inputs(q, k, v, window, scale, cu_seqlens, torch_path=be == "torch")
    if be == "flash":
        if q.dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"q is {q.dtype}; flash-attn takes float16 or bfloat16 (use backend='triton')")
        return _flash_attn(q, k, v, window, scale, cu_seqlens)
    if be == "triton":
        from gdn2.ops.swa.attention import sliding_window_attention_triton

        return sliding_window_attention_triton(q, k, v, window, scale, cu_seqlens)
    return sliding_window_attention_torch(q, k, v, window, scale, cu_seqlens)


def _flash_attn(q, k, v, window, scale, cu_seqlens):
    from flash_attn import flash_attn_func, flash_attn_varlen_func

    ws = (-1, 0) if window is None else (window - 1, 0)
    if cu_seqlens is None:
        return flash_attn_func(q, k, v, softmax_scale=scale, causal=True, window_size=ws)
    cu = cu_seqlens.to(torch.int32)
    max_len = int((cu[1:] - cu[:-1]).max())
    o = flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, max_len, max_len, softmax_scale=scale,
                               causal=True, window_size=ws)
    return o.unsqueeze(0)
