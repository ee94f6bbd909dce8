"""Two row-wise stages between the projections and the token mixers, as Triton kernels: RoPE over the
attention's joint q | k | v projection, and SwiGLU over the MLP's joint gate | up projection. Each reads
the joint tensor once and, in the backward, writes its gradient whole, where the compiled torch form
either concatenates the pieces' gradients or reads its inputs once per output half.

- ``api``: the entry points ``rope_qkv`` and ``swiglu_joined`` (the contracts, backend dispatch)
- ``kernels``: the Triton kernels and their autograd functions
- ``naive``: the torch oracles, also the CPU path (``gdn2.stages`` compiles them)
"""

from gdn2.ops.pointwise.api import rope_qkv, swiglu_joined
from gdn2.ops.pointwise.naive import apply_rope_reference, rope_qkv_reference, swiglu_joined_reference

__all__ = ["rope_qkv", "swiglu_joined", "apply_rope_reference", "rope_qkv_reference", "swiglu_joined_reference"]
