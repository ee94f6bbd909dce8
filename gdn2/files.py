"""File-system helpers shared by everything that writes or checks files: atomic writes, sha256 digests,
directory syncs, folder locks. No torch import (the data-preparation workers use them).
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import socket
import time
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any, Callable, Iterator, Optional, Union

log = logging.getLogger(__name__)

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
    """The name a file is written under before it is renamed to ``path``: in the same folder, so the
    rename is atomic, and unique to this writer (pid and a random part), so two writers of one file
    never write into the same temporary file and each rename delivers one whole file."""
    return path.with_name(f"{path.name}.{os.getpid()}.{os.urandom(4).hex()}.tmp")


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


class FolderLock:
    """An exclusive lock that one job holds on a folder: a trainer on its run and checkpoint folders,
    ``prepare`` on its output, the build of the built-in corpus. It is ``flock(2)`` on ``<folder>/<name>``.

    The kernel lets go of the lock when the holder's descriptor is closed, that is when the holder exits
    however it ends (a crash or a kill -9 included): a lock whose holder died is free at once, with no
    pid to check and no stale file to clear. The file records who holds it (pid, host, since), for the
    message of the one refused. It is never deleted: a process may be waiting on it, and a new file
    under the same name would let a second holder in beside the first. The descriptor is not inherited
    across exec (spawned workers do not hold the lock); a forked child shares it, so the lock stays
    held while the child lives. Linux NFS clients take flock as an NFS lock, so it holds across hosts;
    on a file system that has no locks at all the job runs unlocked, with a warning.
    """

    def __init__(self, folder: Union[str, os.PathLike], name: str = ".lock") -> None:
        self.folder = Path(folder)
        self.path = self.folder / name
        self._file: Optional[IO] = None

    def holder(self) -> str:
        """Who holds (or last held) the lock, as its file records it."""
        try:
            return self.path.read_text(encoding="utf-8", errors="replace").strip() or "another process"
        except OSError:
            return "another process"

    def acquire(self, wait: bool = False, on_wait: Optional[Callable[[str], None]] = None) -> Optional[str]:
        """Take the lock: None once it is ours. When another process holds it: its holder description
        (``wait`` False), or, with ``wait``, ``on_wait(holder)`` is called once and the call blocks until the
        holder lets go."""
        import fcntl

        if self._file is not None:
            raise RuntimeError(f"{self.path}: already held by this FolderLock")
        self.folder.mkdir(parents=True, exist_ok=True)
        f = open(self.path, "a+", encoding="utf-8")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as error:
            if error.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                f.close()
                log.warning("%s: the file system does not support locks (%s); running without the lock, so "
                            "nothing stops a second job on this folder", self.folder, error.strerror or error)
                return None
            holder = self.holder()
            if not wait:
                f.close()
                return holder
            if on_wait is not None:
                on_wait(holder)
            try:
                fcntl.flock(f, fcntl.LOCK_EX)
            except BaseException:
                f.close()
                raise
        f.seek(0)
        f.truncate()
        f.write(f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
        f.flush()
        self._file = f
        return None

    def release(self) -> None:
        """Let go (the file stays, see the class docstring)."""
        if self._file is not None:
            import fcntl

            fcntl.flock(self._file, fcntl.LOCK_UN)
            self._file.close()
            self._file = None
