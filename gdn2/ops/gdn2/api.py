"""The GDN-2 entry points: input validation and backend dispatch (``gdn2.ops.backend``).

The Triton modules are imported on the first Triton call, so this module (and ``gdn2.ops``) imports
without Triton.
"""

from __future__ import annotations

from typing import Optional

import torch

from gdn2.ops.backend import select_backend
from gdn2.ops.checks import check_cu_seqlens, device_of, check_scale, check_tensors, check_triton_dtypes
from gdn2.ops.gdn2.naive import chunk_gdn2_reference, recurrent_gdn2_reference

MAX_HEAD_DIM = 256


def check_gdn2_inputs(q, k, v, g, b, w, scale, initial_state, cu_seqlens, torch_path: bool) -> None:
    """Raise ValueError naming the argument for any input the GDN-2 operators cannot take.

    The values of ``g`` are not checked (that would need a host synchronisation): ``g`` must be <= 0,
    and a positive ``g`` (a growing state) overflows to inf/NaN.
    """
    named = dict(q=q, k=k, v=v, g=g, b=b, w=w)
    check_tensors(named, 4, "[B, T, H, D]")
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    for name, t in named.items():
        if t.shape[:2] != (B, T):
            raise ValueError(f"{name} has batch/length {tuple(t.shape[:2])}, q has {(B, T)}")
    if k.shape != q.shape:
        raise ValueError(f"k must have q's shape {tuple(q.shape)}, got {tuple(k.shape)}")
    if w.shape != v.shape:
        raise ValueError(f"w must have v's shape {tuple(v.shape)}, got {tuple(w.shape)}")
    if HV % H != 0:
        raise ValueError(f"v has {HV} heads, not a multiple of q's {H} heads")
    for name in ("g", "b"):
        t = named[name]
        if t.shape[2] not in (H, HV) or t.shape[3] != K:
            raise ValueError(f"{name} must be [B, T, {H} or {HV}, {K}], got {tuple(t.shape)}")
    if K > MAX_HEAD_DIM:
        raise ValueError(f"q/k head dim K={K} exceeds the supported maximum {MAX_HEAD_DIM}")
    if V > MAX_HEAD_DIM:
        raise ValueError(f"v head dim V={V} exceeds the supported maximum {MAX_HEAD_DIM}")
    check_scale(scale)
    N = check_cu_seqlens(cu_seqlens, B, T) or B
    if initial_state is not None:
        if not isinstance(initial_state, torch.Tensor):
            raise ValueError(f"initial_state must be a tensor or None, got {type(initial_state).__name__}")
        allowed = (torch.float32, torch.float64) if (torch_path and v.dtype == torch.float64) else (torch.float32,)
        if initial_state.dtype not in allowed:
            raise ValueError(f"initial_state must be float32, got {initial_state.dtype}")
        if tuple(initial_state.shape) != (N, HV, K, V):
            raise ValueError(f"initial_state must have shape {(N, HV, K, V)}, got {tuple(initial_state.shape)}")
        if initial_state.device != q.device:
            raise ValueError(f"initial_state is on {initial_state.device}, q on {q.device}")
    if not torch_path:
        check_triton_dtypes(named)


def chunk_gdn2(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, b: torch.Tensor, w: torch.Tensor,
    scale: Optional[float] = None, initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False, use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: Optional[torch.Tensor] = None, backend: Optional[str] = None, recompute: bool = False,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Chunked GDN-2 (training and prefill).

    q, k, b: [B,T,H,K]; g: [B,T,H,K] natural-log decay (<= 0, fp32 or bf16; not checked, a positive
    decay overflows to inf/NaN); v, w: [B,T,HV,V];
    initial_state: fp32 [N,HV,K,V] (N = B, or the number of sequences in ``cu_seqlens``, which
    needs B == 1). ``scale`` defaults to K**-0.5. Returns ``o`` [B,T,HV,V] in q's dtype and the fp32
    final state when ``output_final_state``. Differentiable in every tensor input. ``recompute``
    (Triton backend): the forward keeps only its inputs for the backward, which runs the forward's
    kernels again (Aqk, A and R: at K = V = 128 and bf16, 512 bytes per token and head less memory held
    between forward and backward); the gradients are the same. The torch backend keeps what autograd
    saves either way.
    """
    be = select_backend("gdn2", device_of("q", q), backend, q.dtype)
    check_gdn2_inputs(q, k, v, g, b, w, scale, initial_state, cu_seqlens, torch_path=be == "torch")
    if scale is None:
        scale = q.shape[-1] ** -0.5
    if be == "triton":
        from gdn2.ops.gdn2.chunk import chunk_gdn2_triton

        return chunk_gdn2_triton(q, k, v, g, b, w, scale, initial_state, output_final_state,
                                 use_qk_l2norm_in_kernel, cu_seqlens, recompute)
    return chunk_gdn2_reference(q, k, v, g, b, w, scale, initial_state, output_final_state,
                                use_qk_l2norm_in_kernel, cu_seqlens)


def fused_recurrent_gdn2(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, b: torch.Tensor, w: torch.Tensor,
    scale: Optional[float] = None, initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False, use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: Optional[torch.Tensor] = None, inplace_final_state: bool = False,
    backend: Optional[str] = None,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Token-recurrent GDN-2 (decoding). Same arguments as :func:`chunk_gdn2`.

    ``inplace_final_state=True`` writes the final state into ``initial_state`` (which must be given)
    and returns that tensor, so a decoding cache is updated without copies. Inference only on the
    Triton path; the torch path is differentiable.
    """
    be = select_backend("gdn2", device_of("q", q), backend, q.dtype)
    check_gdn2_inputs(q, k, v, g, b, w, scale, initial_state, cu_seqlens, torch_path=be == "torch")
    if inplace_final_state and initial_state is None:
        raise ValueError("inplace_final_state=True needs an initial_state to update")
    if scale is None:
        scale = q.shape[-1] ** -0.5
    if be == "triton":
        from gdn2.ops.gdn2.recurrent import fused_recurrent_gdn2_triton

        return fused_recurrent_gdn2_triton(q, k, v, g, b, w, scale, initial_state, output_final_state,
                                           use_qk_l2norm_in_kernel, cu_seqlens, inplace_final_state)
    o, final = recurrent_gdn2_reference(q, k, v, g, b, w, scale, initial_state,
                                        output_final_state or inplace_final_state,
                                        use_qk_l2norm_in_kernel, cu_seqlens)
    if inplace_final_state:
        with torch.no_grad():
            initial_state.copy_(final)
        return o, initial_state
    return o, final


# Registered as a custom op that declares what it writes, so that ``torch.compile`` sees a decode step
# as one graph and still advances the state in place, which a captured CUDA graph relies on.
@torch.library.custom_op("gdn2::recurrent_decode", mutates_args=("state",))
def recurrent_decode_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, b: torch.Tensor,
                        w: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """GDN-2 over a few tokens with the recurrent kernel (q, k L2-normalised inside): q, k, g, b
    [B,T,H,K]; v, w [B,T,HV,V]; state fp32 [B,HV,K,V] advanced in place. Returns o [B,T,HV,V] in
    q's dtype. :func:`fused_recurrent_gdn2` as the custom op ``gdn2::recurrent_decode``."""
    o, _ = fused_recurrent_gdn2(q, k, v, g, b, w, initial_state=state, use_qk_l2norm_in_kernel=True,
                                inplace_final_state=True)
    return o


@recurrent_decode_op.register_fake
def _recurrent_decode_fake(q, k, v, g, b, w, state) -> torch.Tensor:
    return q.new_empty(v.shape)
