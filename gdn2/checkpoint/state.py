"""Saving and restoring a training state with torch.distributed.checkpoint: model, optimizer, trainer
counters, and every rank's data-loader and RNG states, in one format for every strategy.

Every rank writes into ``.step-<step>.tmp/`` directly (no staging elsewhere); after a barrier the ranks
hash the files between them, rank 0 writes ``COMPLETE`` and renames the folder to its final name (an
atomic rename within one file system), so a crash mid-save leaves the previous checkpoint as the newest
complete one. A write that fails on any rank (a full disk, a quota) fails the save on every rank alike,
with one message naming the folder, its free space and the last good checkpoint, and the partial
folder removed, so the disk is not left full of it.

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
from typing import Any, Optional

import numpy as np
import torch

from gdn2.checkpoint.format import (CONFIG, RANKS, SHARDED_META, STATE, _gather, bare_state_dict, checkpoint_name,
                                    digest_files, is_complete, list_checkpoints, write_marker)
from gdn2.checkpoint.resume import prune_checkpoints
from gdn2.checkpoint.safe_load import load_distributed, load_torch_file
from gdn2.commandline import told_elsewhere
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


class CheckpointWriteError(OSError):
    """A checkpoint the operating system would not let us write (``errno``: ENOSPC for a full disk, EDQUOT,
    EIO, ...). Every rank raises it (on the command line rank 0 alone prints it); the message names the
    folder, its free space and the last good checkpoint, and the partial checkpoint is gone."""

    def __str__(self) -> str:
        return str(self.strerror)


def save_checkpoint(fabric: Any, root: Path, step: int, state: dict[str, Any], rank_state: dict[str, Any],
                    config_yaml: str, info: dict[str, Any], keep_last: int, sharded: bool = True) -> Path:
    """Write checkpoint ``step`` under ``root`` atomically; every rank calls this.

    ``state``: ``{"model", "optimizer", "trainer": dict}`` (see :func:`save_state`; ``sharded``: its format).
    ``rank_state``: this rank's extras (data loader, RNG), of tensors and plain containers only (they are read
    back with ``weights_only=True``). ``info`` goes into the marker.
    Afterwards only the newest ``keep_last`` complete checkpoints are kept.

    A failure on any rank fails the save on all of them (they agree after each phase): a write refused by
    the operating system raises :class:`CheckpointWriteError` everywhere, with the partial folder removed;
    any other error is raised as it is by the rank it happened on (the others raise RuntimeError naming
    that rank), and the partial folder stays under its temporary name for a look (the next save of the
    step, or pruning, removes it).
    """
    from torch.distributed.checkpoint.api import CheckpointException  # derives from BaseException only

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

    failure: Optional[BaseException] = None
    try:
        save_state(fabric, tmp / STATE, state, sharded=sharded)
        ranks = tmp / RANKS
        ranks.mkdir(parents=True, exist_ok=True)
        _write_durably(ranks / f"rank-{fabric.global_rank:05d}.pt", rank_state)
        if fabric.global_rank == 0:
            with open(tmp / CONFIG, "w") as f:
                f.write(config_yaml)
                f.flush()
                os.fsync(f.fileno())
    except (Exception, CheckpointException) as error:
        failure = error
    _settle(fabric, root, tmp, step, failure)  # also the barrier before hashing
    files = digest_files(tmp, fabric)

    failure = None
    if fabric.global_rank == 0:
        try:
            write_marker(tmp, dict(info, step=step, world_size=fabric.world_size, saved_at=time.time(), files=files))
            os.replace(tmp, final)
            fsync_dir(root)
            prune_checkpoints(root, keep_last)
        except Exception as error:
            failure = error
    _settle(fabric, root, tmp, step, failure)
    return final


# What torch's zip writer says when a write fails (it keeps the OSError only as the context of its
# RuntimeError, and a CheckpointException of several ranks carries the message alone).
TORCH_WRITE_FAILURES = ("inline_container", "PytorchStreamWriter", "file write failed")
PROBE_BYTES = 1 << 20


def _chain(error: BaseException) -> list[BaseException]:
    """``error`` and every exception behind it: causes, contexts, and the per-rank failures a
    torch.distributed.checkpoint CheckpointException holds."""
    todo, found = [error], []
    while todo:
        current = todo.pop(0)
        if current is None or any(current is seen for seen in found):
            continue
        found.append(current)
        todo += [current.__cause__, current.__context__]
        failures = getattr(current, "failures", None)
        if isinstance(failures, dict):
            todo += [f[0] if isinstance(f, tuple) else f for f in failures.values()]
    return found


def _os_errno(error: BaseException, folder: Path) -> Optional[int]:
    """The errno of the operating-system error behind a failed save, if it was one: found in the chain, or,
    where torch's writer reported a failed write without it, the errno a probe write into ``folder`` gets
    now (the disk still full, or the quota still exceeded, answers ENOSPC or EDQUOT; a write it takes
    means the failure was something else)."""
    chain = _chain(error)
    for current in chain:
        if isinstance(current, OSError) and current.errno:
            return current.errno
    if not any(marker in str(current) for current in chain for marker in TORCH_WRITE_FAILURES):
        return None
    probe = folder / f".write-probe.{os.getpid()}"
    try:
        with open(probe, "wb") as f:
            f.write(bytes(PROBE_BYTES))
            f.flush()
            os.fsync(f.fileno())
    except OSError as probed:
        return probed.errno
    finally:
        probe.unlink(missing_ok=True)
    return None


def _bytes(n: float) -> str:
    """``n`` bytes for a reader: "512 B", "3.1 MiB", "1.2 TiB"."""
    unit = "B"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            break
        n /= 1024
    return f"{n:.0f} B" if unit == "B" else f"{n:.1f} {unit}"


def _settle(fabric: Any, root: Path, tmp: Path, step: int, failure: Optional[BaseException]) -> None:
    """Every rank learns whether any rank failed (a collective, so also a barrier); on a failure every rank
    raises (see :func:`save_checkpoint`), after rank 0 has removed the partial folder of a failed write."""
    mine = None
    if failure is not None:
        usage = shutil.disk_usage(root)  # before the partial folder goes: the disk as the save met it
        mine = (fabric.global_rank, _os_errno(failure, root), f"{type(failure).__name__}: {failure}", usage.free,
                usage.total)
    failures = [f for f in _gather(fabric, mine) if f is not None]
    if not failures:
        return
    rank, code, text, free, total = failures[0]  # reported as the lowest failing rank saw it
    if code is not None and fabric.global_rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        fsync_dir(root)
    fabric.barrier()  # the partial folder is gone before any rank reports
    if code is None:
        if failure is not None:
            raise failure
        raise RuntimeError(f"saving the checkpoint of step {step} in {root} failed on rank {rank}: {text}")
    good = list_checkpoints(root)
    where = f" (rank {rank})" if fabric.world_size > 1 else ""
    raise told_elsewhere(CheckpointWriteError(code, (
        f"{os.strerror(code)} while saving the checkpoint of step {step} in {root}{where}: {_bytes(free)} free "
        f"there of {_bytes(total)}; the partial checkpoint was removed. The last good checkpoint is "
        f"{good[-1][1] if good else 'none (none was written yet)'}")), fabric.global_rank != 0)


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
    otherwise rank 0 writes one file of full tensors (gathered on the CPU). No barrier at the end: the
    caller's ranks agree on the outcome (a rank whose write failed must not wait alone at a barrier)."""
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

