"""GDN-2: the chunked operator (training, prefill) and the token-recurrent one (decoding).

- ``api``: the entry points ``chunk_gdn2`` / ``fused_recurrent_gdn2`` (validation, backend dispatch), and
  the decode step's in-place custom op ``gdn2::recurrent_decode`` (``recurrent_decode_op``)
- ``chunk``: the chunked Triton operator (launches, autograd); kernels in ``chunk_fwd`` / ``chunk_bwd``
- ``recurrent``: the token-recurrent Triton kernel
- ``l2norm``: the Triton L2 norm of q and k (``use_qk_l2norm_in_kernel``)
- ``utils``: chunk bookkeeping, pinned launch configs and in-register helpers of the kernels
- ``naive``: the float64-capable torch oracles, also the CPU path
"""

from gdn2.ops.gdn2.api import chunk_gdn2, fused_recurrent_gdn2, recurrent_decode_op
from gdn2.ops.gdn2.naive import chunk_gdn2_reference, l2norm, recurrent_gdn2_reference

__all__ = ["chunk_gdn2", "fused_recurrent_gdn2", "recurrent_decode_op", "chunk_gdn2_reference", "recurrent_gdn2_reference", "l2norm"]
