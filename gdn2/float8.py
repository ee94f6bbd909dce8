"""float8 GEMMs for training (``train.float8``), through torchao's float8 training.

torchao casts each GEMM operand to float8 with a dynamic scale (one per tensor for ``tensorwise``, one
per row for ``rowwise``; ``rowwise_with_gw_hp`` keeps the weight gradient's GEMM in bf16) and runs
forward, input gradient and weight gradient as scaled float8 matmuls; the weights stay fp32
parameters and the optimizer does not change. Here that autograd function runs over the model's own
projections: :func:`gdn2.options.apply_options` marks every block projection, and a grouped
projection (``train.grouped_projections``) runs as one float8 GEMM over its stacked weights. The
output head and the GDN-2 gates' low-rank up-projections (reducing over 128 channels) stay in bf16.
With ``train.compile`` the casts and scales fuse into one compiled stage.

torchao is an optional dependency (``pip install "gdn2[float8]"``); float8 matmuls need a GPU of
compute capability 8.9 or newer (Ada, Hopper and later).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Optional

import torch

from gdn2.stages import fusable

RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")


@dataclasses.dataclass(frozen=True, eq=False)
class Float8Spec:
    """One recipe's torchao configuration (``config``: ``Float8LinearConfig``; ``mm``: the three
    GEMMs' ``LinearMMConfig``). Compared by identity: one spec per model keeps one compiled stage."""

    recipe: str
    config: Any
    mm: Any


def require_torchao() -> None:
    """ValueError naming ``train.float8`` when torchao is not installed (checked without importing it)."""
    import importlib.util

    if importlib.util.find_spec("torchao") is None:
        raise ValueError("train.float8 needs torchao: pip install 'gdn2[float8]' (or pip install torchao)")


def check_recipe(recipe: str) -> None:
    """ValueError naming ``train.float8`` unless ``recipe`` is one of :data:`RECIPES`."""
    if recipe not in RECIPES:
        raise ValueError(f"train.float8: must be one of {', '.join(RECIPES)} or null, got {recipe!r}")


def float8_spec(recipe: str, emulate: bool = False) -> Float8Spec:
    """The spec of a recipe in :data:`RECIPES`. ``emulate``: torchao's float8 emulation in ordinary
    matmuls (any device, slow; for checking values on a machine without float8 GEMMs)."""
    check_recipe(recipe)
    require_torchao()
    from torchao.float8 import Float8LinearConfig, LinearMMConfig, ScaledMMConfig

    config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=emulate)
    mm = LinearMMConfig(*(ScaledMMConfig(emulate, gemm.use_fast_accum, False, config.pad_inner_dim)
                          for gemm in (config.gemm_config_output, config.gemm_config_grad_input,
                                       config.gemm_config_grad_weight)))
    return Float8Spec(recipe, config, mm)


def check_device(spec: Float8Spec, device: torch.device) -> None:
    """ValueError naming ``train.float8`` unless ``device`` runs float8 GEMMs (or the spec emulates)."""
    if spec.config.emulate:
        return
    if device.type != "cuda" or torch.cuda.get_device_capability(device) < (8, 9):
        what = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
        raise ValueError(f"train.float8={spec.recipe} needs a CUDA GPU of compute capability 8.9 or newer "
                         f"(Ada, Hopper), not {what}")


def eligible(linear: torch.nn.Linear) -> bool:
    """Whether a projection can run in float8: torchao's GEMMs take dimensions that are multiples of 16."""
    return linear.in_features % 16 == 0 and linear.out_features % 16 == 0


@fusable
def float8_linear(x: torch.Tensor, weights: Sequence[torch.Tensor], bias: Optional[torch.Tensor],
                  spec: Float8Spec, dtype: torch.dtype) -> torch.Tensor:
    """``x @ cat(weights).T (+ bias)`` with both operands cast to float8 by ``spec``'s scaling, in the
    forward and in both gradient GEMMs; x is first cast to ``dtype`` (the dtype a matmul on x runs in,
    :func:`gdn2.stages.compute_dtype`), which the output has too."""
    from torchao.float8.float8_linear import matmul_with_hp_or_float8_args

    x = x.to(dtype)
    weight = weights[0] if len(weights) == 1 else torch.cat(list(weights))
    y = matmul_with_hp_or_float8_args.apply(x, weight.t(), spec.mm, spec.config)
    return y if bias is None else y + bias.to(y.dtype)
