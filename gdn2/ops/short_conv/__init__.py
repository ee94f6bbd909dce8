"""The GDN-2 layer's short convolution: a causal depthwise convolution followed by SiLU.

- ``api``: the entry point ``short_conv_silu`` (the contract, backend dispatch)
- ``conv``: the Triton kernels (forward; backward with the weight gradient) and their autograd function
- ``naive``: the torch oracle, also the CPU path
"""

from gdn2.ops.short_conv.api import short_conv_silu
from gdn2.ops.short_conv.naive import short_conv_silu_reference

__all__ = ["short_conv_silu", "short_conv_silu_reference"]
