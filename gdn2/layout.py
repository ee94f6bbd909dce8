"""Where a forward's tokens sit: positions, documents packed into one row, prompts packed for a prefill.

:class:`TokenLayout` is what every token mixer is told besides its input: made by ``GPT.forward`` for
training and scoring, and by ``gdn2.generation`` for a prefill, an extension or a decode step.

:class:`PackedPrompts`: several prompts of different lengths packed into one row for a single prefill
pass. The prompts are concatenated without padding and attended as separate documents (``cu_seqlens``),
so each one is processed exactly as it would be alone. For decoding they are right-aligned: every prompt
ends in the same column ``num_columns - 1``, so all rows then write the same column at each step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch


def positions_in_documents(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """[total] position of every token inside its document, from document offsets ``cu_seqlens``."""
    idx = torch.arange(total, device=cu_seqlens.device)
    starts = cu_seqlens[:-1].long()
    doc = torch.searchsorted(starts, idx, right=True) - 1
    return idx - starts[doc]


@dataclass
class PackedPrompts:
    cu_seqlens: torch.Tensor  # int32 [N+1] prompt offsets in the packed row
    pos_in_doc: torch.Tensor  # int64 [total] position of each token inside its prompt
    rows: torch.Tensor  # int64 [total] prompt (= cache row) of each token
    columns: torch.Tensor  # int64 [total] decoding column of each token: pos_in_doc + offsets[row]
    offsets: torch.Tensor  # int64 [N] first column of each prompt: num_columns - length
    last: torch.Tensor  # int64 [N] index of each prompt's last token in the packed row
    num_columns: int  # length of the longest prompt

    @classmethod
    def from_lengths(cls, lengths: list[int], device: torch.device) -> "PackedPrompts":
        """Packing of prompts with the given token counts (each >= 1)."""
        if not lengths or min(lengths) < 1:
            raise ValueError(f"every prompt needs at least one token, got lengths {lengths}")
        lens = torch.tensor(lengths, dtype=torch.int64, device=device)
        ends = lens.cumsum(0)
        cu = torch.cat([ends.new_zeros(1), ends])
        total = int(sum(lengths))
        rows = torch.repeat_interleave(torch.arange(len(lengths), device=device), lens)
        pos = torch.arange(total, device=device) - cu[:-1][rows]
        n_cols = max(lengths)
        offsets = n_cols - lens
        return cls(cu.to(torch.int32), pos, rows, pos + offsets[rows], offsets, ends - 1, n_cols)


@dataclass
class TokenLayout:
    """Where the tokens of one forward sit (all tensors on the input's device).

    ``positions``: int64 [T], the absolute position of each column (RoPE, attention cache slots); at a
    decode step [B], each row's own position. ``cu_seqlens``: int32 [N+1] document offsets over the
    flattened batch, whose B*T tokens then form one row: the GDN-2 state, the short convolution, RoPE
    and attention restart at every document. ``pos_in_doc``: int64 [T], each token's position inside its
    document (with ``cu_seqlens``). ``packed``: the prompts of a prefill, each document's final state
    going to its own cache row. ``step``: a decode step's values shared by every attention layer
    (``gdn2.layers.attention.AttentionStep``); the GDN-2 layers need none.
    """

    positions: torch.Tensor
    cu_seqlens: Optional[torch.Tensor] = None
    pos_in_doc: Optional[torch.Tensor] = None
    packed: Optional[PackedPrompts] = None
    step: Optional[Any] = None

    @classmethod
    def of_prefill(cls, packed: PackedPrompts) -> "TokenLayout":
        """Prompts packed into one row, each a document starting at position 0."""
        return cls(packed.pos_in_doc, packed.cu_seqlens, packed.pos_in_doc, packed=packed)
