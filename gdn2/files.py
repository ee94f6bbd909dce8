"""File-system helpers shared by everything that writes or checks files: atomic writes, sha256 digests,
directory syncs. No torch import (the data-preparation workers use them).
"""

from __future__ import annotations

import hashlib
import json
import os
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any, Iterator, Union

HASH_BLOCK = 8 << 20  # bytes read at a time while hashing


def fsync_dir(directory: Union[str, os.PathLike]) -> None:
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


def file_sha256(path: Union[str, os.PathLike]) -> str:
    """The sha256 of a file's bytes, as hex."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(HASH_BLOCK):
            digest.update(block)
    return digest.hexdigest()


def temporary_name(path: Path) -> Path:
    """The name a file is written under before it is renamed to ``path`` (same folder, so the rename is
    atomic)."""
    return path.with_name(path.name + ".tmp")


@contextmanager
def atomic_file(path: Union[str, os.PathLike], mode: str = "w", **kwargs: Any) -> Iterator[IO]:
    """Open a temporary file beside ``path`` for writing; on a clean exit it is flushed to disk and renamed
    to ``path`` (a crash leaves the old file or the new one, never a torn one), on an error removed.
    ``mode``: "w" or "wb"; ``kwargs`` go to ``open`` (e.g. ``encoding``, ``newline``)."""
    path = Path(path)
    tmp = temporary_name(path)
    try:
        with open(tmp, mode, **kwargs) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def write_text_atomic(path: Union[str, os.PathLike], text: str) -> None:
    with atomic_file(path, "w", encoding="utf-8") as f:
        f.write(text)


def write_json_atomic(path: Union[str, os.PathLike], payload: Any, indent: int = 1, sort_keys: bool = True) -> None:
    """``payload`` as JSON (one trailing newline), written atomically."""
    with atomic_file(path, "w", encoding="utf-8") as f:
        json.dump(payload, f, indent=indent, sort_keys=sort_keys)
        f.write("\n")
