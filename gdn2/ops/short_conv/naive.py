"""The torch oracle of the short convolution (also the layer's torch path, see ``gdn2.stages``)."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


def short_conv_silu_reference(x: torch.Tensor, weight: torch.Tensor, tail: Optional[torch.Tensor] = None,
                              pos_in_doc: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``silu`` of the causal depthwise convolution of x [B, T, C] with taps ``weight`` [C, 1, ks]
    (oldest first), as shifted products summed in fp32: ``y_t = sum_j weight[:, 0, ks-1-j] * x_{t-j}``.

    ``tail`` [B, ks-1, C]: the inputs before x (zeros when None). ``pos_in_doc`` [T]: each token's
    position inside its document; a tap reaching before the document start contributes nothing."""
    B, T, C = x.shape
    ks = weight.shape[-1]
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    w = weight[:, 0, :].to(x.dtype).to(acc)  # [C, ks]; the taps rounded to x's dtype, as a conv in it would
    full = F.pad(x, (0, 0, ks - 1, 0)) if tail is None else torch.cat([tail.to(x.dtype), x], dim=1)
    y = x.to(acc) * w[:, ks - 1]
    for j in range(1, ks):
        term = full[:, ks - 1 - j: ks - 1 - j + T].to(acc) * w[:, ks - 1 - j]
        if pos_in_doc is not None:
            term = term * (pos_in_doc >= j).to(acc)[None, :, None]
        y = y + term
    return F.silu(y).to(x.dtype)
