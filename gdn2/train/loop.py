"""The training loop on Lightning Fabric: build, resume, step, validate, log, checkpoint, stop.

Read top to bottom: :func:`fit` composes the pieces of ``gdn2.train`` (recipe, optimizer, schedule,
loss, checkpoint, metrics, slurm) around one optimizer step, :func:`train_step`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional

import torch

from gdn2.data import TrainLoader, ValLoader, find_shards, read_manifest
from gdn2.layers.fused import set_compiled
from gdn2.model import GPT, Block, flops_per_token
from gdn2.train.checkpoint import (list_checkpoints, load_checkpoint, read_checkpoint_config, read_marker,
                                   resolve_resume, rng_state, save_checkpoint, set_rng_state)
from gdn2.train.loss import cross_entropy_fp32
from gdn2.train.metrics import MetricsLog, model_flops_utilization, peak_bf16_flops
from gdn2.train.optimizer import build_optimizer, clean_parameter_name, no_weight_decay_names
from gdn2.train.recipe import Recipe, TrainPlan, make_plan
from gdn2.train.schedule import cosine_with_warmup
from gdn2.train.slurm import SlurmJob, StopSignals, Topology, parse_duration, requeue, resolve_topology

log = logging.getLogger("gdn2.train")

REPO_ROOT = Path(__file__).resolve().parent.parent.parent


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


# --------------------------------------------------------------------------------------------------
# Fabric
# --------------------------------------------------------------------------------------------------

def resolve_accelerator(name: str) -> str:
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name in ("cuda", "gpu"):
        if not torch.cuda.is_available():
            raise ValueError(f"distributed.accelerator: {name!r} requested but no CUDA device is available")
        return "cuda"
    return "cpu"


def build_fabric(recipe: Recipe, topology: Optional[Topology] = None):
    """A ``lightning.Fabric`` for the recipe: FSDP (one unit per Block) on several GPUs, DDP for several
    CPU processes, a single device otherwise."""
    import lightning as L
    from lightning.fabric.strategies import DDPStrategy, FSDPStrategy

    d = recipe.distributed
    topo = topology or resolve_topology(d.devices, d.num_nodes)
    accelerator = resolve_accelerator(d.accelerator)
    precision = d.precision if d.precision != "auto" else ("bf16-mixed" if accelerator == "cuda" else "32-true")
    devices = topo.devices
    if devices == "auto":
        devices = torch.cuda.device_count() if accelerator == "cuda" else 1
    world_size = devices * topo.num_nodes
    timeout = timedelta(minutes=d.timeout_minutes)
    if world_size == 1:
        strategy: Any = "auto"
    elif d.strategy in ("auto", "fsdp") and accelerator == "cuda":
        from torch.distributed.fsdp import MixedPrecision

        sharding = d.sharding if d.sharding != "auto" else ("hybrid" if topo.num_nodes > 1 else "full")
        kwargs: dict[str, Any] = {}
        if sharding == "hybrid":
            kwargs["device_mesh"] = (topo.num_nodes, devices)  # replicate across nodes, shard inside one
        strategy = FSDPStrategy(
            auto_wrap_policy={Block},
            activation_checkpointing_policy={Block} if recipe.train.activation_checkpointing else None,
            sharding_strategy={"full": "FULL_SHARD", "hybrid": "HYBRID_SHARD", "grad_op": "SHARD_GRAD_OP"}[sharding],
            state_dict_type=recipe.checkpoint.state_dict_type,
            # bf16 compute and all-gathers, fp32 gradient reduction (Fabric's "bf16-mixed" alone would
            # reduce in bf16)
            mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            if precision == "bf16-mixed" else None,
            use_orig_params=True,
            limit_all_gathers=True,
            timeout=timeout,
            **kwargs,
        )
    elif d.strategy == "fsdp":
        raise ValueError("distributed.strategy: fsdp needs CUDA devices; use ddp for several CPU processes")
    else:
        strategy = DDPStrategy(timeout=timeout, process_group_backend="nccl" if accelerator == "cuda" else "gloo")
    fabric = L.Fabric(accelerator=accelerator, devices=devices, num_nodes=topo.num_nodes, strategy=strategy,
                      precision=precision)
    return fabric, topo, precision


def is_fsdp(fabric) -> bool:
    from lightning.fabric.strategies import FSDPStrategy

    return isinstance(fabric.strategy, FSDPStrategy)


def build_model_and_optimizer(fabric, recipe: Recipe):
    """(model, optimizer, parameter count) set up by Fabric. Under FSDP the model is built on the meta
    device and each rank materialises its own shards through the modules' ``reset_parameters``."""
    fabric.seed_everything(recipe.train.seed, verbose=False)
    set_compiled(recipe.train.compile and fabric.device.type == "cuda")
    with fabric.init_module(empty_init=is_fsdp(fabric)):
        model = GPT(recipe.model)
    num_params = sum(p.numel() for p in model.parameters())
    no_decay = no_weight_decay_names(model)  # decided on the bare model: FSDP loses shapes and attributes
    if recipe.train.activation_checkpointing and not is_fsdp(fabric):  # FSDP applies its own policy
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

        apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, Block))
    model = fabric.setup_module(model)
    optimizer = fabric.setup_optimizers(build_optimizer(model, no_decay, recipe.optimizer, fabric.device.type))
    return model, optimizer, num_params


# --------------------------------------------------------------------------------------------------
# data
# --------------------------------------------------------------------------------------------------

def prepare_default_corpus(recipe: Recipe) -> None:
    """Build the built-in corpus into every data folder of the recipe that holds no shards."""
    folders = [s.path for s in recipe.train_sources()] + ([recipe.data.val] if recipe.data.val else [])
    done: set[str] = set()
    for folder in folders:
        split = "val" if folder == recipe.data.val and folder not in [s.path for s in recipe.train_sources()] else "train"
        try:
            find_shards(folder, split=split)
            continue
        except (ValueError, FileNotFoundError):
            pass
        if folder in done or any(ch in folder for ch in "*?["):
            continue
        script = REPO_ROOT / "data_prep" / "default_corpus.py"
        log.info("no shards in %s: preparing the built-in corpus (%s --output %s)", folder, script, folder)
        subprocess.run([sys.executable, str(script), "--output", folder], check=True)
        done.add(folder)


def data_identity(source: str) -> dict[str, Any]:
    """What a run folder records of one data source: its tokenizer and size, from the manifest that
    ``prepare.py`` wrote (None where the folder has none)."""
    manifest = read_manifest(source) or {}
    tokenizer = manifest.get("tokenizer") or {}
    return {"path": source, "tokenizer_sha256": tokenizer.get("sha256"), "vocab_size": tokenizer.get("vocab_size"),
            "tokens": manifest.get("tokens"), "fingerprint": manifest.get("fingerprint")}


def write_run_info(out_dir: Path, recipe: Recipe, num_params: int, block_params: int, device_name: str,
                   world_size: int, precision: str, strategy: str) -> None:
    """``run.json`` in the run folder: what ran where, on which data (read by ``eval/compare.py``)."""
    import json

    info = {
        "config_name": recipe.config_name,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "device": device_name,
        "world_size": world_size,
        "precision": precision,
        "strategy": strategy,
        "parameters": num_params,
        "block_parameters": block_params,
        "flops_per_token": flops_per_token(recipe.model, recipe.model.block_size),
        "torch": torch.__version__,
        "data": {"train": [dict(data_identity(s.path), weight=s.weight) for s in recipe.train_sources()],
                 "val": data_identity(recipe.data.val) if recipe.data.val else None},
    }
    (out_dir / "run.json").write_text(json.dumps(info, indent=1) + "\n")


def build_val_loaders(recipe: Recipe, rank: int, world_size: int) -> dict[int, ValLoader]:
    """One finite loader per validation length (``eval.length_multipliers`` x block size)."""
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
    return loaders


def _to_device(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def _forward_loss(model, batch: dict[str, torch.Tensor], chunk_tokens: int) -> torch.Tensor:
    cu = batch.get("cu_seqlens")
    logits = model(batch["input_ids"], cu_seqlens=cu) if cu is not None else model(batch["input_ids"])
    return cross_entropy_fp32(logits, batch["labels"], chunk_tokens)


@torch.no_grad()
def evaluate(fabric, model, loaders: dict[int, ValLoader], chunk_tokens: int) -> dict[int, float]:
    """Mean validation loss per length over every rank's batches."""
    model.eval()
    results = {}
    for length, loader in loaders.items():
        total = torch.zeros(2, device=fabric.device, dtype=torch.float64)
        for batch in loader:
            batch = _to_device(batch, fabric.device)
            n = batch["labels"].numel()
            loss = _forward_loss(model, batch, chunk_tokens)
            total += torch.stack([loss.double() * n, torch.tensor(float(n), device=fabric.device, dtype=torch.float64)])
        total = fabric.all_reduce(total, reduce_op="sum")
        results[length] = float(total[0] / total[1])
    model.train()
    return results


# --------------------------------------------------------------------------------------------------
# one optimizer step
# --------------------------------------------------------------------------------------------------

@dataclass
class StepOutput:
    loss: float  # mean over the global batch (NaN when some micro-batch was not finite)
    grad_norm: float
    skipped: bool
    requeue_votes: int  # ranks that got SIGUSR1 / SIGTERM (stop, save, requeue under SLURM)
    stop_votes: int  # ranks that want to stop for another reason (Ctrl-C, wall-clock budget)


def full_model_copy(fabric, model, config) -> GPT:
    """A plain GPT on this rank's device holding the current full weights, for in-process evaluation
    (under FSDP every rank gathers the whole model for the duration)."""
    state: dict[str, torch.Tensor] = {}
    if is_fsdp(fabric):
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        with FSDP.summon_full_params(model.module, writeback=False):
            for name, p in model.named_parameters():
                state[clean_parameter_name(name)] = p.detach().clone()
    else:
        state = {clean_parameter_name(n): p.detach() for n, p in model.named_parameters()}
    with torch.device("meta"):
        plain = GPT(config)
    plain.load_state_dict(state, assign=True)
    return plain.to(fabric.device)


def run_lm_eval(fabric, model, recipe: Recipe) -> dict[str, float]:
    """lm-eval tasks (``lm_eval`` section) on the live model; every rank takes part, rank 0 logs."""
    from gdn2.evaluation import LOCAL_TASKS, evaluate_model
    from gdn2.checkpoint import find_run_tokenizer

    cfg = recipe.lm_eval
    tokenizer = cfg.tokenizer or find_run_tokenizer(recipe.sections_dict(), [Path.cwd()])
    if tokenizer is None:
        raise FileNotFoundError("lm_eval.tokenizer: no tokenizer.model found in the training data folders "
                                f"{recipe.data.train}; set lm_eval.tokenizer")
    include = cfg.include_path
    if include is not None and not Path(include).exists() and Path(include) == Path("eval/tasks"):
        include = LOCAL_TASKS  # the repository's own tasks, wherever the run was started from
    plain = full_model_copy(fabric, model, recipe.model)
    limit = None if cfg.limit is None else (int(cfg.limit) if cfg.limit >= 1 else cfg.limit)
    dtype = torch.bfloat16 if fabric.device.type == "cuda" else torch.float32
    with torch.autocast(fabric.device.type, dtype=dtype, enabled=dtype != torch.float32):
        scores = evaluate_model(plain, tokenizer, cfg.tasks, limit=limit, include_path=include,
                                batch_size=cfg.batch_size)
    del plain
    return {k: float(v) for k, v in scores.items() if isinstance(v, (int, float))}


def train_step(fabric, model, optimizer, batches, plan: TrainPlan, lr: float, grad_clip: Optional[float],
               chunk_tokens: int, want_requeue: bool = False, want_stop: bool = False,
               inject_nan: bool = False) -> StepOutput:
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
        batch = _to_device(next(batches), device)
        last = micro == accum - 1
        sync_ctx = (fabric.no_backward_sync(model, enabled=not last) if fabric.world_size > 1
                    else contextlib.nullcontext())
        with sync_ctx:
            loss = _forward_loss(model, batch, chunk_tokens)
            if inject_nan:
                loss = loss * float("nan")
            fabric.backward(loss / accum)
        loss = loss.detach()
        loss_sum += loss
        nonfinite += (~torch.isfinite(loss)).float()
    norm = fabric.clip_gradients(model, optimizer, max_norm=grad_clip if grad_clip else float("inf"),
                                 error_if_nonfinite=False)
    votes = torch.tensor([float(want_requeue), float(want_stop)], device=device)
    packed = fabric.all_reduce(torch.cat([torch.stack([loss_sum, nonfinite]), votes]), reduce_op="sum")
    loss_mean, bad, requeue_votes, stop_votes = (float(x) for x in packed.tolist())
    grad_norm = float(norm) if norm is not None else float("nan")
    skipped = bad > 0 or not math.isfinite(grad_norm)
    if not skipped:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return StepOutput(loss=loss_mean / (accum * fabric.world_size), grad_norm=grad_norm, skipped=skipped,
                      requeue_votes=int(requeue_votes), stop_votes=int(stop_votes))


# --------------------------------------------------------------------------------------------------
# resume compatibility
# --------------------------------------------------------------------------------------------------

def check_resume_compatible(recipe: Recipe, checkpoint: Path, world_size: int) -> list[str]:
    """Raise ValueError when ``checkpoint`` holds another model or world size; return the training
    settings that changed (allowed, reported)."""
    saved = read_checkpoint_config(checkpoint)
    marker = read_marker(checkpoint)
    current = recipe.sections_dict()
    model_diff = [f"model.{k}: checkpoint {saved['model'].get(k)!r}, now {v!r}"
                  for k, v in current["model"].items() if k != "name" and saved["model"].get(k) != v]
    if model_diff:
        raise ValueError(f"cannot resume from {checkpoint}: the model config differs ({'; '.join(model_diff)})")
    if marker["world_size"] != world_size:
        raise ValueError(
            f"cannot resume from {checkpoint}: it was written by {marker['world_size']} ranks and this run has "
            f"{world_size}; the data order (and train.micro_batch_size) must stay the same for an exact resume")
    # the data loader's position is a micro-batch count: it only carries over to the same sample sequence
    for section, key in (("train", "micro_batch_size"), ("train", "seed"), ("data", "train")):
        old, new = (saved.get(section) or {}).get(key), current[section][key]
        if old != new:
            raise ValueError(f"cannot resume from {checkpoint}: {section}.{key} changed ({old!r} -> {new!r}), so the "
                             "data loader cannot continue the same sample sequence")
    changed = []
    for section, values in current.items():
        if section == "model":
            continue
        for k, v in values.items():
            old = (saved.get(section) or {}).get(k)
            if old != v:
                changed.append(f"{section}.{k}: {old!r} -> {v!r}")
    return changed


# --------------------------------------------------------------------------------------------------
# the run
# --------------------------------------------------------------------------------------------------

def _format_seconds(seconds: float) -> str:
    seconds = int(seconds)
    days, rest = divmod(seconds, 86400)
    text = f"{rest // 3600:02d}:{rest % 3600 // 60:02d}:{rest % 60:02d}"
    return f"{days}d {text}" if days else text


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is at the time (it may be replaced, e.g. by test capture)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass


def _setup_logging(rank: int) -> None:
    """The ``gdn2`` loggers print on rank 0 (warnings only elsewhere); the root logger is left alone."""
    logger = logging.getLogger("gdn2")
    if not any(isinstance(h, _StderrHandler) for h in logger.handlers):
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S"))
        logger.addHandler(handler)
    logger.setLevel(logging.INFO if rank == 0 else logging.WARNING)


def fit(recipe: Recipe, resume: Optional[str] = None) -> FitResult:
    """Train the recipe's model; ``resume``: None, ``"auto"`` or a checkpoint path."""
    started = time.time()
    fabric, topology, precision = build_fabric(recipe)
    plan = make_plan(recipe, fabric.world_size)  # raises before any work on a bad batch layout
    budget = parse_duration(recipe.train.max_wall_time) if recipe.train.max_wall_time else None
    resume_path = resolve_resume(resume, recipe.checkpoint_dir)
    changed = check_resume_compatible(recipe, resume_path, fabric.world_size) if resume_path else []
    if resume_path is None and list_checkpoints(recipe.checkpoint_dir):
        raise ValueError(f"{recipe.checkpoint_dir} already holds checkpoints of an earlier run: continue it with "
                         "--resume auto, or start afresh in another --out_dir")

    fabric.launch()
    rank0 = fabric.global_rank == 0
    _setup_logging(fabric.global_rank)
    slurm = SlurmJob.from_env() if topology.launcher == "slurm" else None

    out_dir = Path(recipe.out_dir)
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
    model, optimizer, num_params = build_model_and_optimizer(fabric, recipe)
    device_name = torch.cuda.get_device_name(fabric.device) if device_type == "cuda" else "cpu"
    if rank0:
        with torch.device("meta"):
            block_params = GPT(recipe.model).num_parameters(blocks_only=True)
        write_run_info(out_dir, recipe, num_params, block_params, device_name, fabric.world_size, precision,
                       type(fabric.strategy).__name__)

    sources = [(s.path, s.weight) for s in recipe.train_sources()]
    train_loader = TrainLoader(sources, plan.block_size, plan.micro_batch_size, seed=recipe.train.seed,
                               rank=fabric.global_rank, world_size=fabric.world_size,
                               num_workers=recipe.data.num_workers, document_masking=recipe.data.document_masking,
                               eos_id=recipe.data.eos_id)
    val_loaders = build_val_loaders(recipe, fabric.global_rank, fabric.world_size)

    state = TrainState()
    if resume_path is not None:
        trainer_state, extras = load_checkpoint(fabric, resume_path, model, optimizer)
        state.load_state_dict(trainer_state)
        train_loader.load_state_dict(extras["data"])
        set_rng_state(extras["rng"])
        # hyper-parameters come from the recipe, not from the checkpoint's param groups
        for group in optimizer.param_groups:
            decay_group = group.get("name") == "decay" or recipe.optimizer.decay_all
            group.update(betas=tuple(recipe.optimizer.betas), eps=recipe.optimizer.eps,
                         weight_decay=recipe.optimizer.weight_decay if decay_group else 0.0)
        log.info("resumed from %s at step %d (%d tokens)", resume_path, state.step, state.tokens)
        for line in changed:
            log.warning("changed since the checkpoint: %s", line)

    peak = recipe.logging.peak_flops
    if peak is None and device_type == "cuda":
        peak = peak_bf16_flops(device_name)
        if peak is None:
            log.warning("no dense bf16 peak known for %r: MFU is not logged (set --logging.peak_flops)", device_name)
    fpt = flops_per_token(recipe.model, plan.block_size)
    if rank0:
        log.info("model %s: %.1fM parameters, %.3g FLOP/token; %d rank(s) on %s (%s, %s)", recipe.model.name,
                 num_params / 1e6, fpt, fabric.world_size, device_name, type(fabric.strategy).__name__,
                 precision)
        log.info("global batch %d x %d = %d tokens; micro-batch %d x %d accumulation steps; %d optimizer steps "
                 "(%d warmup), %.3g tokens", plan.global_batch_size, plan.block_size, plan.tokens_per_step,
                 plan.micro_batch_size, plan.grad_accum_steps, plan.max_steps, plan.warmup_steps,
                 plan.max_steps * plan.tokens_per_step)
    metrics = MetricsLog(out_dir, enabled=rank0, jsonl=recipe.logging.jsonl, tensorboard=recipe.logging.tensorboard,
                         resume_step=state.step if resume_path is not None else None)

    def checkpoint_now() -> Path:
        crash_step = recipe.debug.crash_in_checkpoint_at_step

        def crash() -> None:
            if crash_step == state.step:
                sys.stdout.flush()
                os._exit(17)  # like a kill -9 in the middle of the save

        trainer = {"model": model, "optimizer": optimizer, "trainer": state.state_dict()}
        path = save_checkpoint(
            fabric, recipe.checkpoint_dir, state.step, trainer,
            rank_state={"data": train_loader.state_dict(), "rng": rng_state(), "rank": fabric.global_rank},
            config_yaml=recipe.to_yaml(), info={"tokens": state.tokens, "config_name": recipe.config_name},
            keep_last=recipe.checkpoint.keep_last, before_commit=crash if crash_step is not None else None)
        if rank0:
            log.info("saved checkpoint %s", path)
        return path

    def validate() -> dict[int, float]:
        if not val_loaders:
            return {}
        losses = evaluate(fabric, model, val_loaders, recipe.train.loss_chunk_tokens)
        record = {}
        for length, value in losses.items():
            record[f"val/loss_{length}"] = value
            record[f"val/ppl_{length}"] = math.exp(min(value, 50.0))
        metrics.log(state.step, record, kind="val")
        if rank0:
            log.info("step %d validation: %s", state.step,
                     ", ".join(f"{length} tokens loss {v:.4f}" for length, v in losses.items()))
        return losses

    def lm_evaluate() -> None:
        scores = run_lm_eval(fabric, model, recipe)
        metrics.log(state.step, {f"lm_eval/{k}": v for k, v in scores.items()}, kind="lm_eval")
        if rank0:
            log.info("step %d lm-eval: %s", state.step, ", ".join(f"{k} {v:.4f}" for k, v in scores.items()))

    from tqdm.auto import tqdm

    # a bar on a terminal; in a log file (SLURM) one line per logging interval instead
    bar = tqdm(total=plan.max_steps, initial=state.step, unit="step", dynamic_ncols=True,
               disable=not (rank0 and recipe.logging.progress_bar and sys.stderr.isatty()))
    loop_started, first_step = time.time(), state.step
    batches = iter(train_loader)
    nan_steps = set(recipe.debug.nonfinite_loss_at_steps)
    window = {"loss": 0.0, "n": 0, "time": 0.0, "tokens": 0}
    last_checkpoint: Optional[Path] = resume_path
    last_val: dict[int, float] = {}
    last_step_time = 0.0
    stop_reason = "finished"
    signals = StopSignals().install()  # from here on SIGUSR1 / SIGTERM / SIGINT stop the run cleanly
    try:
        while state.step < plan.max_steps:
            if recipe.train.stop_at_step is not None and state.step >= recipe.train.stop_at_step:
                stop_reason = "stop_at_step"
                break
            out_of_time = budget is not None and time.time() - started + last_step_time >= budget
            lr = cosine_with_warmup(state.step, recipe.optimizer.lr, plan.warmup_steps, plan.max_steps, plan.min_lr)
            t0 = time.perf_counter()
            out = train_step(fabric, model, optimizer, batches, plan, lr, recipe.train.grad_clip,
                             recipe.train.loss_chunk_tokens, want_requeue=signals.requeue_wanted,
                             want_stop=signals.received == "SIGINT" or out_of_time,
                             inject_nan=state.step + 1 in nan_steps)
            last_step_time = time.perf_counter() - t0
            state.step += 1
            state.tokens += plan.tokens_per_step
            window["time"] += last_step_time
            window["tokens"] += plan.tokens_per_step
            bar.update(1)

            if out.skipped:
                state.skipped_steps += 1
                state.consecutive_nonfinite += 1
                metrics.log(state.step, {"loss": out.loss, "grad_norm": out.grad_norm,
                                         "skipped_steps": state.skipped_steps}, kind="skip")
                if rank0:
                    log.warning("step %d skipped: loss %s, gradient norm %s (%d in a row, %d in all)", state.step,
                                out.loss, out.grad_norm, state.consecutive_nonfinite, state.skipped_steps)
                if state.consecutive_nonfinite > recipe.train.max_consecutive_nonfinite:
                    raise NonFiniteLossError(
                        f"{state.consecutive_nonfinite} optimizer steps in a row (up to step {state.step}) had a "
                        f"non-finite loss or gradient norm, more than train.max_consecutive_nonfinite="
                        f"{recipe.train.max_consecutive_nonfinite}; stopping without saving. The last good "
                        f"checkpoint is {last_checkpoint or 'none (no checkpoint was written yet)'}")
            else:
                state.consecutive_nonfinite = 0
                window["loss"] += out.loss
                window["n"] += 1

            if state.step % recipe.logging.interval == 0 or state.step == plan.max_steps:
                tps = window["tokens"] / max(window["time"], 1e-9) / fabric.world_size
                loss = window["loss"] / window["n"] if window["n"] else float("nan")
                record = {"loss": loss, "ppl": math.exp(min(loss, 50.0)) if window["n"] else float("nan"),
                          "lr": lr, "grad_norm": out.grad_norm, "tokens": state.tokens,
                          "tokens_per_sec_per_device": tps, "skipped_steps": state.skipped_steps,
                          "step_time": window["time"] / max(1, recipe.logging.interval)}
                mfu = model_flops_utilization(fpt, tps, peak)
                if mfu is not None:
                    record["mfu"] = mfu
                if device_type == "cuda":
                    record["peak_memory_gib"] = torch.cuda.max_memory_allocated(fabric.device) / 2**30
                metrics.log(state.step, record)
                bar.set_postfix(loss=f"{loss:.4f}", lr=f"{lr:.2e}", tok_s=f"{tps:,.0f}", refresh=False)
                if rank0 and bar.disable:
                    per_step = (time.time() - loop_started) / (state.step - first_step)
                    log.info("step %d/%d loss %.4f lr %.3e grad norm %.3f %s tokens/s/device%s, ETA %s", state.step,
                             plan.max_steps, loss, lr, out.grad_norm, f"{tps:,.0f}",
                             f" MFU {mfu:.1%}" if mfu is not None else "",
                             _format_seconds(per_step * (plan.max_steps - state.step)))
                window = {"loss": 0.0, "n": 0, "time": 0.0, "tokens": 0}

            e, c = recipe.eval, recipe.checkpoint
            if e.interval and state.step % e.interval == 0 and (state.step < plan.max_steps or not e.at_end):
                last_val = validate()
            le = recipe.lm_eval
            if le.interval and state.step % le.interval == 0 and (state.step < plan.max_steps or not le.at_end):
                lm_evaluate()
            # no periodic checkpoint inside a run of skipped steps: it would rotate out older good ones
            periodic = (c.interval and state.step % c.interval == 0 and state.consecutive_nonfinite == 0
                        and (state.step < plan.max_steps or not c.at_end))
            if out.requeue_votes > 0 or out.stop_votes > 0:
                # every rank sees the same votes, so every rank saves and stops here
                if out.requeue_votes > 0:
                    stop_reason = "signal"
                else:
                    stop_reason = "interrupted" if signals.received == "SIGINT" else "wall_time"
                last_checkpoint = checkpoint_now()
                break
            if periodic:
                last_checkpoint = checkpoint_now()

        if stop_reason == "stop_at_step":
            last_checkpoint = checkpoint_now()
        if stop_reason == "finished":
            if recipe.eval.at_end:
                last_val = validate()
            if recipe.lm_eval.at_end:
                lm_evaluate()
            if recipe.checkpoint.at_end:
                last_checkpoint = checkpoint_now()
    finally:
        bar.close()
        metrics.close()
        signals.restore()

    requeued = False
    if stop_reason == "signal" and slurm is not None and recipe.distributed.requeue:
        if rank0:
            requeued = requeue(slurm)
        fabric.barrier()
    if rank0:
        log.info("stopped at step %d (%s)%s", state.step, stop_reason, "; job requeued" if requeued else "")
    return FitResult(step=state.step, tokens=state.tokens, stop_reason=stop_reason, checkpoint=last_checkpoint,
                     requeued=requeued, val_losses=last_val)
