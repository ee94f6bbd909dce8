"""The projections' matmuls: the autocast path (:func:`linear`: fp32 weight gradients straight from the
GEMM) and grouped projections (:func:`grouped_linear`, :func:`project`: the projections that read one
input as one GEMM), each in float8 where the linear carries a float8 spec (``gdn2.float8``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import torch
import torch.nn.functional as F

from gdn2.float8 import float8_linear
from gdn2.stages import compute_dtype


def _stacked(weights: Sequence[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """The weights one above the other in ``dtype``: each cast straight into its rows (one kernel per
    weight, no separate concatenation pass)."""
    out = torch.empty((sum(w.shape[0] for w in weights), weights[0].shape[1]), dtype=dtype,
                      device=weights[0].device)
    for w, rows in zip(weights, out.split([w.shape[0] for w in weights])):
        rows.copy_(w)
    return out


def weight_grad(dy: torch.Tensor, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``dy^T x`` over all leading axes ([out, in]: a linear's weight gradient) in ``dtype``: on CUDA
    with bf16 / fp16 operands and an fp32 ``dtype``, written in fp32 by the GEMM itself (cuBLAS
    accumulates in fp32 either way), so neither a rounding to bf16 nor a cast pass comes between the
    GEMM and the fp32 gradient; elsewhere the GEMM in the operands' dtype, then cast."""
    a, b = dy.reshape(-1, dy.shape[-1]).t(), x.reshape(-1, x.shape[-1])
    if a.is_cuda and dtype == torch.float32 and a.dtype in (torch.bfloat16, torch.float16):
        return torch.mm(a, b, out_dtype=dtype)
    return (a @ b).to(dtype)


class _AutocastLinear(torch.autograd.Function):
    """``F.linear`` in autocast's dtype, as autocast runs it (the weight and bias cast, the cast weight
    saved), except that the weight and bias gradients come out in the parameters' dtype straight from
    their reductions (:func:`weight_grad`) instead of through a cast of a bf16 gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                dtype: torch.dtype) -> torch.Tensor:
        x, w = x.to(dtype), weight.to(dtype)
        ctx.param_dtypes = (weight.dtype, None if bias is None else bias.dtype)
        ctx.save_for_backward(x, w)
        with torch.autocast(x.device.type, enabled=False):
            return F.linear(x, w, None if bias is None else bias.to(dtype))

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x, w = ctx.saved_tensors
        w_dtype, b_dtype = ctx.param_dtypes
        dy = dy.to(w.dtype)
        dx = dy @ w if ctx.needs_input_grad[0] else None
        dw = weight_grad(dy, x, w_dtype) if ctx.needs_input_grad[1] else None
        db = dy.reshape(-1, dy.shape[-1]).sum(0, dtype=b_dtype) if ctx.needs_input_grad[2] else None
        return dx, dw, db, None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``; under autocast, with gradients requested, through
    :class:`_AutocastLinear` (the same values; the parameters' gradients made in their own dtype)."""
    dtype = compute_dtype(x)
    if (not torch.is_autocast_enabled(x.device.type) or dtype == weight.dtype or not torch.is_grad_enabled()
            or torch.compiler.is_compiling()):
        return F.linear(x, weight, bias)
    return _AutocastLinear.apply(x, weight, bias, dtype)


class _GroupedLinear(torch.autograd.Function):
    """``x @ cat(weights).T``: one GEMM forward, one for dx and one for all dW. The weights are saved
    as themselves, not as their concatenation, so FSDP still frees them between forward and backward;
    the backward stacks them again."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, *weights: torch.Tensor) -> torch.Tensor:
        dtype = compute_dtype(x)
        ctx.dtype = dtype
        x = x.to(dtype)
        with torch.autocast(x.device.type, enabled=False):
            y = F.linear(x, _stacked(weights, dtype))
        ctx.save_for_backward(x, *weights)
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x, *weights = ctx.saved_tensors
        dy = dy.to(ctx.dtype)
        dx = None
        if ctx.needs_input_grad[0]:
            dx = dy @ _stacked(weights, ctx.dtype)
        dws: list = [None] * len(weights)
        if any(ctx.needs_input_grad[1:]):
            dw = weight_grad(dy, x, weights[0].dtype)
            dws = [g.to(w.dtype) for g, w in zip(dw.split([w.shape[0] for w in weights]), weights)]
        return (dx, *dws)


def grouped_linear(x: torch.Tensor, linears: Sequence[torch.nn.Linear]) -> torch.Tensor:
    """``cat([lin(x) for lin in linears], -1)`` (bias-free linears) as one GEMM over their stacked
    weights, a float8 one where the first linear's ``float8`` spec is set (:func:`project` groups only
    linears of one spec)."""
    if any(lin.bias is not None for lin in linears):
        raise ValueError("grouped projections take bias-free linears")
    weights = [lin.weight for lin in linears]
    spec = getattr(linears[0], "float8", None)
    if spec is not None:
        return float8_linear(x, tuple(weights), None, spec, compute_dtype(x))
    return _GroupedLinear.apply(x, *weights)


def project(x: torch.Tensor, linears: Sequence[torch.nn.Linear], grouped: bool) -> list[torch.Tensor]:
    """``[lin(x) for lin in linears]``; with ``grouped`` (bias-free linears, the layers'
    ``grouped_projections``), one :func:`grouped_linear` per float8 spec among them (one GEMM when they
    share it, as they do without float8; under float8 the projections a layer exempts, such as a gate per
    head of a few columns, get a GEMM of their own), split into views in the order given."""
    if not grouped or len(linears) == 1:
        return [lin(x) for lin in linears]
    by_spec: dict[int, list[int]] = {}
    for i, lin in enumerate(linears):
        by_spec.setdefault(id(getattr(lin, "float8", None)), []).append(i)
    outs: list = [None] * len(linears)
    for members in by_spec.values():
        group = [linears[i] for i in members]
        y = grouped_linear(x, group) if len(group) > 1 else group[0](x)
        for i, part in zip(members, y.split([lin.weight.shape[0] for lin in group], dim=-1)):
            outs[i] = part
    return outs
