"""Random inputs for the GDN-2 operators, shared by tests and benchmarks.

Follows the accuracy policy of the operator spec: q and k L2-normalised, v ~ N(0, 1), b and w ~ U(0, 1),
g from the layer's parametrisation ``-exp(A_log) * softplus(x + dt_bias)``, or a harsh variant where some
channels decay by about exp(-20) per token.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F


def gdn2_inputs(B: int, T: int, H: int, K: int, V: int, dtype: torch.dtype = torch.float32,
                device: str | torch.device = "cpu", HV: Optional[int] = None, harsh: bool = False,
                seed: int = 0, requires_grad: bool = False) -> list[torch.Tensor]:
    """[q, k, v, g, b, w] with q/k/b/g [B,T,H,K] (g fp32 unless dtype is float64) and v/w [B,T,HV,V]."""
    HV = HV or H
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def randn(*s):
        return torch.randn(*s, generator=gen, dtype=torch.float64)

    def rand(*s):
        return torch.rand(*s, generator=gen, dtype=torch.float64)

    q = F.normalize(randn(B, T, H, K), dim=-1)
    k = F.normalize(randn(B, T, H, K), dim=-1)
    v = randn(B, T, HV, V)
    A = torch.empty(H, dtype=torch.float64).uniform_(1, 16, generator=gen)
    dt = torch.exp(rand(H, K) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3)).clamp_min(1e-4)
    dt_bias = dt + torch.log(-torch.expm1(-dt))
    g = -A[:, None] * F.softplus(randn(B, T, H, K) * 0.5 + dt_bias)
    if harsh:
        hot = rand(B, T, H, K) < 0.1
        g = torch.where(hot, -20.0 * rand(B, T, H, K) - 10.0, g)
    b = rand(B, T, H, K)
    w = rand(B, T, HV, V)
    gdtype = torch.float64 if dtype == torch.float64 else torch.float32
    out = [q.to(dtype), k.to(dtype), v.to(dtype), g.to(gdtype), b.to(dtype), w.to(dtype)]
    out = [t.to(device) for t in out]
    if requires_grad:
        out = [t.requires_grad_() for t in out]
    return out


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """``||x - ref|| / ||ref||`` in float64."""
    ref = ref.detach().double()
    return float((x.detach().double() - ref).norm() / ref.norm().clamp_min(1e-30))
