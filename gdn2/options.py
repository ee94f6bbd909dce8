"""The one place that sets a model's training options, as one function applies them to a built model.

:class:`ModelOptions` holds what the recipe's ``train`` section decides about how the model computes
(not what it computes: the values are the same up to rounding order, except float8):

- ``compile``: the elementwise stages through their ``torch.compile``'d twins on ``compile_devices``
  (``gdn2.stages``; process-wide, like the twins themselves);
- ``fused_loss``: the loss from the final hidden states and the head's weight, a slice at a time;
- ``grouped_projections``: one GEMM for the projections that read one input;
- ``float8``: the blocks' projections as float8 GEMMs (a spec from ``gdn2.float8.float8_spec``), except
  the head and the projections a layer exempts (``float8_exempt``);
- ``recompute``: the GDN-2 layers let go of what their backward can cheaply rebuild.

:func:`apply_options` is the only writer of these settings; a bare ``GPT`` has them all off.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from gdn2.float8 import Float8Spec, eligible
from gdn2.layers.gdn2 import GatedDeltaNet2
from gdn2.model import GPT, MLP
from gdn2.modules import Linear
from gdn2.stages import set_compiled

__all__ = ["ModelOptions", "apply_options"]


@dataclass(frozen=True)
class ModelOptions:
    compile: bool = False
    compile_devices: tuple[str, ...] = ("cuda",)
    compile_backend: str = "inductor"  # torch.compile's backend (the CPU tests trace with aot_eager)
    fused_loss: bool = False
    grouped_projections: bool = False
    float8: Optional[Float8Spec] = None
    recompute: bool = False


def apply_options(model: torch.nn.Module, options: ModelOptions) -> torch.nn.Module:
    """Set ``options`` on ``model`` (a bare :class:`gdn2.model.GPT`, before any wrapper) in place, every
    earlier choice replaced; returns the model."""
    if not isinstance(model, GPT):
        raise TypeError(f"apply_options takes a bare GPT (before FSDP, DDP or Fabric wrap it), got "
                        f"{type(model).__name__}")
    set_compiled(options.compile, options.compile_devices, options.compile_backend)
    model.fused_loss = options.fused_loss
    exempt = set()
    for module in model.modules():
        if isinstance(module, (GatedDeltaNet2, MLP)):
            module.grouped_projections = options.grouped_projections
        if isinstance(module, GatedDeltaNet2):
            module.recompute = options.recompute
            exempt.update(id(lin) for lin in module.float8_exempt())
    # the blocks' projections only: the output head keeps its GEMMs
    for module in model.transformer.h.modules():
        if isinstance(module, Linear):
            on = options.float8 is not None and eligible(module) and id(module) not in exempt
            module.float8 = options.float8 if on else None
    return model
