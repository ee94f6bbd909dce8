"""Evaluation during training: validation loss at every evaluation length, and lm-eval tasks on the
live model, each deciding from the recipe when it runs."""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any, Optional

import torch

from gdn2.data.loader import ValLoader
from gdn2.model import GPT
from gdn2.train.loss import forward_loss, to_device
from gdn2.train.metrics import MetricsLog
from gdn2.checkpoint.format import bare_parameter_name
from gdn2.train.recipe import Recipe
from gdn2.train.schedule import due
from gdn2.train.setup import is_fsdp

log = logging.getLogger("gdn2.train")


def build_val_loaders(recipe: Recipe, rank: int, world_size: int) -> dict[int, ValLoader]:
    """One finite loader per validation length (``eval.length_multipliers`` x block size), each checked
    against ``model.vocab_size`` like the training data (an id beyond it names its shard here, before
    the first step, instead of failing the run at its first validation)."""
    e, data = recipe.eval, recipe.data
    if data.val is None or (e.interval == 0 and not e.at_end):
        return {}
    base = e.micro_batch_size or recipe.train.micro_batch_size
    loaders = {}
    for mult in e.length_multipliers:
        length = recipe.model.block_size * mult
        try:
            loaders[length] = ValLoader(data.val, length, max(1, base // mult), e.num_batches, rank=rank,
                                        world_size=world_size, eos_id=data.eos_id,
                                        document_masking=data.document_masking)
        except ValueError as err:
            raise ValueError(f"data.val / eval.length_multipliers: cannot validate at {mult}x = {length} "
                             f"tokens: {err}") from None
        try:
            loaders[length].check_vocabulary(recipe.model.vocab_size)
        except ValueError as err:
            raise ValueError(f"data.val: {err}") from None
    return loaders


@torch.no_grad()
def evaluate(fabric, model, loaders: dict[int, ValLoader], chunk_tokens: int) -> dict[int, float]:
    """Mean validation loss per length over every rank's batches."""
    model.eval()
    results = {}
    for length, loader in loaders.items():
        total = torch.zeros(2, device=fabric.device, dtype=torch.float64)
        for batch in loader:
            batch = to_device(batch, fabric.device)
            n = batch["labels"].numel()
            loss = forward_loss(model, batch, chunk_tokens)
            total += torch.stack([loss.double() * n, torch.tensor(float(n), device=fabric.device, dtype=torch.float64)])
        total = fabric.all_reduce(total, reduce_op="sum")
        results[length] = float(total[0] / total[1])
    model.train()
    return results


def full_model_copy(fabric, model, config) -> GPT:
    """A plain GPT on this rank's device holding the current full weights, for in-process evaluation
    (under FSDP every rank gathers the whole model for the duration)."""
    state: dict[str, torch.Tensor] = {}
    if is_fsdp(fabric):
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        with FSDP.summon_full_params(model.module, writeback=False):
            for name, p in model.named_parameters():
                state[bare_parameter_name(name)] = p.detach().clone()
    else:
        state = {bare_parameter_name(n): p.detach() for n, p in model.named_parameters()}
    with torch.device("meta"):
        plain = GPT(config)
    plain.load_state_dict(state, assign=True)
    return plain.to(fabric.device)


def run_lm_eval(fabric, model, recipe: Recipe) -> dict[str, float]:
    """lm-eval tasks (``lm_eval`` section) on the live model; every rank takes part, rank 0 logs."""
    from gdn2.eval.harness import evaluate_model
    from gdn2.checkpoint.consolidate import find_run_tokenizer

    cfg = recipe.lm_eval
    tokenizer = cfg.tokenizer or find_run_tokenizer(recipe.sections_dict(), [Path.cwd()])
    if tokenizer is None:
        raise FileNotFoundError("lm_eval.tokenizer: no tokenizer.model found in the training data folders "
                                f"{recipe.data.train}; set lm_eval.tokenizer")
    include = cfg.include_path
    plain = full_model_copy(fabric, model, recipe.model)
    limit = None if cfg.limit is None else (int(cfg.limit) if cfg.limit >= 1 else cfg.limit)
    dtype = torch.bfloat16 if fabric.device.type == "cuda" else torch.float32
    with torch.autocast(fabric.device.type, dtype=dtype, enabled=dtype != torch.float32):
        scores = evaluate_model(plain, tokenizer, cfg.tasks, limit=limit, include_path=include,
                                batch_size=cfg.batch_size)
    del plain
    return {k: float(v) for k, v in scores.items() if isinstance(v, (int, float))}


class Validator:
    """Validation loss at every length of ``eval.length_multipliers``, on the schedule of the ``eval``
    section; the losses go to the metrics log and the console."""

    def __init__(self, fabric: Any, model: Any, recipe: Recipe, metrics: MetricsLog, max_steps: int) -> None:
        self.fabric, self.model, self.recipe, self.metrics, self.max_steps = fabric, model, recipe, metrics, max_steps
        self.loaders = build_val_loaders(recipe, fabric.global_rank, fabric.world_size)
        self.last: dict[int, float] = {}

    def maybe_run(self, step: int, end: bool = False) -> Optional[dict[int, float]]:
        e = self.recipe.eval
        if not self.loaders or not due(e.interval, e.at_end, step, self.max_steps, end):
            return None
        losses = evaluate(self.fabric, self.model, self.loaders, self.recipe.train.loss_chunk_tokens)
        record: dict[str, float] = {}
        for length, value in losses.items():
            record[f"val/loss_{length}"] = value
            record[f"val/ppl_{length}"] = math.exp(min(value, 50.0))
        self.metrics.log(step, record, kind="val")
        if self.fabric.global_rank == 0:
            log.info("step %d validation: %s", step,
                     ", ".join(f"{length} tokens loss {v:.4f}" for length, v in losses.items()))
        self.last = losses
        return losses


class LmEvaluator:
    """The ``lm_eval`` section's tasks on the live model, on that section's schedule."""

    def __init__(self, fabric: Any, model: Any, recipe: Recipe, metrics: MetricsLog, max_steps: int) -> None:
        self.fabric, self.model, self.recipe, self.metrics, self.max_steps = fabric, model, recipe, metrics, max_steps

    def maybe_run(self, step: int, end: bool = False) -> Optional[dict[str, float]]:
        le = self.recipe.lm_eval
        if not due(le.interval, le.at_end, step, self.max_steps, end):
            return None
        scores = run_lm_eval(self.fabric, self.model, self.recipe)
        self.metrics.log(step, {f"lm_eval/{k}": v for k, v in scores.items()}, kind="lm_eval")
        if self.fabric.global_rank == 0:
            log.info("step %d lm-eval: %s", step, ", ".join(f"{k} {v:.4f}" for k, v in scores.items()))
        return scores
