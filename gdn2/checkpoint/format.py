"""The checkpoint format: the folder layout, the ``COMPLETE`` marker with every file's size and sha256,
verification, and the one rule for parameter names.

Training checkpoint: one folder ``<dir>/step-<step:09d>/``::

    state            model + optimizer + trainer counters, under the bare model's names: a folder of
                     torch.distributed.checkpoint shards (state_dict_type "sharded", the default; the
                     counters in state/meta.pt) or one file of full tensors ("full"). Either resumes
                     on any number of ranks, with any strategy.
    ranks/rank-<r>.pt  per rank: data-loader state and RNG states
    config.yaml      the resolved recipe
    COMPLETE         JSON marker, written last: step, tokens, world size, and the size and sha256 of
                     every other file of the checkpoint

A folder without the marker, or still under its temporary name (``.step-<N>.tmp``), is never picked
for resuming. Loading verifies the recorded sizes and hashes, so a damaged file is named instead of
being trained on.

Parameter names are those of the bare model everywhere: :func:`bare_parameter_name` drops the name
segments that Fabric, FSDP, DDP, activation checkpointing and torch.compile insert.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any, Optional

import yaml

from gdn2.files import file_sha256

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


def write_marker(path: Path, marker: dict[str, Any]) -> None:
    """The ``COMPLETE`` marker: the last file of a checkpoint, written durably."""
    with open(path / MARKER, "w") as f:
        json.dump(marker, f, indent=1)
        f.flush()
        os.fsync(f.fileno())



def verify_consolidated(path: Path) -> None:
    """A consolidated ``model.pt`` against the ``model.pt.sha256`` written beside it (when there is
    one); CorruptCheckpointError naming the file."""
    sidecar = path.with_name(path.name + ".sha256")
    if sidecar.is_file():
        recorded = sidecar.read_text().split()[0] if sidecar.read_text().split() else ""
        if file_sha256(path) != recorded:
            raise CorruptCheckpointError(f"{path}: content differs from the sha256 in {sidecar.name} (corrupted)")

