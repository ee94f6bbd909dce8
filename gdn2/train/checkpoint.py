"""Checkpoints that a crash can never corrupt, their discovery for ``--resume``, and consolidation.

One checkpoint is one folder ``<dir>/step-<step:09d>/``::

    state            model + optimizer + trainer counters, written by ``fabric.save``: a folder of
                     torch.distributed.checkpoint shards (FSDP, state_dict_type "sharded") or one file
    ranks/rank-<r>.pt  per rank: data-loader state and RNG states
    config.yaml      the resolved recipe
    COMPLETE         JSON marker, written last

Every rank writes into ``.step-<step>.tmp/``; after a barrier rank 0 writes ``COMPLETE`` and renames the
folder to its final name (an atomic rename within one file system). A folder without the marker, or
still under its temporary name, is never picked for resuming, so a crash mid-save leaves the previous
checkpoint as the newest complete one.
"""

from __future__ import annotations

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


def checkpoint_name(step: int) -> str:
    return f"step-{step:09d}"


def is_complete(path: Path) -> bool:
    return (path / MARKER).is_file() and _NAME.match(path.name) is not None


def read_marker(path: Path) -> dict[str, Any]:
    """The ``COMPLETE`` marker of checkpoint ``path``; ValueError when it is not a complete checkpoint."""
    path = Path(path)
    if not is_complete(path):
        raise ValueError(f"{path} is not a complete checkpoint (no {MARKER} marker or not named step-<N>)")
    return json.loads((path / MARKER).read_text())


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


def resolve_resume(resume: Optional[str], root: Path) -> Optional[Path]:
    """The checkpoint folder ``--resume`` designates, or None to start from scratch.

    ``auto``: the newest complete checkpoint under ``root`` (None when there is none). A path: that
    checkpoint, or the newest complete one inside it when it is a folder of checkpoints. Raises
    ValueError for a path that holds no complete checkpoint.
    """
    if resume is None or resume == "":
        return None
    if resume == "auto":
        found = list_checkpoints(root)
        return found[-1][1] if found else None
    path = Path(resume)
    if not path.exists():
        raise ValueError(f"--resume: {resume} does not exist")
    if _NAME.match(path.name):
        if not is_complete(path):
            raise ValueError(f"--resume: {resume} is an incomplete checkpoint (a save was interrupted); "
                             f"pick an older one or --resume auto")
        return path
    found = list_checkpoints(path)
    if not found:
        raise ValueError(f"--resume: no complete checkpoint (step-<N> folder with a {MARKER} marker) in {resume}")
    return found[-1][1]


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

    fabric.save(tmp / STATE, state)
    ranks = tmp / RANKS
    ranks.mkdir(parents=True, exist_ok=True)
    torch.save(rank_state, ranks / f"rank-{fabric.global_rank:05d}.pt")
    if fabric.global_rank == 0:
        (tmp / CONFIG).write_text(config_yaml)
    fabric.barrier()

    if fabric.global_rank == 0:
        write_marker(tmp, dict(info, step=step, world_size=fabric.world_size, saved_at=time.time()))
        os.replace(tmp, final)
        fsync_dir(root)
        prune_checkpoints(root, keep_last)
    fabric.barrier()
    return final


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

    Returns (trainer counters, this rank's extras). Raises ValueError when the checkpoint was written
    by a different number of ranks.
    """
    path = Path(path)
    marker = read_marker(path)
    if marker["world_size"] != fabric.world_size:
        raise ValueError(
            f"checkpoint {path} was written by {marker['world_size']} ranks, this run has {fabric.world_size}: "
            "exact data resume needs the same world size")
    remainder = fabric.load(path / STATE, {"model": model, "optimizer": optimizer})
    rank_file = path / RANKS / f"rank-{fabric.global_rank:05d}.pt"
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
        self.last = save_checkpoint(
            self.fabric, self.recipe.checkpoint_dir, self.state.step, trainer,
            rank_state={"data": self.loader.state_dict(), "rng": rng_state(), "rank": self.fabric.global_rank},
            config_yaml=self.recipe.to_yaml(), info={"tokens": self.state.tokens, "config_name": self.recipe.config_name},
            keep_last=c.keep_last)
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


def default_consolidated_dir(checkpoint: Path) -> Path:
    """``<run>/final`` for a checkpoint ``<run>/checkpoints/step-<N>``: outside the folder that
    checkpoint rotation prunes."""
    checkpoint = Path(checkpoint).resolve()
    folder = checkpoint.parent if _NAME.match(checkpoint.name) else checkpoint
    return folder.parent / "final"


def write_consolidated(path: Path, out: Path) -> dict[str, Any]:
    """Consolidate checkpoint ``path`` into ``out/model.pt``, with the resolved recipe
    (``out/config.yaml``) and the run's tokenizer (``out/tokenizer.model``, when found) beside it."""
    from gdn2.generate import find_run_tokenizer

    consolidated = consolidate_checkpoint(path)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / "model.pt.tmp"
    torch.save(consolidated, tmp)
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
    path = resolve_resume(str(root), root)
    if path is None:
        raise ValueError(f"{root}: holds no complete checkpoint")
    out = Path(args.out) if args.out else default_consolidated_dir(path)
    info = write_consolidated(path, out)
    print(f"wrote {info['model']}: {info['parameters']:,} parameters, step {info['step']}, config "
          f"{info['config_name']}; tokenizer: {info['tokenizer'] or 'not found (pass --tokenizer when loading)'}")
    return 0
