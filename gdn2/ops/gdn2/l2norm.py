"""Row-wise L2 normalisation of q / k for ``use_qk_l2norm_in_kernel``, forward and backward.

``y = x / sqrt(sum(x^2) + 1e-6)`` over the head dimension, computed in fp32. The forward returns the
normalised rows in x's dtype and the fp32 reciprocal norms, which are all the backward needs:
``dx = rstd * (dy - y * sum(y * dy))``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gdn2.ops.gdn2.naive import L2NORM_EPS
from gdn2.ops.gdn2.utils import padded

ROWS = 16


@triton.jit
def _l2norm_fwd_kernel(x, y, rstd, R, D: tl.constexpr, BD: tl.constexpr, BR: tl.constexpr, EPS: tl.constexpr):
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    cols = tl.arange(0, BD)
    m = (rows < R)[:, None] & (cols < D)[None, :]
    offs = rows.to(tl.int64)[:, None] * D + cols[None, :]
    bx = tl.load(x + offs, mask=m, other=0.0).to(tl.float32)
    br = 1.0 / tl.sqrt(tl.sum(bx * bx, axis=1) + EPS)
    tl.store(y + offs, (bx * br[:, None]).to(y.dtype.element_ty), mask=m)
    tl.store(rstd + rows, br, mask=rows < R)


@triton.jit
def _l2norm_bwd_kernel(x, rstd, dy, dx, R, D: tl.constexpr, BD: tl.constexpr, BR: tl.constexpr):
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    cols = tl.arange(0, BD)
    m = (rows < R)[:, None] & (cols < D)[None, :]
    offs = rows.to(tl.int64)[:, None] * D + cols[None, :]
    br = tl.load(rstd + rows, mask=rows < R, other=0.0)
    by = tl.load(x + offs, mask=m, other=0.0).to(tl.float32) * br[:, None]
    bdy = tl.load(dy + offs, mask=m, other=0.0).to(tl.float32)
    bdx = br[:, None] * (bdy - by * tl.sum(by * bdy, axis=1)[:, None])
    tl.store(dx + offs, bdx.to(dx.dtype.element_ty), mask=m)


def l2norm_fwd(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [..., D] contiguous. Returns (normalised x in x's dtype, fp32 reciprocal norms [...])."""
    D = x.shape[-1]
    R = x.numel() // D
    y = torch.empty_like(x)
    rstd = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)
    if R:
        _l2norm_fwd_kernel[(triton.cdiv(R, ROWS),)](x, y, rstd, R, D, padded(D), ROWS, L2NORM_EPS, num_warps=4)
    return y, rstd


def l2norm_bwd(x: torch.Tensor, rstd: torch.Tensor, dy: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """Gradient with respect to the raw rows x, given the gradient dy of the normalised rows."""
    D = x.shape[-1]
    R = x.numel() // D
    dx = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    if R:
        _l2norm_bwd_kernel[(triton.cdiv(R, ROWS),)](x, rstd, dy, dx, R, D, padded(D), ROWS, num_warps=4)
    return dx
