"""File-system helpers shared by everything that writes or checks files: atomic writes of a file or of a
whole folder, sha256 digests, directory syncs, folder locks, the disk a path is on. No torch import (the
data-preparation workers use them).
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import re
import secrets
import shutil
import socket
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any, Callable, Iterator, Optional, Union

from gdn2.commandline import sigterm_stops

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


def mount_point(path: Union[str, os.PathLike]) -> Path:
    """The mount point of the file system that holds ``path`` (or would hold it: the nearest existing
    folder above it is asked), to name the disk in a message."""
    path = Path(os.path.abspath(path))
    while not path.exists() and path != path.parent:
        path = path.parent
    while not os.path.ismount(path) and path != path.parent:
        path = path.parent
    return path


def full_disk_error(error: OSError, writing: Union[str, os.PathLike], kept: str) -> OSError:
    """For a full disk or quota (ENOSPC, EDQUOT): an OSError of one line naming the disk (its mount point),
    what was being written and ``kept`` (what is still in place); any other error is returned as it is."""
    if error.errno not in (errno.ENOSPC, errno.EDQUOT):
        return error
    return OSError(error.errno, f"{error.strerror or os.strerror(error.errno)} on the disk mounted at "
                                f"{mount_point(writing)} while writing {writing}; nothing partial was left, {kept}")


_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def exchange_paths(a: Union[str, os.PathLike], b: Union[str, os.PathLike]) -> bool:
    """Swap two directory entries of one file system in one atomic step (Linux ``renameat2`` with
    ``RENAME_EXCHANGE``): False where the system or file system cannot, having changed nothing."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    renameat2 = getattr(libc, "renameat2", None)
    if renameat2 is None:  # a C library older than glibc 2.28
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP):
        return False
    raise OSError(code, os.strerror(code), str(a), None, str(b))


_TEMPORARY = re.compile(r"^\.(?P<name>.+)\.(?:tmp|old)-(?P<pid>\d+)-[^/]*$")


def _put_back(old: Path, target: Path) -> None:
    """Undo a half-done replacement: the old folder set aside in ``old`` returns to ``target`` when
    nothing took its place, and ``old`` is removed."""
    if not target.exists() and (old / target.name).is_dir():
        os.rename(old / target.name, target)
    shutil.rmtree(old, ignore_errors=True)


def _remove_stale_temporaries(target: Path) -> None:
    """Temporary folders of ``target`` left by a process that no longer runs (killed outright); an old
    folder it had set aside returns to ``target`` when nothing took its place."""
    if not target.parent.is_dir():
        return
    for child in sorted(target.parent.iterdir()):
        match = _TEMPORARY.match(child.name)
        if not match or match["name"] != target.name or not child.is_dir():
            continue
        pid = int(match["pid"])
        try:
            os.kill(pid, 0)
            alive = pid != os.getpid()
        except ProcessLookupError:
            alive = False
        except PermissionError:  # another user's live process
            alive = True
        if alive:
            continue
        if ".old-" in child.name:
            _put_back(child, target)
        else:
            shutil.rmtree(child, ignore_errors=True)


def _new_folder_beside(target: Path, kind: str) -> Path:
    """A new empty folder ``.<name>.<kind>-<pid>-<random>`` beside ``target``, with the permissions
    any new folder gets (``tempfile.mkdtemp`` would make it private, and the rename would keep that)."""
    while True:
        folder = target.parent / f".{target.name}.{kind}-{os.getpid()}-{secrets.token_hex(4)}"
        try:
            folder.mkdir()
            return folder
        except FileExistsError:
            continue


def _sync_tree(folder: Path) -> None:
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            with open(path, "rb") as f:
                os.fsync(f.fileno())
        elif path.is_dir():
            fsync_dir(path)
    fsync_dir(folder)


@contextmanager
def atomic_folder(target: Union[str, os.PathLike]) -> Iterator[Path]:
    """Write a whole folder at once: yields a new empty folder beside ``target``
    (``.<name>.tmp-<pid>-<random>``) to fill; on a clean exit its files are flushed to disk and it takes
    ``target``'s place in one step: renamed to ``target``, or, where ``target`` exists, swapped with it
    atomically (``renameat2``) and the old one then removed. So a reader sees the old folder or the new
    one whole, never a mix, and a crash leaves the old one in place.

    On an error, Ctrl-C or SIGTERM (raised as ``gdn2.commandline.Stopped``) the temporary folder is removed
    and ``target`` is untouched; a temporary folder of a process killed outright is removed by the next
    write of the same target.
    Where the file system cannot swap (NFS, some parallel file systems), the old folder is first renamed
    aside (``.<name>.old-<pid>-...``), so a crash between the two renames leaves it there, whole.
    Deciding whether ``target`` may be replaced is the caller's business."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temporaries(target)
    tmp = _new_folder_beside(target, "tmp")
    old: Optional[Path] = None
    try:
        with sigterm_stops():  # a terminated write unwinds through the cleanup below
            yield tmp
            _sync_tree(tmp)
            if not target.exists():
                os.rename(tmp, target)
            elif exchange_paths(tmp, target):
                shutil.rmtree(tmp)  # the old folder, now under the temporary name
            else:
                old = _new_folder_beside(target, "old")
                os.replace(target, old / target.name)
                os.rename(tmp, target)
                shutil.rmtree(old)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if old is not None:
            _put_back(old, target)
        raise
    fsync_dir(target.parent)
