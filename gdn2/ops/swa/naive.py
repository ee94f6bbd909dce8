"""Plain-PyTorch oracles of sliding-window attention; also its CPU execution path.

Layout ``[B, T, H, D]`` for q, ``[B, T, Hkv, D]`` for k and v (H a multiple of Hkv; query head ``h``
uses key/value head ``h // (H // Hkv)``). Query ``i`` sees keys ``j`` with ``i - window < j <= i``;
``window=None`` is full causal attention. Both functions support autograd through q, k and v.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


def _expand_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    return x if x.shape[2] == heads else x.repeat_interleave(heads // x.shape[2], dim=2)


def _document_ids(cu_seqlens: torch.Tensor, n: int, device: torch.device) -> torch.Tensor:
    """int64 [n]: the packed document of each of the first ``n`` tokens."""
    doc = torch.zeros(n, dtype=torch.long, device=device)
    doc[cu_seqlens[1:-1].long()] = 1
    return doc.cumsum(0)


def sliding_window_attention_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: Optional[int], scale: Optional[float] = None,
    cu_seqlens: Optional[torch.Tensor] = None, q_positions: Optional[torch.Tensor] = None,
    k_positions: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Causal attention where a query at position i sees keys j with ``i - window < j <= i``.

    q: [B,Tq,H,D]; k, v: [B,Tk,Hkv,D] with H a multiple of Hkv; ``window=None`` is full causal.
    ``cu_seqlens`` (B == 1) keeps packed documents apart. ``q_positions`` / ``k_positions`` ([Tq],
    [Tk] or [B,Tq], [B,Tk]; default ``arange``) give absolute positions, for decoding against a cache;
    a key position < 0 marks an empty cache slot. Computed in fp32 (float64 for float64 inputs);
    returns q's dtype. A query that sees no key (impossible without padding) gets zeros.
    """
    B, Tq, H, D = q.shape
    Tk = k.shape[1]
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    if scale is None:
        scale = D ** -0.5
    qf = q.to(compute).transpose(1, 2)  # [B,H,Tq,D]
    kf = _expand_heads(k, H).to(compute).transpose(1, 2)
    vf = _expand_heads(v, H).to(compute).transpose(1, 2)
    dev = q.device
    qp = torch.arange(Tq, device=dev) if q_positions is None else q_positions.to(dev)
    kp = torch.arange(Tk, device=dev) if k_positions is None else k_positions.to(dev)
    qp = qp.view(-1, Tq, 1) if qp.dim() == 2 else qp.view(1, Tq, 1)
    kp = kp.view(-1, 1, Tk) if kp.dim() == 2 else kp.view(1, 1, Tk)
    mask = (kp <= qp) & (kp >= 0)
    if window is not None:
        mask = mask & (qp - kp < window)
    if cu_seqlens is not None:
        doc = _document_ids(cu_seqlens, Tk, dev)
        mask = mask & (doc[qp.view(-1)].view(1, Tq, 1) == doc[kp.view(-1)].view(1, 1, Tk))
    scores = (qf @ kf.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~mask[:, None], float("-inf"))
    p = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    return (p @ vf).transpose(1, 2).to(q.dtype)


def sliding_window_attention_torch(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: Optional[int], scale: Optional[float] = None,
    cu_seqlens: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """The same function through ``F.scaled_dot_product_attention`` with a boolean mask (fast on CPU)."""
    B, T, H, D = q.shape
    if q.dtype == torch.float64:
        return sliding_window_attention_reference(q, k, v, window, scale, cu_seqlens)
    i = torch.arange(T, device=q.device)
    mask = i[None, :] <= i[:, None]
    if window is not None:
        mask = mask & (i[:, None] - i[None, :] < window)
    if cu_seqlens is not None:
        doc = _document_ids(cu_seqlens, T, q.device)
        mask = mask & (doc[:, None] == doc[None, :])
    qt, kt, vt = (x.transpose(1, 2) for x in (q, _expand_heads(k, H), _expand_heads(v, H)))
    o = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=scale)
    return o.transpose(1, 2)
