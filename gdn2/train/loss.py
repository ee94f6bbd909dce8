"""Next-token cross-entropy in fp32, a slice of tokens at a time.

``F.cross_entropy(logits.float(), ...)`` keeps an fp32 copy of the whole logits tensor alive until the
backward pass (2 GiB at 4 x 4096 x 32000). Here the forward pass computes the loss and the gradient with
respect to the logits slice by slice in fp32, keeping only the gradient, in the logits' own dtype.
"""

from __future__ import annotations

import torch

IGNORE_INDEX = -100


class _ChunkedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor, chunk_tokens: int, ignore_index: int
                ) -> torch.Tensor:
        n = logits.shape[0]
        valid = labels != ignore_index
        count = valid.sum().clamp_min(1).to(torch.float32)
        want_grad = ctx.needs_input_grad[0]
        grad = torch.empty_like(logits) if want_grad else None
        total = torch.zeros((), dtype=torch.float32, device=logits.device)
        for start in range(0, n, chunk_tokens):
            end = min(start + chunk_tokens, n)
            x = logits[start:end].to(torch.float32, copy=True)  # a copy: modified in place below
            y = labels[start:end]
            ok = valid[start:end]
            target = torch.where(ok, y, 0)
            lse = torch.logsumexp(x, dim=-1)
            picked = x.gather(1, target[:, None]).squeeze(1)
            total += torch.where(ok, lse - picked, 0.0).sum()
            if want_grad:
                # d loss / d logits = (softmax - onehot) / count on valid rows, 0 elsewhere
                x.sub_(lse[:, None]).exp_()
                x.scatter_add_(1, target[:, None], torch.full_like(picked[:, None], -1.0))
                x.mul_((ok.to(torch.float32) / count)[:, None])
                grad[start:end] = x.to(grad.dtype)
        if want_grad:
            ctx.save_for_backward(grad)
        return total / count

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (grad,) = ctx.saved_tensors
        return grad * grad_output.to(grad.dtype), None, None, None


def cross_entropy_fp32(logits: torch.Tensor, labels: torch.Tensor, chunk_tokens: int = 8192,
                       ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Mean next-token cross-entropy over the labels that are not ``ignore_index``.

    logits: [..., V] any float dtype (bf16 under mixed precision); labels: int64 [...] of the same
    leading shape. Returns an fp32 scalar. Math in fp32 over ``chunk_tokens`` rows at a time.
    """
    if logits.shape[:-1] != labels.shape:
        raise ValueError(f"labels shape {tuple(labels.shape)} does not match logits {tuple(logits.shape)}")
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be positive, got {chunk_tokens}")
    return _ChunkedCrossEntropy.apply(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), chunk_tokens,
                                      ignore_index)


def to_device(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def forward_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor], chunk_tokens: int) -> torch.Tensor:
    """Mean next-token loss of one micro-batch (``input_ids``, ``labels``, optional ``cu_seqlens``)."""
    cu = batch.get("cu_seqlens")
    logits = model(batch["input_ids"], cu_seqlens=cu) if cu is not None else model(batch["input_ids"])
    return cross_entropy_fp32(logits, batch["labels"], chunk_tokens)
