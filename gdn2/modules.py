"""Modules that carry their own initialisation.

Each module that owns parameters re-creates its initial values in ``reset_parameters()``. That keeps
construction deterministic under ``torch.manual_seed`` and lets a model built on the meta device be
materialised shard by shard (FSDP calls ``reset_parameters`` on every module that owns parameters).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn

from gdn2.float8 import Float8Spec, float8_linear
from gdn2.linear import linear
from gdn2.stages import add_rms_norm, compute_dtype, rms_norm


class Linear(nn.Linear):
    """``nn.Linear`` with a declared init: ``normal`` (std) or ``xavier`` (gain); biases start at zero."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, init: str = "normal",
                 std: float = 0.02, gain: float = 1.0, device: Optional[torch.device] = None,
                 dtype: Optional[torch.dtype] = None) -> None:
        if init not in ("normal", "xavier"):
            raise ValueError(f"init must be 'normal' or 'xavier', got {init!r}")
        self.init, self.std, self.gain = init, std, gain
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.float8: Optional[Float8Spec] = None  # set by gdn2.options.apply_options

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.float8 is None:
            return linear(x, self.weight, self.bias)
        return float8_linear(x, (self.weight,), self.bias, self.float8, compute_dtype(x))

    def reset_parameters(self) -> None:
        if self.init == "normal":
            nn.init.normal_(self.weight, mean=0.0, std=self.std)
        else:
            nn.init.xavier_uniform_(self.weight, gain=self.gain)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def extra_repr(self) -> str:
        how = f"std={self.std:g}" if self.init == "normal" else f"xavier gain={self.gain:g}"
        return f"{super().extra_repr()}, init={how}"


class Embedding(nn.Embedding):
    """Token embedding initialised N(0, std) (``nn.Embedding`` would use N(0, 1))."""

    def __init__(self, num_embeddings: int, embedding_dim: int, std: float = 0.02,
                 device: Optional[torch.device] = None, dtype: Optional[torch.dtype] = None) -> None:
        self.std = std
        super().__init__(num_embeddings, embedding_dim, device=device, dtype=dtype)

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=getattr(self, "std", 0.02))


class RMSNorm(nn.Module):
    """RMSNorm over the last axis, computed in fp32: ``x / rms(x) * weight``."""

    def __init__(self, dim: int, eps: float = 1e-5, device: Optional[torch.device] = None,
                 dtype: Optional[torch.dtype] = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim, device=device, dtype=dtype))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """In the dtype the next matmul runs in (autocast's where it is on: every reader of a norm's
        output is a projection), so the cast is part of the norm's pass and its gradient arrives in
        that dtype."""
        return rms_norm(x, self.weight, self.eps, compute_dtype(x))

    def add_forward(self, x: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x + delta, self(x + delta))`` in one pass (fused when compiled); the sum in its own
        dtype (the residual stream), the norm as :meth:`forward`."""
        return add_rms_norm(x, delta, self.weight, self.eps, compute_dtype(x))

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
