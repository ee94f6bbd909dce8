"""Sliding-window (and full causal) flash attention.

- ``api``: the entry point ``sliding_window_attention`` (validation, backend dispatch)
- ``attention``: the Triton operator (launches, the ds-scratch plan of the backward, autograd)
- ``configs``: tile shapes per device, head dim and dtype
- ``fwd`` / ``bwd``: the forward kernel / the backward kernels (delta, dk/dv, dq two ways)
- ``utils``: what the kernels share (block programs, tile loads, loop bounds) and the launch geometry
- ``naive``: the explicit-mask oracle and the SDPA-based CPU path
"""

from gdn2.ops.swa.api import sliding_window_attention
from gdn2.ops.swa.naive import sliding_window_attention_reference

__all__ = ["sliding_window_attention", "sliding_window_attention_reference"]
