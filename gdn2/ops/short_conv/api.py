"""The short-convolution entry point: the contract, and backend dispatch (``gdn2.ops.backend``).

The Triton module is imported on the first Triton call, so this module imports without Triton.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from gdn2.ops.backend import select_backend
from gdn2.ops.checks import check_tensors, check_triton_dtypes


def check_short_conv_inputs(x, weight, pos_in_doc) -> None:
    """Raise ValueError for inputs outside the contract."""
    check_tensors({"x": x, "weight": weight}, 3, "(x [B, T, C], weight [C, 1, kernel_size])")
    C = x.shape[2]
    if weight.shape[:2] != (C, 1):
        raise ValueError(f"weight must be [C, 1, kernel_size] with C={C}, got {tuple(weight.shape)}")
    if x.stride(2) != 1:
        raise ValueError(f"x must have contiguous channels (stride 1 on the last axis), got strides {x.stride()}")
    if pos_in_doc is not None:
        if (not isinstance(pos_in_doc, torch.Tensor) or pos_in_doc.shape != (x.shape[1],)
                or pos_in_doc.is_floating_point() or pos_in_doc.dtype == torch.bool):
            described = (f"{pos_in_doc.dtype} {tuple(pos_in_doc.shape)}" if isinstance(pos_in_doc, torch.Tensor)
                         else type(pos_in_doc).__name__)
            raise ValueError(f"pos_in_doc must be an integer tensor [T] = [{x.shape[1]}], got {described}")
        if pos_in_doc.device != x.device:
            raise ValueError(f"pos_in_doc is on {pos_in_doc.device}, x on {x.device}: all inputs must share a device")


def short_conv_silu(x: torch.Tensor, weight: torch.Tensor, pos_in_doc: Optional[torch.Tensor] = None,
                    backend: Optional[str] = None, torch_path: Optional[Callable[..., torch.Tensor]] = None
                    ) -> torch.Tensor:
    """``silu(causal depthwise conv(x))`` with zeros before the start: x [B, T, C] (any strides with
    the channels contiguous, e.g. a slice of a wider projection), weight [C, 1, ks] (oldest tap
    first), ``pos_in_doc`` int [T] (each token's position inside its document; taps reaching before a
    document's start contribute nothing). Returns a contiguous [B, T, C] in x's dtype, accumulated in
    fp32; differentiable in x and weight. See ``naive.short_conv_silu_reference`` for the math.
    ``torch_path``: what runs on the torch backend in place of that oracle, with its arguments (the
    layers pass its compiled twin, ``gdn2.stages.causal_conv_silu``)."""
    check_short_conv_inputs(x, weight, pos_in_doc)
    if select_backend("short_conv", x.device, backend, x.dtype) == "triton":
        check_triton_dtypes({"x": x, "weight": weight})
        from gdn2.ops.short_conv.conv import short_conv_silu_triton

        return short_conv_silu_triton(x, weight, pos_in_doc)
    from gdn2.ops.short_conv.naive import short_conv_silu_reference

    return (torch_path or short_conv_silu_reference)(x, weight, None, pos_in_doc)
