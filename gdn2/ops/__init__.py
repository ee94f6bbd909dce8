"""Public operator API: one entry point per operator, each with its torch oracle.

Layout ``[B, T, H, D]`` everywhere (``[B, T, C]`` for the short convolution). One folder per operator
(``gdn2``, ``swa``, ``decode_attention``, ``short_conv``, ``pointwise``),
each with its entry point (``api``), its Triton kernels and its oracle (``naive``). Backend choice and
every environment switch live in ``gdn2.ops.backend``:

- GDN-2 (``chunk_gdn2``, ``fused_recurrent_gdn2``), ``ring_decode_attention``, ``short_conv_silu`` and the
  row-wise ``rope_qkv`` / ``swiglu_joined``:
  our Triton kernels on CUDA, the torch path otherwise. The decode steps' in-place custom ops
  (``recurrent_decode_op``, ``ring_decode_attention_op``) are registered here too, by their operators.
- ``sliding_window_attention``: flash-attn when installed and the inputs are on CUDA, else our Triton
  kernel on CUDA, else the torch path.

``GDN2_BACKEND=triton|torch|flash`` (or the ``backend=`` argument) forces a backend; ``triton`` on CPU
tensors works under ``TRITON_INTERPRET=1``, which is how CI tests the kernels without a GPU. Importing
this package does not import Triton.
"""

from gdn2.ops.backend import select_backend
from gdn2.ops.decode_attention import ring_decode_attention, ring_decode_attention_op, ring_decode_attention_reference
from gdn2.ops.gdn2 import (chunk_gdn2, chunk_gdn2_reference, fused_recurrent_gdn2, l2norm, recurrent_decode_op,
                           recurrent_gdn2_reference)
from gdn2.ops.pointwise import rope_qkv, rope_qkv_reference, swiglu_joined, swiglu_joined_reference
from gdn2.ops.short_conv import short_conv_silu, short_conv_silu_reference
from gdn2.ops.swa import sliding_window_attention, sliding_window_attention_reference

__all__ = [
    "chunk_gdn2", "fused_recurrent_gdn2", "sliding_window_attention", "ring_decode_attention", "select_backend",
    "chunk_gdn2_reference", "recurrent_gdn2_reference", "l2norm", "sliding_window_attention_reference",
    "ring_decode_attention_reference", "ring_decode_attention_op", "recurrent_decode_op", "short_conv_silu", "short_conv_silu_reference", "rope_qkv",
    "rope_qkv_reference", "swiglu_joined", "swiglu_joined_reference",
]
