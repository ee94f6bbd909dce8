"""The row-wise stages' entry points: the contracts, and backend dispatch (``gdn2.ops.backend``,
operator ``pointwise``). The Triton module is imported on the first Triton call.

Unless the ``backend=`` argument asks for Triton, a call made while an outer ``torch.compile`` traces or
a CUDA graph captures, or on an empty tensor, takes the torch path: the torch form is what such a trace
fuses or such a capture records. ``torch_path`` replaces the oracle there (the layers pass its compiled
twin from ``gdn2.stages``)."""

from __future__ import annotations

from typing import Callable, Optional

import torch

from gdn2.ops.backend import select_backend, traced_or_captured
from gdn2.ops.checks import check_tensors, check_triton_dtypes


def check_rope_qkv_inputs(qkv, cos, sin, n_head, n_kv) -> None:
    """Raise ValueError naming the argument for inputs outside the contract."""
    check_tensors({"qkv": qkv}, 3, "[B, T, (n_head + 2 n_kv) D]")
    for name, n in (("n_head", n_head), ("n_kv", n_kv)):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"{name} must be a positive int, got {n!r}")
    heads = n_head + 2 * n_kv
    T, C = qkv.shape[1], qkv.shape[2]
    if C % heads or (C // heads) % 2:
        raise ValueError(f"qkv's last axis ({C}) must be (n_head + 2 n_kv) = {heads} heads of an even size")
    D = C // heads
    for name, t in (("cos", cos), ("sin", sin)):
        if not isinstance(t, torch.Tensor) or t.shape != (T, D):
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name} must be a [T, D] = [{T}, {D}] table, got {got}")
        if t.device != qkv.device:
            raise ValueError(f"{name} is on {t.device}, qkv on {qkv.device}: all inputs must share a device")


def _triton(x: torch.Tensor, backend: Optional[str]) -> bool:
    if select_backend("pointwise", x.device, backend, x.dtype) != "triton":
        return False
    return backend == "triton" or (x.numel() > 0 and not traced_or_captured(x))


def rope_qkv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_head: int, n_kv: int,
             backend: Optional[str] = None, torch_path: Optional[Callable[..., tuple]] = None
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [B,T,n_head,D], k and v [B,T,n_kv,D] (dense, qkv's dtype) from the attention's joint
    projection qkv [B,T,(n_head + 2 n_kv) D] (channels contiguous; rows may be strided): q and k
    rotated by the rotate-half RoPE tables ``cos``, ``sin`` [T, D] in fp32, v copied. Differentiable
    in qkv. See ``naive.rope_qkv_reference`` for the math."""
    check_rope_qkv_inputs(qkv, cos, sin, n_head, n_kv)
    if _triton(qkv, backend):
        check_triton_dtypes({"qkv": qkv})
        from gdn2.ops.pointwise.kernels import rope_qkv_triton

        return rope_qkv_triton(qkv, cos, sin, n_head, n_kv)
    from gdn2.ops.pointwise.naive import rope_qkv_reference

    return (torch_path or rope_qkv_reference)(qkv, cos, sin, n_head, n_kv)


def swiglu_joined(gate_up: torch.Tensor, backend: Optional[str] = None,
                  torch_path: Optional[Callable[[torch.Tensor], torch.Tensor]] = None) -> torch.Tensor:
    """``silu(gate) * up`` for gate_up [..., 2F] (gate then up on the last axis), in fp32, returned
    [..., F] in gate_up's dtype; differentiable. See ``naive.swiglu_joined_reference``."""
    if not isinstance(gate_up, torch.Tensor) or gate_up.dim() < 1 or gate_up.shape[-1] % 2:
        got = tuple(gate_up.shape) if isinstance(gate_up, torch.Tensor) else type(gate_up).__name__
        raise ValueError(f"gate_up must be a tensor [..., 2F] (gate then up), got {got}")
    if _triton(gate_up, backend):
        check_triton_dtypes({"gate_up": gate_up})
        from gdn2.ops.pointwise.kernels import swiglu_joined_triton

        return swiglu_joined_triton(gate_up)
    from gdn2.ops.pointwise.naive import swiglu_joined_reference

    return (torch_path or swiglu_joined_reference)(gate_up)
