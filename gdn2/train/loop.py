"""The training loop on Lightning Fabric: one optimizer step (:func:`train_step`) and the run
(:func:`fit`), which composes small components that each decide their own schedule: the metrics log
(``TrainLog``), validation (``Validator``), lm-eval (``LmEvaluator``) and checkpoints (``Checkpointer``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

from gdn2.checkpoint.format import list_checkpoints
from gdn2.checkpoint.resume import resolve_resume, resume_candidates, supersede_newer
from gdn2.checkpoint.state import load_checkpoint, set_rng_state
from gdn2.commandline import told_elsewhere
from gdn2.data.loader import TrainLoader
from gdn2.model import GPT, flops_per_token
from gdn2.train.checkpointer import Checkpointer
from gdn2.train.fabric_api import unwrap
from gdn2.train.loss import forward_loss, to_device
from gdn2.train.metrics import MetricsLog, TrainLog, peak_bf16_flops
from gdn2.train.peers import PeerWatch
from gdn2.train.profile import StepProfiler
from gdn2.train.recipe import Recipe, TrainPlan, make_plan
from gdn2.train.schedule import cosine_with_warmup
from gdn2.train.setup import (build_fabric, build_model_and_optimizer, check_resume_compatible, check_vocabulary,
                              cpu_threads, lock_run_folders, prepare_default_corpus, setup_logging, usable_cores,
                              write_run_info)
from gdn2.train.slurm import SlurmJob, StopSignals, parse_duration, requeue
from gdn2.train.validate import LmEvaluator, Validator

log = logging.getLogger("gdn2.train")


class NonFiniteLossError(RuntimeError):
    """Too many optimizer steps in a row had a non-finite loss or gradient norm."""


@dataclass
class TrainState:
    """Counters saved with every checkpoint (``step`` = optimizer steps done = index of the next one)."""

    step: int = 0
    tokens: int = 0
    skipped_steps: int = 0
    consecutive_nonfinite: int = 0

    def state_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)

    def load_state_dict(self, d: dict[str, int]) -> None:
        for f in dataclasses.fields(self):
            setattr(self, f.name, int(d[f.name]))


@dataclass
class FitResult:
    step: int
    tokens: int
    stop_reason: str  # "finished", "signal" (SIGUSR1/SIGTERM), "interrupted", "wall_time", "stop_at_step"
    checkpoint: Optional[Path]
    requeued: bool = False
    val_losses: dict[int, float] = field(default_factory=dict)


@dataclass
class StepOutput:
    loss: float  # mean over the global batch (NaN when some micro-batch was not finite)
    grad_norm: float
    skipped: bool
    requeue_votes: int  # ranks that got SIGUSR1 / SIGTERM (stop, save, requeue under SLURM)
    stop_votes: int  # ranks that want to stop for another reason (Ctrl-C, wall-clock budget)


def train_step(fabric, model, optimizer, batches, plan: TrainPlan, lr: float, grad_clip: Optional[float],
               chunk_tokens: int, want_requeue: bool = False, want_stop: bool = False) -> StepOutput:
    """Accumulate ``plan.grad_accum_steps`` micro-batches, then step the optimizer unless the loss or
    the gradient norm is not finite (then the gradients are dropped and the step is skipped).

    One all-reduce per step carries the loss, the non-finite count and the stop votes of all ranks,
    so every rank takes the same decision.
    """
    for group in optimizer.param_groups:
        group["lr"] = lr
    device = fabric.device
    loss_sum = torch.zeros((), device=device)
    nonfinite = torch.zeros((), device=device)
    accum = plan.grad_accum_steps
    for micro in range(accum):
        batch = to_device(next(batches), device)
        last = micro == accum - 1
        sync_ctx = (fabric.no_backward_sync(model, enabled=not last) if fabric.world_size > 1
                    else contextlib.nullcontext())
        with sync_ctx:
            loss = forward_loss(model, batch, chunk_tokens)
            fabric.backward(loss / accum)
        loss = loss.detach()
        loss_sum += loss
        nonfinite += (~torch.isfinite(loss)).float()
    norm = fabric.clip_gradients(model, optimizer, max_norm=grad_clip if grad_clip else float("inf"),
                                 error_if_nonfinite=False)
    votes = torch.tensor([float(want_requeue), float(want_stop)], device=device)
    packed = fabric.all_reduce(torch.cat([torch.stack([loss_sum, nonfinite]), votes]), reduce_op="sum")
    loss_mean, bad, requeue_votes, stop_votes = (float(x) for x in packed.tolist())
    if hasattr(norm, "full_tensor"):  # FSDP2: the norm is a distributed tensor
        norm = norm.full_tensor()
    grad_norm = float(norm) if norm is not None else float("nan")
    skipped = bad > 0 or not math.isfinite(grad_norm)
    if not skipped:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return StepOutput(loss=loss_mean / (accum * fabric.world_size), grad_norm=grad_norm, skipped=skipped,
                      requeue_votes=int(requeue_votes), stop_votes=int(stop_votes))


def _set_cpu_threads(local_ranks: int, loader_workers: int, rank0: bool) -> None:
    """This rank's intra-op threads (:func:`gdn2.train.setup.cpu_threads`), said once."""
    cores = usable_cores()
    busy = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    threads = cpu_threads(cores, local_ranks, loader_workers, os.environ, busy)
    if threads is not None:
        torch.set_num_threads(threads)
    if rank0:
        log.info("CPU threads per rank: %d (%s)", torch.get_num_threads(),
                 "OMP_NUM_THREADS" if threads is None else
                 f"{cores} usable cores, load average {busy:.1f}, {local_ranks} rank(s) on this node, "
                 f"{loader_workers} loader worker(s) each; OMP_NUM_THREADS overrides")


def _report_adjusted_settings(recipe: Recipe, plan: TrainPlan, device_type: str) -> None:
    """Recipe values that do not take effect as written, said once at the start."""
    t = recipe.train
    if t.compile and device_type != "cuda":
        log.info("train.compile: true fuses with torch.compile on CUDA only; this run on %s runs eagerly", device_type)
    if t.recompute and t.activation_checkpointing:
        log.info("train.recompute: true has nothing to rebuild under train.activation_checkpointing (whole blocks "
                 "are recomputed); off for this run")
    asked = t.warmup_steps if t.warmup_steps is not None else round(t.warmup_fraction * plan.max_steps)
    if asked != plan.warmup_steps:
        log.info("train.warmup_steps: %d capped at the run's %d optimizer steps", asked, plan.max_steps)
    if t.max_steps is None and plan.max_steps * plan.tokens_per_step != t.max_tokens:
        log.info("train.max_tokens: %d rounded up to %d whole optimizer steps = %d tokens", t.max_tokens,
                 plan.max_steps, plan.max_steps * plan.tokens_per_step)


def fit(recipe: Recipe, resume: Optional[str] = None) -> FitResult:
    """Train the recipe's model; ``resume``: None, ``"auto"`` or a checkpoint path."""
    started = time.time()
    fabric, topology, precision = build_fabric(recipe)
    plan = make_plan(recipe, fabric.world_size)  # raises before any work on a bad batch layout
    budget = parse_duration(recipe.train.max_wall_time) if recipe.train.max_wall_time else None
    resume_candidates(resume, recipe.checkpoint_dir)  # a --resume path that does not exist fails here
    if resume is None and list_checkpoints(recipe.checkpoint_dir):
        raise ValueError(f"{recipe.checkpoint_dir} already holds checkpoints of an earlier run: continue it with "
                         "--resume auto, or start afresh in another --out_dir")

    fabric.launch()
    rank0 = fabric.global_rank == 0
    setup_logging(fabric.global_rank)
    slurm = SlurmJob.from_env() if topology.launcher == "slurm" else None
    out_dir = Path(recipe.out_dir)
    locks, refusal = lock_run_folders(recipe) if rank0 else ([], None)  # a second trainer stops here, every rank
    refusal = fabric.broadcast(refusal, src=0) if fabric.world_size > 1 else refusal
    if refusal is not None:
        raise told_elsewhere(ValueError(refusal), not rank0)  # rank 0 says it
    # a rank that dies or hangs ends every rank, with one line from one of them (gdn2.train.peers)
    peers = PeerWatch.start(fabric, recipe.checkpoint_dir, recipe.distributed.collective_timeout)
    # from here on SIGUSR1 / SIGTERM / SIGINT stop the run cleanly: one that comes while the model is built
    # is answered at the first step (a save, and a requeue under SLURM)
    signals = StopSignals().install()
    try:
        result = _fit(fabric, recipe, plan, resume, started, budget, topology, precision, slurm, out_dir, signals)
        if peers is not None:
            peers.close()
        return result
    except BaseException as error:
        if peers is not None:
            peers.on_error(error)  # returns for this rank's own error only
        raise
    finally:
        signals.restore()
        for lock in locks:
            lock.release()


def _fit(fabric, recipe: Recipe, plan: TrainPlan, resume: Optional[str], started: float, budget: Optional[float],
         topology, precision: str, slurm, out_dir: Path, signals: StopSignals) -> FitResult:
    rank0 = fabric.global_rank == 0
    resume_path = resolve_resume(resume, recipe.checkpoint_dir, fabric)
    changed = check_resume_compatible(recipe, resume_path, fabric.world_size) if resume_path else []
    if rank0 and resume_path is not None:
        supersede_newer(recipe.checkpoint_dir, resume_path)
    fabric.barrier()
    if rank0:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "config.yaml").write_text(recipe.to_yaml())
        print(recipe.to_yaml(), flush=True)
        if recipe.data.prepare_default:
            prepare_default_corpus(recipe)
    fabric.barrier()

    device_type = fabric.device.type
    if device_type == "cuda":
        torch.set_float32_matmul_precision("high")  # TF32 for whatever runs in fp32
    elif device_type == "cpu":
        _set_cpu_threads(fabric.world_size // topology.num_nodes, recipe.data.num_workers, rank0)
    model, optimizer, num_params = build_model_and_optimizer(fabric, recipe)
    device_name = torch.cuda.get_device_name(fabric.device) if device_type == "cuda" else "cpu"
    fpt = flops_per_token(recipe.model, plan.block_size)
    if rank0:
        with torch.device("meta"):
            block_params = GPT(recipe.model).num_parameters(blocks_only=True)
        write_run_info(out_dir, recipe, num_params, block_params, device_name, fabric.world_size, precision,
                       type(fabric.strategy).__name__)
        log.info("model %s: %.1fM parameters, %.3g FLOP/token; %d rank(s) on %s (%s, %s)", recipe.model.name,
                 num_params / 1e6, fpt, fabric.world_size, device_name, type(fabric.strategy).__name__, precision)
        log.info("global batch %d x %d = %d tokens; micro-batch %d x %d accumulation steps; %d optimizer steps "
                 "(%d warmup), %.3g tokens", plan.global_batch_size, plan.block_size, plan.tokens_per_step,
                 plan.micro_batch_size, plan.grad_accum_steps, plan.max_steps, plan.warmup_steps,
                 plan.max_steps * plan.tokens_per_step)
        _report_adjusted_settings(recipe, plan, device_type)

    check_vocabulary(recipe)
    sources = [(s.path, s.weight) for s in recipe.train_sources()]
    train_loader = TrainLoader(sources, plan.block_size, plan.micro_batch_size, seed=recipe.train.seed,
                               rank=fabric.global_rank, world_size=fabric.world_size,
                               num_workers=recipe.data.num_workers, document_masking=recipe.data.document_masking,
                               eos_id=recipe.data.eos_id, vocab_size=recipe.model.vocab_size)
    state = TrainState()
    trainer_state: dict = {}
    if resume_path is not None:
        loading = time.perf_counter()
        trainer_state, extras = load_checkpoint(fabric, resume_path, unwrap(model), unwrap(optimizer))
        load_seconds = time.perf_counter() - loading
        state.load_state_dict(trainer_state)
        train_loader.load_state_dict(extras["data"])
        set_rng_state(extras["rng"])
        # hyper-parameters come from the recipe, not from the checkpoint's param groups
        for group in optimizer.param_groups:
            decay_group = group.get("name") == "decay" or recipe.optimizer.decay_all
            group.update(betas=tuple(recipe.optimizer.betas), eps=recipe.optimizer.eps,
                         weight_decay=recipe.optimizer.weight_decay if decay_group else 0.0)
        log.info("resumed from %s at step %d (%d tokens); loaded in %.1f s", resume_path, state.step, state.tokens,
                 load_seconds)
        for line in changed:
            log.warning("changed since the checkpoint: %s", line)

    peak = recipe.logging.peak_flops
    if peak is None and device_type == "cuda":
        peak = peak_bf16_flops(device_name)
        if peak is None:
            log.warning("no dense bf16 peak known for %r: MFU is not logged (set --logging.peak_flops)", device_name)
    lg = recipe.logging
    metrics = MetricsLog(out_dir, enabled=rank0, jsonl=lg.jsonl, tensorboard=lg.tensorboard,
                         resume_step=state.step if resume_path is not None else None, csv=lg.csv, wandb=lg.wandb,
                         wandb_project=lg.wandb_project, wandb_mode=lg.wandb_mode, run_name=out_dir.name,
                         config=recipe.sections_dict())
    validator = Validator(fabric, model, recipe, metrics, plan.max_steps)
    lm_evaluator = LmEvaluator(fabric, model, recipe, metrics, plan.max_steps)

    from tqdm.auto import tqdm

    # a bar on a terminal; in a log file (SLURM) one line per logging interval instead
    bar = tqdm(total=plan.max_steps, initial=state.step, unit="step", dynamic_ncols=True,
               disable=not (rank0 and recipe.logging.progress_bar and sys.stderr.isatty()))
    train_log = TrainLog(metrics, recipe.logging.interval, plan.max_steps, state.step, fabric.world_size, fpt, peak,
                         fabric.device, bar, console=rank0 and bar.disable)
    if "train_log" in trainer_state:  # absent from checkpoints of earlier versions
        train_log.load_state_dict(trainer_state["train_log"])
    checkpointer = Checkpointer(fabric, recipe, model, optimizer, state, train_loader, plan.max_steps, resume_path,
                                train_log=train_log)
    profiler = StepProfiler(recipe.train.profile_steps, out_dir, fabric.global_rank)
    batches = iter(train_loader)
    last_step_time = 0.0
    stop_reason = "finished"
    try:
        while state.step < plan.max_steps:
            if recipe.train.stop_at_step is not None and state.step >= recipe.train.stop_at_step:
                stop_reason = "stop_at_step"
                break
            out_of_time = budget is not None and time.time() - started + last_step_time >= budget
            lr = cosine_with_warmup(state.step, recipe.optimizer.lr, plan.warmup_steps, plan.max_steps, plan.min_lr)
            profiler.before_step(state.step + 1)
            t0 = time.perf_counter()
            out = train_step(fabric, model, optimizer, batches, plan, lr, recipe.train.grad_clip,
                             recipe.train.loss_chunk_tokens, want_requeue=signals.requeue_wanted,
                             want_stop=signals.received == "SIGINT" or out_of_time)
            last_step_time = time.perf_counter() - t0
            state.step += 1
            profiler.after_step(state.step, end=state.step == plan.max_steps)
            state.tokens += plan.tokens_per_step
            bar.update(1)
            train_log.add(out.loss, out.skipped, last_step_time, plan.tokens_per_step)
            if out.skipped:
                _skipped(state, out, metrics, recipe, checkpointer.last, rank0)
            else:
                state.consecutive_nonfinite = 0
            train_log.maybe_log(state.step, state.tokens, lr, out.grad_norm, state.skipped_steps)
            validator.maybe_run(state.step)
            lm_evaluator.maybe_run(state.step)
            if out.requeue_votes > 0 or out.stop_votes > 0:
                # every rank sees the same votes, so every rank saves and stops here
                stop_reason = "signal" if out.requeue_votes > 0 else (
                    "interrupted" if signals.received == "SIGINT" else "wall_time")
                checkpointer.save()
                break
            checkpointer.maybe_save(state.step)

        if stop_reason == "stop_at_step":
            checkpointer.save()
        if stop_reason == "finished":
            validator.maybe_run(state.step, end=True)
            lm_evaluator.maybe_run(state.step, end=True)
            checkpointer.maybe_save(state.step, end=True)
    finally:
        bar.close()
        metrics.close()

    requeued = False
    if stop_reason == "signal" and slurm is not None and recipe.distributed.requeue:
        if rank0:
            requeued = requeue(slurm)
        fabric.barrier()
    if rank0:
        log.info("%s", stop_summary(state.step, stop_reason, requeued, checkpointer.last))
        _report_outputs(recipe, metrics, checkpointer.last)
    return FitResult(step=state.step, tokens=state.tokens, stop_reason=stop_reason, checkpoint=checkpointer.last,
                     requeued=requeued, val_losses=validator.last)


def stop_summary(step: int, stop_reason: str, requeued: bool, checkpoint: Optional[Path]) -> str:
    """The line that ends a run: where it stopped and why, and, before the end, how it continues."""
    text = f"stopped at step {step} ({stop_reason})"
    if requeued:
        return text + "; job requeued"
    if stop_reason != "finished" and checkpoint is not None:
        text += f"; saved {checkpoint}: the same command with --resume auto continues from it"
    return text


def _skipped(state: TrainState, out: StepOutput, metrics: MetricsLog, recipe: Recipe, last: Optional[Path],
             rank0: bool) -> None:
    """Count a skipped step; too many in a row stop the run, naming the last good checkpoint."""
    state.skipped_steps += 1
    state.consecutive_nonfinite += 1
    metrics.log(state.step, {"loss": out.loss, "grad_norm": out.grad_norm, "skipped_steps": state.skipped_steps},
                kind="skip")
    if rank0:
        log.warning("step %d skipped: loss %s, gradient norm %s (%d in a row, %d in all)", state.step, out.loss,
                    out.grad_norm, state.consecutive_nonfinite, state.skipped_steps)
    if state.consecutive_nonfinite > recipe.train.max_consecutive_nonfinite:
        raise NonFiniteLossError(
            f"{state.consecutive_nonfinite} optimizer steps in a row (up to step {state.step}) had a non-finite loss "
            f"or gradient norm, more than train.max_consecutive_nonfinite={recipe.train.max_consecutive_nonfinite}; "
            f"stopping without saving. The last good checkpoint is "
            f"{last or 'none (no checkpoint was written yet)'}")


def _report_outputs(recipe: Recipe, metrics: MetricsLog, last: Optional[Path]) -> None:
    """Where the run's results are, said once at the end."""
    where = [f"run folder {recipe.out_dir}"]
    if metrics.jsonl_path is not None:
        where.append(f"metrics {metrics.jsonl_path}")
    if recipe.logging.tensorboard:
        where.append(f"TensorBoard {Path(recipe.out_dir) / 'tensorboard'}")
    where.append(f"checkpoints {recipe.checkpoint_dir}" + (f" (newest {last.name})" if last else " (none)"))
    log.info("outputs: %s", "; ".join(where))
