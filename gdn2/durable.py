"""Durable file-system updates shared by data preparation and checkpointing (no torch import)."""

from __future__ import annotations

import os
from pathlib import Path


def fsync_dir(directory: Path) -> None:
    """Flush a directory entry (after a rename into it) so the rename survives a power loss.

    Best effort: some file systems refuse to open or fsync directories, which is not an error here.
    """
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
