"""Which checkpoint a run continues from: ``--resume auto`` or a path, damaged checkpoints skipped,
newer ones moved out of the way, old ones pruned."""

from __future__ import annotations

import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any, Optional

from gdn2.checkpoint.format import (MARKER, SUPERSEDED, _NAME, CorruptCheckpointError, is_complete, list_checkpoints,
                                    verify_checkpoint)
from gdn2.files import fsync_dir

log = logging.getLogger(__name__)


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

