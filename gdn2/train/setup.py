"""Everything a run needs before its first step: Fabric and the model, the data folders, the run
folder's ``run.json``, the checks of a resume, and the logger."""

from __future__ import annotations

import dataclasses
import json
import logging
import sys
import time
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any, Mapping, Optional

import torch

from gdn2.checkpoint.format import read_checkpoint_config, read_marker
from gdn2.config import Config
from gdn2.data.shards import PackedShardReader, find_shards, read_manifest
from gdn2.files import FolderLock
from gdn2.float8 import check_device, float8_spec
from gdn2.model import GPT, Block, flops_per_token
from gdn2.options import ModelOptions, apply_options
from gdn2.train.optimizer import build_optimizer, no_weight_decay_names
from gdn2.train.peers import set_collective_timeout
from gdn2.train.recipe import Recipe
from gdn2.train.slurm import Topology, resolve_topology

log = logging.getLogger("gdn2.train")


def cgroup_cpu_quota(root: Path = Path("/sys/fs/cgroup")) -> Optional[int]:
    """Whole cores of the CPU quota of this process's cgroup (a container's limit, which the CPU affinity
    does not show), rounded up; None without a quota. cgroup v2 ``cpu.max``, else v1's
    ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``."""
    import math

    try:
        text = (root / "cpu.max").read_text().split()
        quota, period = text[0], text[1]
    except (OSError, IndexError):
        try:
            quota = (root / "cpu" / "cpu.cfs_quota_us").read_text().strip()
            period = (root / "cpu" / "cpu.cfs_period_us").read_text().strip()
        except OSError:
            return None
    if quota in ("max", "-1"):
        return None
    try:
        return max(1, math.ceil(int(quota) / int(period)))
    except (ValueError, ZeroDivisionError):
        return None


def usable_cores() -> int:
    """The CPU cores this process may run on: its affinity, capped by its cgroup's CPU quota."""
    import os

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    quota = cgroup_cpu_quota()
    return min(cores, quota) if quota else cores


def cpu_threads(cores: int, local_ranks: int, loader_workers: int, env: Mapping[str, str],
                busy: float = 0.0) -> Optional[int]:
    """torch's intra-op threads for each rank of a CPU run; None when ``OMP_NUM_THREADS`` is set (then
    torch follows it).

    Each rank takes its share of the cores that other work does not already keep busy (``busy``: the
    machine's load average before the run starts), less its data-loader worker processes, and at least
    one thread (so never more than the cores, unless the ranks alone outnumber them). A compute thread
    that has to share its core with other work stalls every parallel region of the step: on a busy
    machine more threads made steps 10-30x slower, while on an idle one every core is worth having.
    """
    if env.get("OMP_NUM_THREADS", "").strip():
        return None
    free = max(1, cores - int(round(max(0.0, busy))))
    share = free // max(1, local_ranks)
    return max(1, share - max(0, loader_workers))


def resolve_accelerator(name: str) -> str:
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name in ("cuda", "gpu"):
        if not torch.cuda.is_available():
            raise ValueError(f"distributed.accelerator: {name!r} requested but no CUDA device is available")
        return "cuda"
    return "cpu"


RENDEZVOUS_SECONDS = 600.0


def build_fabric(recipe: Recipe, topology: Optional[Topology] = None):
    """A Lightning ``Fabric`` for the recipe: FSDP (one unit per Block) on several GPUs, DDP for several
    CPU processes, a single device otherwise; ``distributed.strategy: fsdp2`` shards with FSDP2 on GPUs or
    CPU processes."""
    from gdn2.train.fabric_api import DDPStrategy, Fabric, FSDPStrategy

    # Lightning warns whenever srun is on PATH and the process was not started by it; the launcher is
    # resolved here (resolve_topology), and a run on a SLURM login or CI node is not a mistake.
    warnings.filterwarnings("ignore", message="The `srun` command is available on your system")
    d = recipe.distributed
    topo = topology or resolve_topology(d.devices, d.num_nodes)
    accelerator = resolve_accelerator(d.accelerator)
    precision = d.precision if d.precision != "auto" else ("bf16-mixed" if accelerator == "cuda" else "32-true")
    devices = topo.devices
    if devices == "auto":
        devices = torch.cuda.device_count() if accelerator == "cuda" else 1
    world_size = devices * topo.num_nodes
    # the rendezvous and the collectives before the model is set up wait for slow starters at least
    # RENDEZVOUS_SECONDS; the run's own collective timeout applies from the model's setup on
    timeout = timedelta(seconds=max(d.collective_timeout, RENDEZVOUS_SECONDS))
    sharding = d.sharding if d.sharding != "auto" else ("hybrid" if topo.num_nodes > 1 else "full")
    replicas = d.replicas or topo.num_nodes
    if sharding == "hybrid" and world_size % replicas:
        raise ValueError(f"distributed.replicas: {replicas} replica groups do not divide {world_size} ranks")
    if world_size == 1:
        strategy: Any = "auto"
    elif d.strategy == "fsdp2":
        from gdn2.train.fabric_api import ModelParallelStrategy

        strategy = ModelParallelStrategy(
            parallelize_fn=lambda module, mesh: shard_with_fsdp2(
                module, accelerator, world_size, sharding, replicas, precision == "bf16-mixed"),
            data_parallel_size=world_size, tensor_parallel_size=1, timeout=timeout)
    elif d.strategy in ("auto", "fsdp") and accelerator == "cuda":
        from torch.distributed.fsdp import MixedPrecision

        kwargs: dict[str, Any] = {}
        if sharding == "hybrid":
            kwargs["device_mesh"] = (replicas, world_size // replicas)  # replicate across groups, shard inside
        strategy = FSDPStrategy(
            auto_wrap_policy={Block},
            activation_checkpointing_policy={Block} if recipe.train.activation_checkpointing else None,
            sharding_strategy={"full": "FULL_SHARD", "hybrid": "HYBRID_SHARD", "grad_op": "SHARD_GRAD_OP"}[sharding],
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
    fabric = Fabric(accelerator=accelerator, devices=devices, num_nodes=topo.num_nodes, strategy=strategy,
                      precision=precision)
    return fabric, topo, precision


def shard_with_fsdp2(module: torch.nn.Module, device_type: str, world_size: int, sharding: str, replicas: int,
                     bf16: bool) -> torch.nn.Module:
    """FSDP2 (``fully_shard``): each Block its own unit, then the root (embedding, final norm, head).
    ``full`` shards over every rank; ``hybrid`` over the ranks of each of ``replicas`` groups and
    replicates across groups (a 2-D mesh, as across nodes); ``grad_op`` keeps each unit's parameters
    gathered from forward to backward. bf16 compute and all-gathers, fp32 gradient reduction."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if sharding == "hybrid":
        mesh = init_device_mesh(device_type, (replicas, world_size // replicas), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh(device_type, (world_size,), mesh_dim_names=("shard",))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 \
        else MixedPrecisionPolicy()
    options = dict(mesh=mesh, mp_policy=policy, reshard_after_forward=sharding != "grad_op")
    for block in module.transformer.h:
        fully_shard(block, **options)
    fully_shard(module, **options)
    return module


def is_fsdp(fabric) -> bool:
    """FSDP1 (Fabric's FSDPStrategy), which builds the model on the meta device."""
    from gdn2.train.fabric_api import FSDPStrategy

    return isinstance(fabric.strategy, FSDPStrategy)


def model_options(recipe: Recipe, device: torch.device) -> ModelOptions:
    """The recipe's choices of how the model computes (``train`` section), for ``device``."""
    t = recipe.train
    spec = None
    if t.float8 is not None:
        spec = float8_spec(t.float8)
        check_device(spec, device)
    # under whole-block checkpointing the blocks keep nothing inside anyway
    return ModelOptions(compile=t.compile and device.type == "cuda", fused_loss=t.fused_loss,
                        grouped_projections=t.grouped_projections, float8=spec,
                        recompute=t.recompute and not t.activation_checkpointing)


def build_model_and_optimizer(fabric, recipe: Recipe):
    """(model, optimizer, parameter count) set up by Fabric. Under FSDP the model is built on the meta
    device and each rank materialises its own shards through the modules' ``reset_parameters``; under
    FSDP2 each rank builds it whole from the same seed and ``fully_shard`` keeps its own part (so the
    initial weights are those of a one-device run)."""
    fabric.seed_everything(recipe.train.seed, verbose=False)
    with fabric.init_module(empty_init=is_fsdp(fabric)):
        model = GPT(recipe.model)
    apply_options(model, model_options(recipe, fabric.device))
    num_params = sum(p.numel() for p in model.parameters())
    no_decay = no_weight_decay_names(model)  # decided on the bare model: FSDP loses shapes and attributes
    if recipe.train.activation_checkpointing and not is_fsdp(fabric):  # FSDP applies its own policy
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

        apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, Block))
    model = fabric.setup_module(model)
    set_collective_timeout(recipe.distributed.collective_timeout)  # every group, the device mesh's too
    optimizer = fabric.setup_optimizers(build_optimizer(model, no_decay, recipe.optimizer, fabric.device.type))
    return model, optimizer, num_params


DEFAULT_CORPUS = Path("data/default")


def prepare_default_corpus(recipe: Recipe) -> None:
    """Build the built-in corpus into ``data/default`` when the recipe reads it and it is not finished
    (its manifest and every shard it lists in place: shards alone may be those of a build still running).
    Under the folder's lock, so a trainer that finds another process building it waits for that build.
    Any other folder without shards is an error naming it: a mistyped path is never filled."""
    from gdn2.data_prep.default_corpus import build_default_corpus, finished_corpus

    folders = [s.path for s in recipe.train_sources()] + ([recipe.data.val] if recipe.data.val else [])
    for folder in dict.fromkeys(folders):
        if Path(folder) == DEFAULT_CORPUS or Path(folder).resolve() == DEFAULT_CORPUS.resolve():
            try:
                finished = finished_corpus(folder) is not None
            except ValueError:  # damaged or not matching its manifest: the build redoes it
                finished = False
            if not finished:
                log.info("building the built-in corpus in %s (python -m gdn2 corpus --output %s)", folder, folder)
                build_default_corpus(folder)
            continue
        train_folders = [s.path for s in recipe.train_sources()]
        split = "val" if folder == recipe.data.val and folder not in train_folders else "train"
        try:
            find_shards(folder, split=split)
        except FileNotFoundError:
            raise FileNotFoundError(
                f"data.train / data.val: {folder} holds no {split}_*.bin shards; data.prepare_default builds only the "
                f"built-in corpus in {DEFAULT_CORPUS} (prepare other data with python -m gdn2 prepare)") from None


def data_identity(source: str) -> dict[str, Any]:
    """What a run folder records of one data source: its tokenizer and size, from the manifest that
    ``prepare.py`` wrote (None where the folder has none)."""
    manifest = read_manifest(source) or {}
    tokenizer = manifest.get("tokenizer") or {}
    return {"path": source, "tokenizer_sha256": tokenizer.get("sha256"), "vocab_size": tokenizer.get("vocab_size"),
            "tokens": manifest.get("tokens"), "fingerprint": manifest.get("fingerprint")}


def tokenizer_sha256(recipe: Recipe) -> Optional[str]:
    """The sha256 of the tokenizer the training data was made with, as its manifests record it (None
    when none does, or when the sources disagree): saved in every checkpoint's marker, so that
    consolidation, export, generation and evaluation can tell the run's own tokenizer from another."""
    digests = {data_identity(s.path)["tokenizer_sha256"] for s in recipe.train_sources()} - {None}
    return digests.pop() if len(digests) == 1 else None


def write_run_info(out_dir: Path, recipe: Recipe, num_params: int, block_params: int, device_name: str,
                   world_size: int, precision: str, strategy: str) -> None:
    """``run.json`` in the run folder: what ran where, on which data (read by ``eval/compare.py``)."""
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


def check_resume_compatible(recipe: Recipe, checkpoint: Path, world_size: int) -> list[str]:
    """Raise ValueError when ``checkpoint`` holds another model or world size; return the training
    settings that changed (allowed, reported)."""
    saved = read_checkpoint_config(checkpoint)
    marker = read_marker(checkpoint)
    current = recipe.sections_dict()
    # a key the checkpoint's model config lacks came later, with a default that keeps the earlier model
    earlier = {f.name: f.default for f in dataclasses.fields(Config)}
    saved_model = {**earlier, **saved["model"]}
    model_diff = [f"model.{k}: checkpoint {saved_model.get(k)!r}, now {v!r}"
                  for k, v in current["model"].items() if k != "name" and saved_model.get(k) != v]
    if model_diff:
        raise ValueError(f"cannot resume from {checkpoint}: the model config differs ({'; '.join(model_diff)})")
    if marker["world_size"] != world_size:
        log.info("resuming on %d rank(s) a checkpoint written by %d: the model and optimizer are resharded and the "
                 "data continue from the same global sample", world_size, marker["world_size"])
    # the data loader continues the same global sample sequence: that needs the same seed and data
    for section, key in (("train", "seed"), ("data", "train")):
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


class _StderrHandler(logging.Handler):
    """Writes through tqdm, so a line never splits a progress bar, to whatever ``sys.stderr`` is at the
    time (it may be replaced, e.g. by test capture)."""

    def emit(self, record: logging.LogRecord) -> None:
        from tqdm import tqdm

        try:
            tqdm.write(self.format(record), file=sys.stderr)
        except Exception:  # noqa: BLE001 - logging must never break the run
            self.handleError(record)


def setup_logging(rank: int) -> None:
    """The ``gdn2`` loggers print on rank 0 (warnings only elsewhere); the root logger is left alone."""
    logger = logging.getLogger("gdn2")
    if not any(isinstance(h, _StderrHandler) for h in logger.handlers):
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S"))
        logger.addHandler(handler)
    logger.setLevel(logging.INFO if rank == 0 else logging.WARNING)


def lock_run_folders(recipe: Recipe) -> tuple[list[FolderLock], Optional[str]]:
    """Lock the run folder and the checkpoint folder (``<folder>/.lock`` each; rank 0 holds them while it
    trains), so that a second trainer on either is refused instead of interleaving its metrics with
    this one's, resuming this one's checkpoints or removing its temporary ones. Returns the locks taken
    and, when one is held elsewhere, the refusal to report (the locks taken so far are released)."""
    out_dir, checkpoint_dir = Path(recipe.out_dir), Path(recipe.checkpoint_dir)
    wanted = [(out_dir, "--out_dir")]
    if checkpoint_dir.resolve() != out_dir.resolve():
        wanted.append((checkpoint_dir, "--checkpoint.dir"))
    taken: list[FolderLock] = []
    for folder, flag in wanted:
        lock = FolderLock(folder)
        holder = lock.acquire()
        if holder is not None:
            for other in taken:
                other.release()
            return [], (f"{folder} is in use by another trainer ({holder}); wait for it to finish, or train with "
                        f"another {flag}")
        taken.append(lock)
    return taken, None


# Tokens read from each end of a shard that has no manifest to say which tokenizer made it.
VOCAB_SCAN_TOKENS = 1 << 20


def check_vocabulary(recipe: Recipe) -> None:
    """Every data source's token ids must lie below ``model.vocab_size``: from the tokenizer size its
    ``manifest.json`` records, or, without one, from a bounded scan of each shard's ends. ValueError
    naming the folder or shard (the training loader also checks every batch it reads)."""
    vocab = recipe.model.vocab_size
    sources = [("data.train", s.path) for s in recipe.train_sources()]
    sources += [("data.val", recipe.data.val)] if recipe.data.val else []
    for key, source in sources:
        manifest = read_manifest(source)
        recorded = ((manifest or {}).get("tokenizer") or {}).get("vocab_size")
        if isinstance(recorded, int):
            if recorded > vocab:
                raise ValueError(f"{key}: {source} was tokenised with a {recorded}-piece tokenizer (manifest.json), "
                                 f"but model.vocab_size is {vocab}")
            continue
        split = "val" if key == "data.val" else "train"
        for shard in find_shards(source, split=split):
            tokens = PackedShardReader(shard).tokens
            for part in (tokens[:VOCAB_SCAN_TOKENS], tokens[-VOCAB_SCAN_TOKENS:]):
                if len(part) and int(part.max()) >= vocab:
                    raise ValueError(f"{key}: {shard} holds token id {int(part.max())}, not below model.vocab_size "
                                     f"{vocab}")
