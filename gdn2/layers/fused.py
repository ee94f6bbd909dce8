"""The model's elementwise stages as plain tensor functions, compiled into fused kernels on demand.

Each function here is the one definition of its stage (norms, gates, SwiGLU on two tensors; the short
convolution's, RoPE's and the joint SwiGLU's are their operators' oracles, ``gdn2.ops.short_conv`` and
``gdn2.ops.pointwise``, whose Triton kernels the layers run on CUDA); the layers call them. Eagerly, each
is a handful of PyTorch kernels, several of them fp32 passes over activation-sized tensors. With
:func:`set_compiled` on (the trainer's ``train.compile``), calls on CUDA tensors go through
``torch.compile``'d twins instead: the forward and the backward of each stage become one or two fused
kernels. The values are the same up to fp32 rounding order.

The compiled twins are made lazily per function; calls made while an outer ``torch.compile`` is
tracing (the compiled decode step) use the plain function, which the outer compile then fuses itself,
and so do calls during a CUDA graph capture (a first compile there would launch its autotuning runs
into the graph).

Here too: the projections' autocast path (:func:`linear`, fp32 weight gradients straight from the GEMM)
and the grouped projections (:func:`grouped_linear`, :func:`project`).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Callable, Optional, TypeVar

import torch
import torch.nn.functional as F

from gdn2.ops import pointwise
from gdn2.ops.backend import select_backend
from gdn2.ops.checks import TRITON_DTYPES
from gdn2.ops.pointwise.naive import apply_rope_reference, rope_qkv_reference, swiglu_joined_reference
from gdn2.ops.short_conv.naive import short_conv_silu_reference

_compiled_enabled = False
_devices: tuple[str, ...] = ("cuda",)
_backend = "inductor"
_twins: dict[Callable, Callable] = {}  # plain function -> its compiled twin, made on first use
# graphs one stage may hold: a stage sees each of the model's projection shapes (the float8 GEMMs),
# with and without gradients (training, validation); torch's default of 8 would send the rest eager
RECOMPILE_LIMIT = 64

FnT = TypeVar("FnT", bound=Callable)


def set_compiled(enabled: bool, devices: tuple[str, ...] = ("cuda",), backend: str = "inductor") -> None:
    """Route the stages' calls on tensors of ``devices`` through their ``torch.compile``'d twins
    (process-wide; it also raises torch's per-function recompile limit to :data:`RECOMPILE_LIMIT`).
    ``backend`` is torch.compile's (the tests trace on the CPU with ``aot_eager``)."""
    global _compiled_enabled, _devices, _backend
    if (devices, backend) != (_devices, _backend):
        _twins.clear()
    _compiled_enabled, _devices, _backend = bool(enabled), tuple(devices), backend
    if enabled:
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)


def compiled_enabled() -> bool:
    return _compiled_enabled


def _traced_or_captured(x: torch.Tensor) -> bool:
    """Whether a call on x happens while an outer ``torch.compile`` traces or a CUDA graph captures
    (the decode step): there the plain torch form is what gets fused or captured."""
    return torch.compiler.is_compiling() or (x.is_cuda and torch.cuda.is_current_stream_capturing())


def runs_triton(op: str, x: torch.Tensor) -> bool:
    """Whether operator ``op``'s Triton kernels take x: a dtype they take, and Triton the backend
    ``gdn2.ops`` picks for x's device (CUDA by default)."""
    return x.dtype in TRITON_DTYPES and select_backend(op, x.device) == "triton"


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a matmul on ``x`` runs in: autocast's where it is on for x's device, else x's own."""
    return torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype


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
    weights, a float8 one where the first linear's ``float8`` spec is set (all of a group read the same
    input, so :meth:`gdn2.model.GPT.set_float8` marks all or none)."""
    if any(lin.bias is not None for lin in linears):
        raise ValueError("grouped projections take bias-free linears")
    weights = [lin.weight for lin in linears]
    spec = getattr(linears[0], "float8", None)
    if spec is not None:
        from gdn2.layers.float8 import float8_linear

        return float8_linear(x, tuple(weights), None, spec, compute_dtype(x))
    return _GroupedLinear.apply(x, *weights)


def project(x: torch.Tensor, linears: Sequence[torch.nn.Linear], grouped: bool) -> list[torch.Tensor]:
    """``[lin(x) for lin in linears]``; with ``grouped`` (bias-free linears, the layers'
    ``grouped_projections``), :func:`grouped_linear`'s output split into views."""
    if not grouped or len(linears) == 1:
        return [lin(x) for lin in linears]
    return list(grouped_linear(x, linears).split([lin.weight.shape[0] for lin in linears], dim=-1))


def fusable(fn: FnT) -> FnT:
    """``fn`` (tensor arguments first) runs compiled when :func:`set_compiled` is on and its first
    argument lives on one of the chosen devices (CUDA by default); otherwise as written."""

    @functools.wraps(fn)
    def call(*args, **kwargs):
        x = args[0]
        if _compiled_enabled and x.device.type in _devices and not _traced_or_captured(x):
            twin = _twins.get(fn)
            if twin is None:
                twin = _twins[fn] = torch.compile(fn, backend=_backend)
            return twin(*args, **kwargs)
        return fn(*args, **kwargs)

    call.eager = fn  # type: ignore[attr-defined]
    return call  # type: ignore[return-value]


@fusable
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: Optional[torch.dtype] = None
             ) -> torch.Tensor:
    """``x / rms(x) * weight`` over the last axis in fp32, returned in ``out_dtype`` (default x's)."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    return (y * weight.float()).to(out_dtype or x.dtype)


@fusable
def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float,
                 out_dtype: Optional[torch.dtype] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``s = x + delta`` and ``rms_norm(s)``: a residual add and the norm that reads it, one pass."""
    s = x + delta
    return s, rms_norm.eager(s, weight, eps, out_dtype)


@fusable
def gated_rms_norm(o: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Per-head RMSNorm of ``o`` [..., D] times ``silu(gate)``, in fp32, returned in o's dtype."""
    of = o.float()
    y = of * torch.rsqrt(of.square().mean(-1, keepdim=True) + eps) * weight.float()
    return (y * F.silu(gate.float())).to(o.dtype)


# the short convolution's one definition is its operator's oracle; this is its compiled torch path
causal_conv_silu = fusable(short_conv_silu_reference)


def decay_rate(A_log: torch.Tensor, head_k_dim: int) -> torch.Tensor:
    """``-exp(A_log)`` per key channel (fp32): each head's rate repeated over its ``head_k_dim`` channels."""
    return -A_log.float().exp().repeat_interleave(head_k_dim)


@fusable
def gdn2_gates(f: torch.Tensor, b: torch.Tensor, w: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
               head_k_dim: int, b_scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GDN-2 gates from their projections: decay ``g = -exp(A_log) * softplus(f + dt_bias)`` (fp32,
    A_log per head repeated over its ``head_k_dim`` key channels), erase gate ``b_scale * sigmoid(b)``
    and write gate ``sigmoid(w)``."""
    g = decay_rate(A_log, head_k_dim) * F.softplus(f.float() + dt_bias)
    b = torch.sigmoid(b)
    if b_scale != 1.0:
        b = b * b_scale
    return g, b, torch.sigmoid(w)


@fusable
def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up``."""
    return F.silu(gate) * up


# RoPE and the joined SwiGLU: their definitions are their operators' oracles (``gdn2.ops.pointwise``);
# these are the compiled torch paths, the Triton kernels run where that operator's backend is Triton
apply_rope = fusable(apply_rope_reference)
rope_qkv_stage = fusable(rope_qkv_reference)
swiglu_joined_stage = fusable(swiglu_joined_reference)


def _pointwise_kernels(x: torch.Tensor) -> bool:
    """Whether the row-wise stages run as ``gdn2.ops.pointwise``'s Triton kernels for x (CUDA by
    default) rather than as compiled torch code; never inside an outer compile's trace or a CUDA graph
    capture."""
    return x.numel() > 0 and runs_triton("pointwise", x) and not _traced_or_captured(x)


def rope_qkv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_head: int, n_kv: int
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Dense q [B,T,n_head,D], k, v [B,T,n_kv,D] from the attention's joint projection, q and k rotated
    (``gdn2.ops.pointwise.rope_qkv``): its backward writes the joint gradient whole."""
    if _pointwise_kernels(qkv):
        return pointwise.rope_qkv(qkv, cos, sin, n_head, n_kv, backend="triton")
    return rope_qkv_stage(qkv, cos, sin, n_head, n_kv)


def swiglu_joined(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of the MLP's joint projection [..., 2F] (``gdn2.ops.pointwise.swiglu_joined``):
    its backward writes the joint gradient whole."""
    if _pointwise_kernels(gate_up):
        return pointwise.swiglu_joined(gate_up, backend="triton")
    return swiglu_joined_stage(gate_up)
