"""The model's elementwise stages as plain tensor functions, compiled into fused kernels on demand.

Each function here is the one definition of its stage (norms, gates, SwiGLU on two tensors; the short
convolution's, RoPE's and the joint SwiGLU's are their operators' oracles, ``gdn2.ops.short_conv`` and
``gdn2.ops.pointwise``, whose Triton kernels the operators run where their backend is Triton, with the
stage here as their torch path); the layers call them. Eagerly, each is a handful of PyTorch kernels,
several of them fp32 passes over activation-sized tensors. With compilation on (``train.compile``,
applied by :func:`gdn2.options.apply_options` through :func:`set_compiled`), calls on CUDA tensors go
through ``torch.compile``'d twins instead: the forward and the backward of each stage become one or
two fused kernels. The values are the same up to fp32 rounding order.

The switch is process-wide because the twins are: one compiled graph set per function, shared by every
model in the process. They are made lazily; calls made while an outer ``torch.compile`` is tracing (the
compiled decode step) use the plain function, which the outer compile then fuses itself, and so do calls
during a CUDA graph capture (a first compile there would launch its autotuning runs into the graph).
"""

from __future__ import annotations

import functools
from typing import Callable, Optional, TypeVar

import torch
import torch.nn.functional as F

from gdn2.ops.backend import traced_or_captured
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


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a matmul on ``x`` runs in: autocast's where it is on for x's device, else x's own."""
    return torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype


def fusable(fn: FnT) -> FnT:
    """``fn`` (tensor arguments first) runs compiled when :func:`set_compiled` is on and its first
    argument lives on one of the chosen devices (CUDA by default); otherwise as written."""

    @functools.wraps(fn)
    def call(*args, **kwargs):
        x = args[0]
        if _compiled_enabled and x.device.type in _devices and not traced_or_captured(x):
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


def decay_rate(A_log: torch.Tensor, units_per_head: int) -> torch.Tensor:
    """``-exp(A_log)`` per decay unit (fp32): each head's rate repeated over its ``units_per_head`` units
    (its key channels, or 1 for a decay per head)."""
    return -A_log.float().exp().repeat_interleave(units_per_head)


@fusable
def gdn2_gates(f: torch.Tensor, b: torch.Tensor, w: Optional[torch.Tensor], A_log: torch.Tensor,
               dt_bias: torch.Tensor, b_scale: float, spans: tuple[int, int, int] = (1, 1, 1)
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GDN-2 gates from their projections: decay ``g = -exp(A_log) * softplus(f + dt_bias)`` (fp32; f and
    dt_bias [..., U] with U a multiple of A_log's H heads, each head's rate over its U / H units), erase
    gate ``b_scale * sigmoid(b)`` and write gate ``sigmoid(w)``; ``w`` None (tied gates): the write gate
    is the erase gate, ``b_scale`` included. ``spans``: how many channels each value of g, b and w covers
    (1 per channel; the head dim for a gate per head, repeated over its head's channels here, since the
    operator takes a value per channel). Returns g, b, w, each of its last axis times its span."""
    g = decay_rate(A_log, f.shape[-1] // A_log.shape[0]) * F.softplus(f.float() + dt_bias)
    b = torch.sigmoid(b)
    if b_scale != 1.0:
        b = b * b_scale
    w = b if w is None else torch.sigmoid(w)
    return tuple(t if span == 1 else t.repeat_interleave(span, dim=-1)  # type: ignore[return-value]
                 for t, span in zip((g, b, w), spans))


@fusable
def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up``."""
    return F.silu(gate) * up


# RoPE and the joined SwiGLU: their definitions are their operators' oracles (``gdn2.ops.pointwise``);
# these are the compiled torch paths, the Triton kernels run where that operator's backend is Triton
apply_rope = fusable(apply_rope_reference)
rope_qkv_stage = fusable(rope_qkv_reference)
swiglu_joined_stage = fusable(swiglu_joined_reference)
