"""Next-token cross-entropy in fp32, a slice of tokens at a time, with the gradient made in the forward.

``F.cross_entropy(logits.float(), ...)`` keeps an fp32 copy of the whole logits tensor alive until the
backward pass (2 GiB at 4 x 4096 x 32000). Both functions here compute, slice by slice in fp32, the loss
and its gradient, and keep only the gradient:

- :func:`cross_entropy_fp32` takes logits and keeps d loss / d logits, in the logits' dtype;
- :func:`linear_cross_entropy` takes the final hidden states and the output head's weight and never
  holds more than one slice of logits: it keeps d loss / d hidden (the hidden states' size) and
  d loss / d weight (fp32, the head's size), so the logits and their gradient (1 GiB each in bf16 at
  4 x 4096 x 32000) never exist whole.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from gdn2.stages import compute_dtype, fusable

IGNORE_INDEX = -100


def _accumulator(dtype: torch.dtype) -> torch.dtype:
    """fp32 math, fp64 for fp64 inputs."""
    return torch.promote_types(dtype, torch.float32)


@fusable
def slice_loss_and_grad(logits: torch.Tensor, target: torch.Tensor, ok: torch.Tensor, count: torch.Tensor,
                        want_grad: bool) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Summed loss of logits [n, V] over the rows ``ok`` marks, in fp32 (fp64 for fp64 logits); with
    ``want_grad`` also d mean-loss / d logits in the logits' dtype ((softmax - onehot) / count on those
    rows, 0 elsewhere), else None. Compiled (``train.compile``), the fp32 logits never exist in memory:
    the rows are read in their own dtype and the gradient is written once."""
    x = logits.to(_accumulator(logits.dtype))
    lse = torch.logsumexp(x, dim=-1)
    picked = x.gather(1, target[:, None]).squeeze(1)
    total = torch.where(ok, lse - picked, 0.0).sum()
    if not want_grad:
        return total, None
    onehot = torch.arange(x.shape[1], device=x.device)[None, :] == target[:, None]
    grad = (torch.exp(x - lse[:, None]) - onehot.to(x.dtype)) * (ok.to(x.dtype) / count)[:, None]
    return total, grad.to(logits.dtype)


def _targets(labels: torch.Tensor, ignore_index: int, acc: torch.dtype
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    valid = labels != ignore_index
    return torch.where(valid, labels, 0), valid, valid.sum().clamp_min(1).to(acc)


class _ChunkedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor, chunk_tokens: int, ignore_index: int
                ) -> torch.Tensor:
        acc = _accumulator(logits.dtype)
        target, valid, count = _targets(labels, ignore_index, acc)
        want_grad = ctx.needs_input_grad[0]
        grad = torch.empty_like(logits) if want_grad else None
        total = torch.zeros((), dtype=acc, device=logits.device)
        for start in range(0, logits.shape[0], chunk_tokens):
            end = min(start + chunk_tokens, logits.shape[0])
            part, g = slice_loss_and_grad(logits[start:end], target[start:end], valid[start:end], count,
                                          want_grad)
            total += part
            if want_grad:
                grad[start:end] = g
        if want_grad:
            ctx.save_for_backward(grad)
        return (total / count).float()

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (grad,) = ctx.saved_tensors
        return grad * grad_output.to(grad.dtype), None, None, None


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_tokens: int,
                ignore_index: int) -> torch.Tensor:
        dtype = compute_dtype(hidden)  # the head's GEMMs in autocast's dtype where it is on, as nn.Linear's
        h, w = hidden.to(dtype), weight.to(dtype)
        acc = _accumulator(dtype)
        target, valid, count = _targets(labels, ignore_index, acc)
        want_h, want_w = ctx.needs_input_grad[:2]
        grad_h = torch.empty_like(h) if want_h else None
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if want_w else None
        total = torch.zeros((), dtype=acc, device=hidden.device)
        with torch.autocast(hidden.device.type, enabled=False):
            for start in range(0, h.shape[0], chunk_tokens):
                end = min(start + chunk_tokens, h.shape[0])
                part, g = slice_loss_and_grad(F.linear(h[start:end], w), target[start:end], valid[start:end],
                                              count, want_h or want_w)
                total += part
                if want_h:
                    grad_h[start:end] = g @ w
                if want_w:
                    grad_w += (g.t() @ h[start:end]).to(acc)
        ctx.save_for_backward(grad_h, grad_w)
        ctx.dtypes = (hidden.dtype, weight.dtype)
        return (total / count).float()

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        grad_h, grad_w = ctx.saved_tensors
        dh = None if grad_h is None else (grad_h * grad_output.to(grad_h.dtype)).to(ctx.dtypes[0])
        dw = None if grad_w is None else (grad_w * grad_output.to(grad_w.dtype)).to(ctx.dtypes[1])
        return dh, dw, None, None, None


def _check(what: tuple[int, ...], labels: torch.Tensor, chunk_tokens: int) -> None:
    if what != labels.shape:
        raise ValueError(f"labels shape {tuple(labels.shape)} does not match {what}")
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be positive, got {chunk_tokens}")


def cross_entropy_fp32(logits: torch.Tensor, labels: torch.Tensor, chunk_tokens: int = 8192,
                       ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Mean next-token cross-entropy over the labels that are not ``ignore_index``.

    logits: [..., V] any float dtype (bf16 under mixed precision); labels: int64 [...] of the same
    leading shape. Returns an fp32 scalar. Math in fp32 (fp64 for fp64 logits) over ``chunk_tokens``
    rows at a time.
    """
    _check(tuple(logits.shape[:-1]), labels, chunk_tokens)
    return _ChunkedCrossEntropy.apply(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), chunk_tokens,
                                      ignore_index)


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                         chunk_tokens: int = 8192, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """``cross_entropy_fp32(hidden @ weight.T, labels)`` without the whole logits tensor.

    hidden: [..., d]; weight: [V, d] (the output head, no bias); labels: int64 [...]. Each slice's
    logits come from one GEMM in the autocast dtype (else hidden's), the softmax in fp32 (fp64 for fp64
    inputs); the weight's gradient accumulates in that dtype. Returns an fp32 scalar.
    """
    _check(tuple(hidden.shape[:-1]), labels, chunk_tokens)
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight must be [V, {hidden.shape[-1]}], got {tuple(weight.shape)}")
    return _LinearCrossEntropy.apply(hidden.reshape(-1, hidden.shape[-1]), weight, labels.reshape(-1),
                                     chunk_tokens, ignore_index)
