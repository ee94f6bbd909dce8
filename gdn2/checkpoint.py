"""Checkpoints, for training and for everything that reads one: one module, one rule for parameter names.

Training checkpoint: one folder ``<dir>/step-<step:09d>/``::

    state            model + optimizer + trainer counters, under the bare model's names: a folder of
                     torch.distributed.checkpoint shards (state_dict_type "sharded", the default; the
                     counters in state/meta.pt) or one file of full tensors ("full"). Either resumes
                     on any number of ranks, with any strategy.
    ranks/rank-<r>.pt  per rank: data-loader state and RNG states
    config.yaml      the resolved recipe
    COMPLETE         JSON marker, written last: step, tokens, world size, and the size and sha256 of
                     every other file of the checkpoint

Every rank writes into ``.step-<step>.tmp/`` directly (no staging elsewhere); after a barrier the
ranks hash the files between them, rank 0 writes ``COMPLETE`` and renames the folder to its final
name (an atomic rename within one file system). A folder without the marker, or still under its
temporary name, is never picked for resuming, so a crash mid-save leaves the previous checkpoint as
the newest complete one. Loading verifies the recorded sizes and hashes, so a damaged file is named
instead of being trained on; ``--resume auto`` then falls back to the newest intact checkpoint.

Consolidated checkpoint (``python -m gdn2 consolidate``): ``<run>/final/model.pt`` =
``{"model": fp32 state dict, "config": model config, "step", "tokens", "recipe"}`` with its sha256,
``config.yaml`` and ``tokenizer.model`` beside it.

Reading for inference: :func:`read_checkpoint` finds the weights (a consolidated file, a training
checkpoint folder, or a folder of those), the config that belongs to them (saved in the checkpoint,
or a run config beside it) and the tokenizer (beside it, or where the run's data came from);
:func:`load_model` builds the GPT from them.

Parameter names are those of the bare model everywhere: :func:`bare_parameter_name` drops the name
segments that Fabric, FSDP, DDP, activation checkpointing and torch.compile insert.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import re
import shutil
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import numpy as np
import torch
import yaml

from gdn2.config import Config
from gdn2.durable import fsync_dir
from gdn2.model import GPT
from gdn2.tokenizer import TOKENIZER_FILE, Tokenizer

log = logging.getLogger(__name__)

# Name segments that Fabric, FSDP, DDP ("module"), activation checkpointing and torch.compile insert.
WRAPPER_SEGMENTS = frozenset({"_forward_module", "_fsdp_wrapped_module", "_checkpoint_wrapped_module",
                              "_orig_mod", "module"})


def bare_parameter_name(name: str) -> str:
    """``name`` without wrapper segments: the name the parameter has in the bare model."""
    return ".".join(part for part in name.split(".") if part not in WRAPPER_SEGMENTS)


def bare_state_dict(state: dict[str, Any]) -> dict[str, Any]:
    return {bare_parameter_name(k): v for k, v in state.items()}



MARKER = "COMPLETE"
STATE = "state"
SHARDED_META = "meta.pt"  # inside a sharded state folder: the trainer counters
RANKS = "ranks"
CONFIG = "config.yaml"
_NAME = re.compile(r"^step-(\d+)$")
SUPERSEDED = "superseded"
HASH_BLOCK = 8 << 20


class CorruptCheckpointError(ValueError):
    """A checkpoint whose files do not match what its marker recorded; the message names the file."""


def checkpoint_name(step: int) -> str:
    return f"step-{step:09d}"


def is_complete(path: Path) -> bool:
    return (path / MARKER).is_file() and _NAME.match(path.name) is not None


def read_marker(path: Path) -> dict[str, Any]:
    """The ``COMPLETE`` marker of checkpoint ``path``; ValueError when it is not a complete checkpoint,
    CorruptCheckpointError when the marker itself is damaged."""
    path = Path(path)
    if not is_complete(path):
        raise ValueError(f"{path} is not a complete checkpoint (no {MARKER} marker or not named step-<N>)")
    try:
        marker = json.loads((path / MARKER).read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CorruptCheckpointError(f"{path / MARKER}: damaged marker ({error})") from None
    if not isinstance(marker, dict) or not isinstance(marker.get("step"), int):
        raise CorruptCheckpointError(f"{path / MARKER}: damaged marker (no step)")
    return marker


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(HASH_BLOCK):
            digest.update(block)
    return digest.hexdigest()


def _files_of(folder: Path) -> list[str]:
    """Every file of a checkpoint folder but its marker, as sorted relative paths."""
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file() and p.name != MARKER)


def _gather(fabric: Any, obj: Any) -> list[Any]:
    if fabric is None or fabric.world_size == 1:
        return [obj]
    import torch.distributed as dist

    out: list[Any] = [None] * fabric.world_size
    dist.all_gather_object(out, obj)
    return out


def _share(fabric: Any) -> tuple[int, int]:
    return (0, 1) if fabric is None else (fabric.global_rank, fabric.world_size)


def digest_files(folder: Path, fabric: Any = None) -> dict[str, dict[str, Any]]:
    """``{relative path: {"size", "sha256"}}`` of a checkpoint folder's files, hashed by the ranks
    between them (every rank gets the whole table)."""
    rank, world = _share(fabric)
    mine = {rel: {"size": (folder / rel).stat().st_size, "sha256": file_sha256(folder / rel)}
            for rel in _files_of(folder)[rank::world]}
    table: dict[str, dict[str, Any]] = {}
    for part in _gather(fabric, mine):
        table.update(part)
    return dict(sorted(table.items()))


def check_structure(path: Path) -> Optional[str]:
    """Why checkpoint ``path`` cannot be loaded without reading its data (a damaged marker, a missing
    or truncated file), or None."""
    try:
        marker = read_marker(path)
    except ValueError as error:
        return str(error)
    for rel, meta in (marker.get("files") or {}).items():
        file = Path(path) / rel
        if not file.is_file():
            return f"{file}: missing"
        if file.stat().st_size != meta["size"]:
            return f"{file}: {file.stat().st_size} bytes, {meta['size']} recorded (truncated or overwritten)"
    return None


def verify_checkpoint(path: Path, fabric: Any = None) -> None:
    """Check every file of checkpoint ``path`` against the sizes and sha256 its marker records (each
    rank a share); CorruptCheckpointError naming the first bad file. Checkpoints written before
    checksums were recorded pass on their structure alone."""
    path = Path(path)
    problem = check_structure(path)
    files = read_marker(path).get("files") if problem is None else None
    problems = [problem] if problem else []
    if files and not problems:
        rank, world = _share(fabric)
        for rel in sorted(files)[rank::world]:
            if file_sha256(path / rel) != files[rel]["sha256"]:
                problems.append(f"{path / rel}: content differs from its recorded sha256 (corrupted)")
                break
    problems = [p for part in _gather(fabric, problems) for p in part]
    if problems:
        raise CorruptCheckpointError(problems[0])


def read_checkpoint_config(path: Path) -> dict[str, Any]:
    """The resolved recipe (all sections) saved with checkpoint ``path``."""
    with open(Path(path) / CONFIG) as f:
        return yaml.safe_load(f)


def list_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints under ``root`` as (step, path), oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        m = _NAME.match(child.name)
        if m and child.is_dir() and (child / MARKER).is_file():
            found.append((int(m.group(1)), child))
    return sorted(found)


def resume_candidates(resume: Optional[str], root: Path) -> tuple[list[Path], bool]:
    """The checkpoints ``--resume`` may continue from, newest first, and whether falling back to an
    older one is allowed (``auto``, or a folder of checkpoints; not a named ``step-<N>``).

    ``auto``: the complete checkpoints under ``root`` (none: start from scratch). A path: that
    checkpoint, or the complete ones inside it when it is a folder of checkpoints. ValueError for a
    path that holds no complete checkpoint.
    """
    if resume is None or resume == "":
        return [], False
    if resume == "auto":
        return [p for _, p in reversed(list_checkpoints(root))], True
    path = Path(resume)
    if not path.exists():
        raise ValueError(f"--resume: {resume} does not exist")
    if _NAME.match(path.name):
        if not is_complete(path):
            raise ValueError(f"--resume: {resume} is an incomplete checkpoint (a save was interrupted); "
                             f"pick an older one or --resume auto")
        return [path], False
    found = list_checkpoints(path)
    if not found:
        raise ValueError(f"--resume: no complete checkpoint (step-<N> folder with a {MARKER} marker) in {resume}")
    return [p for _, p in reversed(found)], True


def resolve_resume(resume: Optional[str], root: Path, fabric: Any = None) -> Optional[Path]:
    """The checkpoint to continue from (None: start from scratch), verified against its checksums.

    With ``auto`` (or a folder of checkpoints) a damaged or incomplete newest checkpoint is skipped,
    saying which and why, for the newest intact one; a named ``step-<N>`` that is damaged is an
    error naming the bad file. Every rank calls this (they share the hashing).
    """
    candidates, fallback = resume_candidates(resume, root)
    skipped = []
    for path in candidates:
        try:
            verify_checkpoint(path, fabric)
        except CorruptCheckpointError as error:
            if not fallback:
                raise
            skipped.append(f"{path.name} ({error})")
            if fabric is None or fabric.global_rank == 0:
                log.warning("skipping checkpoint %s: %s", path, error)
            continue
        return path
    if skipped:
        raise CorruptCheckpointError(f"--resume {resume}: no intact checkpoint in {root}: " + "; ".join(skipped))
    return None


def supersede_newer(root: Path, resumed: Path) -> list[Path]:
    """Checkpoints newer than the one a run resumes from belong to the trajectory it replaces: move
    them (and damaged ones skipped on the way) to ``<root>/superseded/<time>/``, out of the way of
    ``--resume auto`` and of this run's own saves, without deleting anything. Rank 0 only."""
    step = int(_NAME.match(resumed.name).group(1))
    newer = [p for p in sorted(Path(root).glob("step-*")) if p.is_dir() and _NAME.match(p.name)
             and int(_NAME.match(p.name).group(1)) > step]
    if not newer:
        return []
    target = Path(root) / SUPERSEDED / time.strftime("%Y%m%d-%H%M%S")
    target.mkdir(parents=True, exist_ok=True)
    moved = []
    for path in newer:
        os.replace(path, target / path.name)
        moved.append(target / path.name)
    fsync_dir(Path(root))
    log.warning("resuming from %s: the newer checkpoints %s belong to the run this one replaces; moved to %s",
                resumed.name, ", ".join(p.name for p in newer), target)
    return moved


def rng_state() -> dict[str, Any]:
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def write_marker(path: Path, marker: dict[str, Any]) -> None:
    """The ``COMPLETE`` marker: the last file of a checkpoint, written durably."""
    with open(path / MARKER, "w") as f:
        json.dump(marker, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def save_checkpoint(fabric: Any, root: Path, step: int, state: dict[str, Any], rank_state: dict[str, Any],
                    config_yaml: str, info: dict[str, Any], keep_last: int, sharded: bool = True) -> Path:
    """Write checkpoint ``step`` under ``root`` atomically; every rank calls this.

    ``state``: ``{"model", "optimizer", "trainer": dict}`` (see :func:`save_state`; ``sharded``: its format).
    ``rank_state``: this rank's picklable extras (data loader, RNG). ``info`` goes into the marker.
    Afterwards only the newest ``keep_last`` complete checkpoints are kept.
    """
    root = Path(root)
    final = root / checkpoint_name(step)
    tmp = root / f".{checkpoint_name(step)}.tmp"
    if final.exists() and is_complete(final):
        log.info("checkpoint %s already exists; not written again", final)
        return final
    if fabric.global_rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        for stale in [tmp, final]:  # leftovers of an interrupted save of this same step
            if stale.exists():
                shutil.rmtree(stale)
    fabric.barrier()

    save_state(fabric, tmp / STATE, state, sharded=sharded)
    ranks = tmp / RANKS
    ranks.mkdir(parents=True, exist_ok=True)
    torch.save(rank_state, ranks / f"rank-{fabric.global_rank:05d}.pt")
    if fabric.global_rank == 0:
        (tmp / CONFIG).write_text(config_yaml)
    fabric.barrier()
    files = digest_files(tmp, fabric)

    if fabric.global_rank == 0:
        write_marker(tmp, dict(info, step=step, world_size=fabric.world_size, saved_at=time.time(), files=files))
        os.replace(tmp, final)
        fsync_dir(root)
        prune_checkpoints(root, keep_last)
    fabric.barrier()
    return final


def _bare_objects(model: Any, optimizer: Any) -> tuple[Any, Any]:
    """The module and optimizer inside Fabric's wrappers (FSDP / DDP wrappers stay: the state-dict
    API below understands them)."""
    from gdn2.train.fabric_api import unwrap

    return unwrap(model), unwrap(optimizer)


@contextmanager
def _quiet_single_process():
    """torch.distributed.checkpoint warns on every call in one process (no process group) that it
    assumes one process: that is the intent here."""
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def save_state(fabric: Any, path: Path, state: dict[str, Any], sharded: bool = True) -> None:
    """Model, optimizer and trainer counters into ``path``, written in place, in one format for every
    strategy (one device, DDP, FSDP, FSDP2), so that any run can resume any checkpoint on any number
    of ranks: parameter and optimizer-state names are the bare model's (torch.distributed.checkpoint's
    state-dict API), and ``sharded`` (``checkpoint.state_dict_type: sharded``) writes a
    torch.distributed.checkpoint folder, each rank its own shards, with the counters in ``meta.pt``;
    otherwise rank 0 writes one file of full tensors (gathered on the CPU)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    module, optimizer = _bare_objects(state["model"], state["optimizer"])
    options = StateDictOptions(full_state_dict=not sharded, cpu_offload=not sharded)
    model_sd, optim_sd = get_state_dict(module, optimizer, options=options)
    if sharded:
        path.mkdir(parents=True, exist_ok=True)
        with _quiet_single_process():
            dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=str(path))
        if fabric.global_rank == 0:
            _write_durably(path / SHARDED_META, {"trainer": state["trainer"]})
    elif fabric.global_rank == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        _write_durably(path, {"model": model_sd, "optimizer": optim_sd, "trainer": state["trainer"]})
    fabric.barrier()


def _write_durably(path: Path, obj: Any) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def prune_checkpoints(root: Path, keep_last: int) -> list[Path]:
    """Delete all but the newest ``keep_last`` complete checkpoints, and stale temporary folders."""
    removed = []
    for _, path in list_checkpoints(root)[:-keep_last]:
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    for child in Path(root).iterdir():
        if child.name.startswith(".step-") and child.name.endswith(".tmp"):
            shutil.rmtree(child, ignore_errors=True)
            removed.append(child)
    return removed


def load_checkpoint(fabric: Any, path: Path, model: Any, optimizer: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """Restore ``model`` and ``optimizer`` in place from checkpoint ``path``; every rank calls this.

    Returns (trainer counters, this rank's extras). The checkpoint may come from another number of
    ranks and another strategy: a sharded state is resharded on load (torch.distributed.checkpoint), a
    full one is read by every rank and each keeps its part; a rank the checkpoint had no file for takes
    rank 0's extras (the data-loader state is the same on every rank; the RNG state then comes from
    rank 0).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

    path = Path(path)
    module, optim = _bare_objects(model, optimizer)
    state_path = path / STATE
    if state_path.is_dir():
        # the live state dicts are the templates: shapes, shardings, and the optimizer state initialised
        model_sd, optim_sd = get_state_dict(module, optim)
        loaded = {"model": model_sd, "optimizer": optim_sd}
        with _quiet_single_process():
            dcp.load(loaded, checkpoint_id=str(state_path))
        set_state_dict(module, optim, model_state_dict=loaded["model"], optim_state_dict=loaded["optimizer"])
        trainer = torch.load(state_path / SHARDED_META, map_location="cpu", weights_only=False)["trainer"]
    else:
        blob = torch.load(state_path, map_location="cpu", weights_only=False)
        if any(isinstance(key, int) for key in blob["optimizer"].get("state", {})):
            # one file from an earlier version, its optimizer state by parameter index: one device only
            if fabric.world_size > 1:
                raise ValueError(f"{state_path}: an earlier one-device checkpoint format (optimizer state by "
                                 f"parameter index); resume it on one device, whose next checkpoint any number "
                                 f"of ranks can resume")
            module.load_state_dict(bare_state_dict(blob["model"]))
            optim.load_state_dict(blob["optimizer"])
        else:
            set_state_dict(module, optim, model_state_dict=blob["model"], optim_state_dict=blob["optimizer"],
                           options=StateDictOptions(full_state_dict=True))
        trainer = blob["trainer"]
    rank_file = path / RANKS / f"rank-{fabric.global_rank:05d}.pt"
    if not rank_file.is_file():
        rank_file = path / RANKS / "rank-00000.pt"
    extras = torch.load(rank_file, map_location="cpu", weights_only=False)
    return trainer, extras


# --------------------------------------------------------------------------------------------------
# consolidation: a sharded (or full) training checkpoint -> one model.pt for evaluation
# --------------------------------------------------------------------------------------------------

def _load_sharded_model(state_dir: Path) -> dict[str, torch.Tensor]:
    """The model entries of a torch.distributed.checkpoint folder, read in one process (no optimizer)."""
    from torch.distributed.checkpoint import FileSystemReader, load
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = FileSystemReader(str(state_dir))
    metadata = reader.read_metadata()
    model: dict[str, torch.Tensor] = {}
    for key, meta in metadata.state_dict_metadata.items():
        if key.startswith("model.") and isinstance(meta, TensorStorageMetadata):
            model[key[len("model."):]] = torch.empty(meta.size, dtype=meta.properties.dtype)
    if not model:
        raise ValueError(f"{state_dir}: no model tensors in this distributed checkpoint")
    with _quiet_single_process():
        load({"model": model}, storage_reader=reader, no_dist=True)
    return model


def consolidate_checkpoint(path: Path) -> dict[str, Any]:
    """One checkpoint folder -> ``{"model": state_dict, "config": model config dict, "step", "tokens",
    "recipe"}`` with fp32 CPU tensors under the bare model's parameter names.

    ``GPT(Config.from_dict(d["config"])).load_state_dict(d["model"])`` restores the model.
    """
    path = Path(path)
    verify_checkpoint(path)
    marker = read_marker(path)
    recipe = read_checkpoint_config(path)
    state_path = path / STATE
    if state_path.is_dir():
        model = _load_sharded_model(state_path)
    else:
        model = torch.load(state_path, map_location="cpu", weights_only=False)["model"]
    model = bare_state_dict(model)
    return {"model": model, "config": recipe["model"], "step": marker["step"], "tokens": marker.get("tokens"),
            "recipe": recipe}


def verify_consolidated(path: Path) -> None:
    """A consolidated ``model.pt`` against the ``model.pt.sha256`` written beside it (when there is
    one); CorruptCheckpointError naming the file."""
    sidecar = path.with_name(path.name + ".sha256")
    if sidecar.is_file():
        recorded = sidecar.read_text().split()[0] if sidecar.read_text().split() else ""
        if file_sha256(path) != recorded:
            raise CorruptCheckpointError(f"{path}: content differs from the sha256 in {sidecar.name} (corrupted)")


def default_consolidated_dir(checkpoint: Path) -> Path:
    """``<run>/final`` for a checkpoint ``<run>/checkpoints/step-<N>``: outside the folder that
    checkpoint rotation prunes."""
    checkpoint = Path(checkpoint).resolve()
    folder = checkpoint.parent if _NAME.match(checkpoint.name) else checkpoint
    return folder.parent / "final"


def write_consolidated(path: Path, out: Path) -> dict[str, Any]:
    """Consolidate checkpoint ``path`` into ``out/model.pt``, with the resolved recipe
    (``out/config.yaml``) and the run's tokenizer (``out/tokenizer.model``, when found) beside it."""
    consolidated = consolidate_checkpoint(path)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / "model.pt.tmp"
    torch.save(consolidated, tmp)
    (out / "model.pt.sha256").write_text(f"{file_sha256(tmp)}  model.pt\n")
    os.replace(tmp, out / "model.pt")
    shutil.copyfile(path / CONFIG, out / CONFIG)
    tokenizer = find_run_tokenizer(consolidated["recipe"], [Path.cwd(), path])
    if tokenizer is not None:
        shutil.copyfile(tokenizer, out / "tokenizer.model")
    fsync_dir(out)
    return {"model": out / "model.pt", "tokenizer": tokenizer, "step": consolidated["step"],
            "parameters": sum(t.numel() for t in consolidated["model"].values()),
            "config_name": consolidated["config"].get("name")}


def consolidate_main(argv: Optional[list[str]] = None) -> int:
    """``python -m gdn2 consolidate CHECKPOINT [--out DIR]``."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="gdn2 consolidate",
        description="Turn a training checkpoint (sharded or not) into one model.pt for evaluation, generation "
                    "and sharing: {model: fp32 state_dict under bare parameter names, config, step, tokens, "
                    "recipe}, with config.yaml and tokenizer.model beside it. Runs in one CPU process, "
                    "whatever the number of ranks that wrote the checkpoint.")
    parser.add_argument("checkpoint", help="a step-<N> checkpoint folder, or a folder of them (the newest "
                                           "complete one is used)")
    parser.add_argument("--out", default=None, help="output folder (default: <run>/final, outside checkpoint "
                                                    "rotation)")
    args = parser.parse_args(argv)
    root = Path(args.checkpoint)
    if not root.exists():
        raise FileNotFoundError(f"checkpoint {root} does not exist")
    candidates, _ = resume_candidates(str(root), root)
    path = candidates[0]  # the newest: consolidating an older one is asked for by naming it
    out = Path(args.out) if args.out else default_consolidated_dir(path)
    info = write_consolidated(path, out)
    print(f"wrote {info['model']}: {info['parameters']:,} parameters, step {info['step']}, config "
          f"{info['config_name']}; tokenizer: {info['tokenizer'] or 'not found (pass --tokenizer when loading)'}")
    return 0


# --------------------------------------------------------------------------------------------------
# reading a checkpoint for inference
# --------------------------------------------------------------------------------------------------

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
          "bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
          "half": torch.float16, "float64": torch.float64, "fp64": torch.float64, "double": torch.float64}


def parse_dtype(dtype: Union[str, torch.dtype, None], device: torch.device) -> torch.dtype:
    """``None``/'auto': bf16 on CUDA, fp32 elsewhere; else a dtype or one of :data:`DTYPES`' names."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is None or dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    name = str(dtype).replace("torch.", "")
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)} or 'auto', got {dtype!r}")
    return DTYPES[name]


@dataclass
class FoundCheckpoint:
    """A checkpoint's weights with the config and tokenizer that belong to it."""

    path: Path
    state_dict: dict[str, torch.Tensor]
    config: Config
    tokenizer: Path
    extra: dict = field(default_factory=dict)


# Where a consolidated file keeps its parts (checked in this order).
STATE_KEYS = ("model", "state_dict", "model_state_dict")
CONFIG_KEYS = ("config", "model_config")
CONSOLIDATED_NAMES = ("model.pt", "consolidated.pt", "lit_model.pth", "model.pth")
RUN_CONFIG_NAMES = ("config.yaml", "hparams.yaml", "run_config.yaml")


def _search_dirs(path: Path) -> list[Path]:
    """The checkpoint's folder and up to two parents (a run folder holds its checkpoints in a subfolder)."""
    start = path if path.is_dir() else path.parent
    return [start, *list(start.parents)[:2]]


def _config_from_saved(data: Any, where: str) -> Optional[Config]:
    """A Config from a saved dict: either the model fields or a whole run config with a 'model' section."""
    if isinstance(data, Config):
        return data
    if isinstance(data, dict):
        model = data.get("model", data) if isinstance(data.get("model"), dict) else data
        return Config.from_dict(dict(model), where=f"{where}: model")
    return None


def _data_folders(run: dict) -> list[str]:
    """Folders of the data sources a saved run config names (``data.train`` / ``data.val``)."""
    data = run.get("data") if isinstance(run.get("data"), dict) else {}
    sources = list(data.get("train") or []) if isinstance(data.get("train"), list) else [data.get("train")]
    sources.append(data.get("val"))
    folders = []
    for src in sources:
        src = src.get("path") if isinstance(src, dict) else src
        if isinstance(src, str) and src:
            # a glob or a shard file names its folder; a folder names itself
            folders.append(src if not any(c in src for c in "*?[") and not src.endswith(".bin")
                           else os.path.dirname(src))
    return folders


def find_run_tokenizer(run: dict, bases: Sequence[Path]) -> Optional[Path]:
    """The tokenizer a saved run config leads to: ``data.tokenizer`` / ``tokenizer`` when recorded,
    else ``tokenizer.model`` in, or the ``manifest.json`` of, each data folder it trained on. Relative
    paths are tried against each of ``bases``."""
    import json

    data = run.get("data") if isinstance(run.get("data"), dict) else {}
    named = [v for v in (data.get("tokenizer"), run.get("tokenizer")) if isinstance(v, str) and v]
    candidates: list[Path] = [Path(v) for v in named]
    for folder in _data_folders(run):
        candidates.append(Path(folder) / TOKENIZER_FILE)
        for base in [Path(folder)] + [b / folder for b in bases]:
            manifest = base / "manifest.json"
            if manifest.is_file():
                try:
                    recorded = json.loads(manifest.read_text()).get("tokenizer", {})
                except ValueError:
                    continue
                if isinstance(recorded, dict) and recorded.get("path"):
                    candidates.append(Path(recorded["path"]))
    for c in candidates:
        for p in ([c] if c.is_absolute() else [b / c for b in bases]):
            p = p / TOKENIZER_FILE if p.is_dir() else p
            if p.is_file():
                return p
    return None


def read_checkpoint(checkpoint: Union[str, os.PathLike], config: Optional[Union[str, Config]] = None,
                    tokenizer: Optional[Union[str, os.PathLike]] = None) -> FoundCheckpoint:
    """Find and read a checkpoint, its config and its tokenizer.

    ``checkpoint``: a consolidated file (``pretrain/consolidate.py``: ``{"model": state_dict,
    "config": model config dict, "step", "tokens", "recipe"}``; a bare state dict works when the
    config is found elsewhere), a training checkpoint folder ``step-<N>`` (its ``model.pt`` when
    consolidated, else its shards are read through the trainer's ``consolidate_checkpoint``), or a
    folder of those (the newest complete one). The config comes from ``config`` (a name, YAML path or
    Config), else the file, else a run config (``config.yaml``) beside the checkpoint or up to two
    folders above it. The tokenizer comes from ``tokenizer``, else ``tokenizer.model`` in those
    folders, else the data folders the saved run trained on (their ``tokenizer.model`` or the
    tokenizer their ``manifest.json`` records).
    """
    import yaml

    path = Path(checkpoint)
    if not path.exists():
        raise FileNotFoundError(f"checkpoint {str(path)!r} does not exist")
    extra: dict = {}
    saved_config = None
    if path.is_dir() and not any((path / n).is_file() for n in CONSOLIDATED_NAMES):
        path = _newest_step_folder(path)
    if path.is_dir():
        files = [path / n for n in CONSOLIDATED_NAMES if (path / n).is_file()]
        if files:
            path = files[0]
    if path.is_dir():
        state, saved_config, extra = _read_sharded(path)
    else:
        verify_consolidated(path)
        try:
            blob = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - any unreadable file is reported the same way
            raise ValueError(f"checkpoint {str(path)!r} could not be read as a torch file: {e}") from e
        if not isinstance(blob, dict):
            raise ValueError(f"checkpoint {str(path)!r}: expected a dict, got {type(blob).__name__}")
        state = next((blob[k] for k in STATE_KEYS if isinstance(blob.get(k), dict)), None)
        if state is None:
            if all(isinstance(v, torch.Tensor) for v in blob.values()):
                state = blob
            else:
                raise ValueError(f"checkpoint {str(path)!r}: no model state dict under {', '.join(STATE_KEYS)}")
        saved_config = next((blob[k] for k in CONFIG_KEYS if k in blob), None)
        extra = {k: v for k, v in blob.items() if k not in STATE_KEYS + CONFIG_KEYS}
    state = bare_state_dict(state)

    runs: list[tuple[Path, dict]] = []
    if isinstance(extra.get("recipe"), dict):
        runs.append((path, extra["recipe"]))
    for d in _search_dirs(path):
        for name in RUN_CONFIG_NAMES:
            f = d / name
            if f.is_file():
                with open(f) as fh:
                    data = yaml.safe_load(fh)
                if isinstance(data, dict):
                    runs.append((f, data))

    if isinstance(config, Config):
        cfg = config
    elif config is not None:
        cfg = Config.from_name(str(config))
    elif saved_config is not None:
        cfg = _config_from_saved(saved_config, str(path))
    else:
        cfg = next((_config_from_saved(data, str(f)) for f, data in runs if isinstance(data.get("model"), dict)),
                   None)
    if cfg is None:
        looked = ", ".join(str(d / n) for d in _search_dirs(path) for n in RUN_CONFIG_NAMES)
        raise ValueError(f"checkpoint {str(path)!r}: model config missing: none saved in the checkpoint, none of "
                         f"{looked} exists; pass config=<name or YAML path>")

    if tokenizer is not None:
        tok = Path(tokenizer)
        tok = tok / TOKENIZER_FILE if tok.is_dir() else tok
        if not tok.is_file():
            raise FileNotFoundError(f"tokenizer {str(tok)!r} does not exist")
    else:
        candidates = [d / TOKENIZER_FILE for d in _search_dirs(path)]
        tok = next((c for c in candidates if c.is_file()), None)
        if tok is None:
            # relative data paths in a run config are relative to where the run was started
            bases = [Path.cwd(), *_search_dirs(path), Path(__file__).resolve().parent.parent]
            tok = next((t for _, data in runs if (t := find_run_tokenizer(data, bases)) is not None), None)
        if tok is None:
            raise FileNotFoundError(
                f"checkpoint {str(path)!r}: tokenizer missing: none of {', '.join(map(str, candidates))} exists and "
                "no saved run config leads to one; pass tokenizer=<path to tokenizer.model>")
    return FoundCheckpoint(path, state, cfg, tok, extra)


def _newest_step_folder(path: Path) -> Path:
    """``path`` itself when it is a checkpoint folder, else its newest complete ``step-<N>`` child."""
    if is_complete(path):
        return path
    found = list_checkpoints(path)
    return found[-1][1] if found else path


def _read_sharded(path: Path) -> tuple[dict[str, torch.Tensor], Optional[Any], dict]:
    """Model weights of a training checkpoint folder, through the consolidation above."""
    if not is_complete(path):
        raise ValueError(f"checkpoint {str(path)!r}: neither a consolidated model file "
                         f"({', '.join(CONSOLIDATED_NAMES)}) nor a complete training checkpoint (step-<N> with "
                         f"its {MARKER} marker) nor a folder of those")
    blob = consolidate_checkpoint(path)
    return blob["model"], blob["config"], {k: v for k, v in blob.items() if k not in ("model", "config")}


@dataclass
class LoadedModel:
    model: GPT
    tokenizer: Tokenizer
    config: Config
    checkpoint: Path
    extra: dict = field(default_factory=dict)


def load_model(checkpoint: Union[str, os.PathLike], config: Optional[Union[str, Config]] = None,
               tokenizer: Optional[Union[str, os.PathLike]] = None, device: Union[str, torch.device, None] = None,
               dtype: Union[str, torch.dtype, None] = None) -> LoadedModel:
    """Model (eval mode), tokenizer and config from a checkpoint (see :func:`read_checkpoint`).

    ``dtype``: see :func:`parse_dtype`; the GDN-2 decay parameters ``A_log`` / ``dt_bias`` stay fp32
    as in training. Raises FileNotFoundError / ValueError naming what is missing: the checkpoint, its
    config or its tokenizer.
    """
    device = torch.device(device) if device is not None else torch.device(
        "cuda" if torch.cuda.is_available() else "cpu")
    dtype = parse_dtype(dtype, device)
    found = read_checkpoint(checkpoint, config=config, tokenizer=tokenizer)
    tok = Tokenizer(found.tokenizer)
    with torch.device("meta"):
        model = GPT(found.config)
    model = model.to_empty(device=device)
    try:
        missing, unexpected = model.load_state_dict(found.state_dict, strict=False)
    except RuntimeError as e:  # shape mismatches
        raise ValueError(f"checkpoint {str(found.path)!r} does not match config {found.config.name!r}: {e}") from e
    if missing or unexpected:
        raise ValueError(f"checkpoint {str(found.path)!r} does not match config {found.config.name!r}: "
                         f"missing {missing[:5]}{' ...' if len(missing) > 5 else ''}, "
                         f"unexpected {unexpected[:5]}{' ...' if len(unexpected) > 5 else ''}")
    keep_fp32 = {id(p) for block in model.transformer.h if block.kind == "gdn2"
                 for p in (block.mixer.A_log, block.mixer.dt_bias)}
    for p in model.parameters():
        if id(p) not in keep_fp32 or dtype == torch.float64:
            p.data = p.data.to(dtype)
        else:
            p.data = p.data.float()
    model.eval()
    return LoadedModel(model, tok, found.config, found.path, found.extra)
