"""Checkpoints that a crash can never corrupt, their discovery for ``--resume``, and consolidation.

One checkpoint is one folder ``<dir>/step-<step:09d>/``::

    state            model + optimizer + trainer counters, written by ``fabric.save``: a folder of
                     torch.distributed.checkpoint shards (FSDP, state_dict_type "sharded") or one file
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
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
import yaml

from gdn2.durable import fsync_dir
from gdn2.train.schedule import due

log = logging.getLogger(__name__)

MARKER = "COMPLETE"
STATE = "state"
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
                    config_yaml: str, info: dict[str, Any], keep_last: int) -> Path:
    """Write checkpoint ``step`` under ``root`` atomically; every rank calls this.

    ``state``: what ``fabric.save`` takes (``{"model", "optimizer", "trainer": dict}``).
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

    save_state(fabric, tmp / STATE, state)
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


def save_state(fabric: Any, path: Path, state: dict[str, Any]) -> None:
    """Model, optimizer and counters into ``path``, written in place: a sharded FSDP state through
    Fabric (torch.distributed.checkpoint writes each rank's shards into the folder); otherwise rank 0
    writes one file itself (Fabric's single-file save stages the whole state in the temporary
    directory first, which a small ``/tmp`` cannot hold)."""
    from lightning.fabric.strategies import FSDPStrategy

    if isinstance(fabric.strategy, FSDPStrategy):
        fabric.save(path, state)
        return
    if fabric.global_rank == 0:
        plain = {k: v.state_dict() if hasattr(v, "state_dict") else v for k, v in state.items()}
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "wb") as f:
            torch.save(plain, f)
            f.flush()
            os.fsync(f.fileno())
    fabric.barrier()


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
    ranks: a sharded state is resharded on load; a rank the checkpoint had no file for takes rank 0's
    extras (the data-loader state is the same on every rank; the RNG state then comes from rank 0).
    """
    path = Path(path)
    remainder = fabric.load(path / STATE, {"model": model, "optimizer": optimizer})
    rank_file = path / RANKS / f"rank-{fabric.global_rank:05d}.pt"
    if not rank_file.is_file():
        rank_file = path / RANKS / "rank-00000.pt"
    extras = torch.load(rank_file, map_location="cpu", weights_only=False)
    return remainder["trainer"], extras


class Checkpointer:
    """The run's checkpoints: saves on the ``checkpoint`` section's schedule (never inside a run of
    skipped steps, which would rotate out older good ones), and on demand (a signal, a stop)."""

    def __init__(self, fabric: Any, recipe: Any, model: Any, optimizer: Any, state: Any, loader: Any,
                 max_steps: int, last: Optional[Path] = None) -> None:
        self.fabric, self.recipe, self.model, self.optimizer = fabric, recipe, model, optimizer
        self.state, self.loader, self.max_steps = state, loader, max_steps
        self.last = last  # the newest checkpoint of this run (the one resumed from, at first)

    def save(self) -> Path:
        c = self.recipe.checkpoint
        trainer = {"model": self.model, "optimizer": self.optimizer, "trainer": self.state.state_dict()}
        try:
            self.last = save_checkpoint(
                self.fabric, self.recipe.checkpoint_dir, self.state.step, trainer,
                rank_state={"data": self.loader.state_dict(), "rng": rng_state(), "rank": self.fabric.global_rank},
                config_yaml=self.recipe.to_yaml(),
                info={"tokens": self.state.tokens, "config_name": self.recipe.config_name}, keep_last=c.keep_last)
        except OSError as error:  # a full disk, most often: say what is safe
            raise OSError(error.errno, f"{error.strerror or error} while saving the checkpoint of step "
                                       f"{self.state.step} in {self.recipe.checkpoint_dir}; the last good checkpoint "
                                       f"is {self.last or 'none (none was written yet)'}", error.filename) from error
        if self.fabric.global_rank == 0:
            log.info("saved checkpoint %s", self.last)
        return self.last

    def maybe_save(self, step: int, end: bool = False) -> Optional[Path]:
        c = self.recipe.checkpoint
        if not due(c.interval, c.at_end, step, self.max_steps, end):
            return None
        if not end and self.state.consecutive_nonfinite:
            return None
        return self.save()


# --------------------------------------------------------------------------------------------------
# consolidation: a sharded (or full) training checkpoint -> one model.pt for evaluation
# --------------------------------------------------------------------------------------------------

def _strip_wrappers(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    from gdn2.train.optimizer import clean_parameter_name

    return {clean_parameter_name(k): v for k, v in state_dict.items()}


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
    model = _strip_wrappers(model)
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
    from gdn2.checkpoint import find_run_tokenizer

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
