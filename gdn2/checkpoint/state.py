"""Saving and restoring a training state with torch.distributed.checkpoint: model, optimizer, trainer
counters, and every rank's data-loader and RNG states, in one format for every strategy.

Every rank writes into ``.step-<step>.tmp/`` directly (no staging elsewhere); after a barrier the ranks
hash the files between them, rank 0 writes ``COMPLETE`` and renames the folder to its final name (an
atomic rename within one file system), so a crash mid-save leaves the previous checkpoint as the newest
complete one.

The caller hands in the plain modules (the model as FSDP / DDP wrapped it, the optimizer), not
Fabric's wrappers around them; ``fabric`` is used for its ranks and barriers only.
"""

from __future__ import annotations

import logging
import os
import random
import shutil
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gdn2.checkpoint.format import (CONFIG, RANKS, SHARDED_META, STATE, bare_state_dict, checkpoint_name, digest_files,
                                    is_complete, write_marker)
from gdn2.checkpoint.resume import prune_checkpoints
from gdn2.checkpoint.safe_load import load_distributed, load_torch_file
from gdn2.files import fsync_dir

log = logging.getLogger(__name__)


# Rank files written before the RNG states took a tensor form hold numpy's state as an array: numpy's array
# reconstruction (a uint32 array from its bytes) is allowed in rank files, and in no other file.
EARLIER_RANK_GLOBALS = (np.ndarray, np.dtype, np.dtypes.UInt32DType,
                        getattr(np, "_core", getattr(np, "core", None)).multiarray._reconstruct)


def rng_state() -> dict[str, Any]:
    """This process's random states, in a form ``torch.load(weights_only=True)`` reads: Python's is a
    tuple of ints; numpy's legacy generator state (a tuple holding a uint32 array) becomes a dict whose
    ``keys`` are an int64 tensor [624]; torch's (and CUDA's) are uint8 tensors."""
    kind, keys, position, has_gauss, gauss = np.random.get_state(legacy=True)
    state = {
        "python": random.getstate(),
        "numpy": {"kind": str(kind), "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(position),
                  "has_gauss": int(has_gauss), "gauss": float(gauss)},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    numpy_state = state["numpy"]
    if isinstance(numpy_state, dict):
        numpy_state = (numpy_state["kind"], numpy_state["keys"].numpy().astype(np.uint32), numpy_state["pos"],
                       numpy_state["has_gauss"], numpy_state["gauss"])
    np.random.set_state(numpy_state)  # a tuple in rank files written before the dict form
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def save_checkpoint(fabric: Any, root: Path, step: int, state: dict[str, Any], rank_state: dict[str, Any],
                    config_yaml: str, info: dict[str, Any], keep_last: int, sharded: bool = True) -> Path:
    """Write checkpoint ``step`` under ``root`` atomically; every rank calls this.

    ``state``: ``{"model", "optimizer", "trainer": dict}`` (see :func:`save_state`; ``sharded``: its format).
    ``rank_state``: this rank's extras (data loader, RNG), of tensors and plain containers only (they are read
    back with ``weights_only=True``). ``info`` goes into the marker.
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



@contextmanager
def quiet_single_process():
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

    module, optimizer = state["model"], state["optimizer"]
    options = StateDictOptions(full_state_dict=not sharded, cpu_offload=not sharded)
    model_sd, optim_sd = get_state_dict(module, optimizer, options=options)
    if sharded:
        path.mkdir(parents=True, exist_ok=True)
        with quiet_single_process():
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



def load_checkpoint(fabric: Any, path: Path, model: Any, optimizer: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """Restore ``model`` and ``optimizer`` in place from checkpoint ``path``; every rank calls this.

    Returns (trainer counters, this rank's extras). The checkpoint may come from another number of
    ranks and another strategy: a sharded state is resharded on load (torch.distributed.checkpoint), a
    full one is read by every rank and each keeps its part; a rank the checkpoint had no file for takes
    rank 0's extras (the data-loader state is the same on every rank; the RNG state then comes from
    rank 0). Every file is read without running code (:mod:`gdn2.checkpoint.safe_load`): a forged one is
    an UnsafeFileError naming it.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

    path = Path(path)
    module, optim = model, optimizer
    state_path = path / STATE
    if state_path.is_dir():
        # the live state dicts are the templates: shapes, shardings, and the optimizer state initialised
        model_sd, optim_sd = get_state_dict(module, optim)
        loaded = {"model": model_sd, "optimizer": optim_sd}
        with quiet_single_process():
            load_distributed(loaded, state_path)
        set_state_dict(module, optim, model_state_dict=loaded["model"], optim_state_dict=loaded["optimizer"])
        trainer = load_torch_file(state_path / SHARDED_META)["trainer"]
    else:
        blob = load_torch_file(state_path)
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
    extras = load_torch_file(rank_file, allow=EARLIER_RANK_GLOBALS)
    return trainer, extras

