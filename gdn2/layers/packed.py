"""Several prompts of different lengths packed into one row, for a single prefill pass.

The prompts are concatenated without padding and attended as separate documents (``cu_seqlens``), so
each one is processed exactly as it would be alone. For decoding they are right-aligned: every prompt
ends in the same column ``num_columns - 1``, so all rows then write the same column at each step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


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
