"""One-token attention over a key/value ring buffer: the decode step of the attention layers.

- ``api``: the entry point ``ring_decode_attention`` (the contract, backend dispatch), and the same as
  the in-place custom op ``gdn2::ring_decode_attention`` (``ring_decode_attention_op``)
- ``ring``: the Triton kernels (split attention over the window, merge of the splits)
- ``naive``: the torch oracle, also the CPU path
"""

from gdn2.ops.decode_attention.api import ring_decode_attention, ring_decode_attention_op
from gdn2.ops.decode_attention.naive import ring_decode_attention_reference

__all__ = ["ring_decode_attention", "ring_decode_attention_op", "ring_decode_attention_reference"]
