"""Reading checkpoint files without running code: a pickle may name any function to call while it loads,
so every pickled file a gdn2 command reads comes through here, and the checksums of a checkpoint's
marker (which catch damage, not forgery) are not relied on for safety.

- torch files (a consolidated ``model.pt``, a training checkpoint's full ``state``, ``state/meta.pt``,
  ``ranks/rank-<r>.pt``): ``torch.load(weights_only=True)``, which builds tensors, plain containers
  (dict, list, tuple, str, numbers, None) and torch's dtypes and sizes, and nothing else
  (:func:`load_torch_file`).
- a torch.distributed.checkpoint folder: its ``.metadata`` is a plain pickle that torch 2.13's
  ``FileSystemReader`` reads with ``pickle.load``; :class:`SafeFileSystemReader` reads it with an
  unpickler that finds only the classes that file holds (:data:`DCP_METADATA_GLOBALS`: the metadata
  dataclasses, ``torch.Size``, dtypes, layouts, the path it was saved at) and checks that every storage
  file it names lies inside the folder (:func:`read_dcp_metadata`, and the reader of
  :func:`safe_reader_and_planner`). Tensors are read with ``weights_only=True`` by torch itself; the
  other entries (the optimizer's param groups), which torch's default planner reads with
  ``weights_only=False``, are read by that function's planner with ``weights_only=True``
  (:func:`load_distributed` uses both).

Anything else raises :class:`UnsafeFileError`, one line naming the file and what it asked to load;
nothing of it ran. Model folders exported for Hugging Face hold safetensors and JSON, which carry no
code.
"""

from __future__ import annotations

import functools
import io
import pickle
import re
from pathlib import Path
from typing import Any, Iterable, Union

import torch


class UnsafeFileError(ValueError):
    """A file that would run code (or reach outside its folder) when loaded; the message names it."""


_REFUSED_GLOBAL = re.compile(r"GLOBAL (\S+) was not an allowed global")


def _refusal(path: Union[str, Path], what: str) -> UnsafeFileError:
    return UnsafeFileError(f"{path}: refused to load: it asks for {what}, which is not a tensor, a plain "
                           "container or a known checkpoint class (loading it could run code; nothing was run). "
                           "Load only checkpoints you made; a model from others: a consolidated model.pt or "
                           "safetensors")


def _refused_by_torch(path: Union[str, Path], error: Exception) -> ValueError:
    """One line for what ``torch.load(weights_only=True)`` refused: UnsafeFileError for a global it would
    have had to call, ValueError for a file it cannot read as a pickle of tensors at all (damaged)."""
    text = str(error)
    found = _REFUSED_GLOBAL.search(text)
    if found:  # torch names a builtin without its module
        return _refusal(path, found.group(1) if "." in found.group(1) else f"builtins.{found.group(1)}")
    after = text.split("WeightsUnpickler error:", 1)[-1]
    detail = next((line.strip() for line in after.splitlines() if line.strip()), type(error).__name__)
    return ValueError(f"{path}: not a torch file of tensors and plain values ({detail.split('. Please')[0]})")


def load_torch_file(path: Union[str, Path], allow: Iterable[Any] = ()) -> Any:
    """The content of a ``torch.save`` file, read with ``weights_only=True`` onto the CPU; ``allow``:
    further classes or functions it may hold (torch's ``safe_globals``). UnsafeFileError naming the
    file when it asks for anything else; ValueError naming it when it is no such file."""
    try:
        with torch.serialization.safe_globals(list(allow)):
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        raise _refused_by_torch(path, error) from None


def _torch_dtype_names() -> frozenset[str]:
    return frozenset(name for name in dir(torch) if isinstance(getattr(torch, name, None), torch.dtype))


# What a torch.distributed.checkpoint ``.metadata`` file written by torch 2.13 holds (found by reading
# real ones): its dataclasses, and what their fields pickle as. Dtypes (``torch.float32`` ...) are
# allowed by name on top of these.
DCP_METADATA_GLOBALS = frozenset({
    *(("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "MetadataIndex", "StorageMeta", "TensorStorageMetadata", "BytesStorageMetadata",
        "ChunkStorageMetadata", "TensorProperties", "_MEM_FORMAT_ENCODING")),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # a layout by its name
    ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath"),
    ("pathlib", "PureWindowsPath"),  # StorageMeta.checkpoint_id: where it was saved
})


class _MetadataUnpickler(pickle.Unpickler):
    """Finds only :data:`DCP_METADATA_GLOBALS` and torch dtypes: a pickle can call nothing it cannot
    find, so no other code runs."""

    dtypes = _torch_dtype_names()

    def __init__(self, file: Any, path: Path) -> None:
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in DCP_METADATA_GLOBALS or (module == "torch" and name in self.dtypes):
            return super().find_class(module, name)
        raise _refusal(self.path, f"{module}.{name}")


def read_dcp_metadata(path: Union[str, Path]) -> Any:
    """A torch.distributed.checkpoint ``.metadata`` file, read without running code: UnsafeFileError
    naming it for anything but the metadata classes, or a storage file named outside its folder."""
    from torch.distributed.checkpoint.metadata import Metadata

    path = Path(path)
    with open(path, "rb") as f:
        try:
            metadata = _MetadataUnpickler(f, path).load()
        except UnsafeFileError:
            raise
        except Exception as error:  # noqa: BLE001 - any other failure is a damaged file
            raise ValueError(f"{path}: not a readable torch.distributed.checkpoint metadata file ({error})") from None
    if not isinstance(metadata, Metadata):
        raise UnsafeFileError(f"{path}: refused to load: holds a {type(metadata).__name__}, not checkpoint metadata")
    for info in (metadata.storage_data or {}).values():
        name = str(getattr(info, "relative_path", ""))
        if not name or name in (".", "..") or "/" in name or "\\" in name:
            raise UnsafeFileError(f"{path}: refused to load: names the storage file {name!r}, which is not a file "
                                  f"of its folder {path.parent}")
    return metadata


@functools.lru_cache(maxsize=None)
def safe_reader_and_planner() -> tuple[type, type]:
    """(SafeFileSystemReader, SafeLoadPlanner): torch.distributed.checkpoint's file-system reader with its
    ``.metadata`` read by :func:`read_dcp_metadata` instead of ``pickle.load``, and its default load
    planner with entries that are not tensors read with ``weights_only=True`` (the default planner uses
    ``weights_only=False``). Defined on first use: importing torch.distributed.checkpoint takes seconds,
    which commands that read no such folder should not pay."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeFileSystemReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            rank = kwargs.get("rank")
            name = ".metadata" if rank is None else f"__{rank}.metadata"
            metadata = read_dcp_metadata(Path(self.path) / name)
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    class SafeLoadPlanner(DefaultLoadPlanner):
        """``reader``: the storage reader, to name the file an entry came from."""

        def __init__(self, reader: FileSystemReader) -> None:
            super().__init__()
            self.reader = reader

        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            info = self.reader.storage_data.get(read_item.storage_index)
            where = Path(self.reader.path) / info.relative_path if info is not None else Path(self.reader.path)
            try:
                obj = torch.load(value, map_location="cpu", weights_only=True)
            except pickle.UnpicklingError as error:
                raise _refused_by_torch(f"{where} (entry {read_item.dest_index.fqn})", error) from None
            # hand the parent a fresh serialisation of what was read safely, so that its own weights_only=False
            # load meets only plain values, and its bookkeeping of where entries go is reused as it is
            checked = io.BytesIO()
            torch.save(obj, checked)
            checked.seek(0)
            super().load_bytes(read_item, checked)

    return SafeFileSystemReader, SafeLoadPlanner


def load_distributed(state_dict: dict[str, Any], folder: Union[str, Path], no_dist: bool = False) -> None:
    """``torch.distributed.checkpoint.load`` of ``folder`` into ``state_dict`` (in place) through the safe
    reader and planner above; a refusal is raised as the UnsafeFileError or ValueError it is (torch would
    wrap it in a many-line CheckpointException, or keep only its text)."""
    from torch.distributed.checkpoint import load
    from torch.distributed.checkpoint.api import CheckpointException

    read_dcp_metadata(Path(folder) / ".metadata")  # refused here, whole, before torch reads it again
    reader_class, planner_class = safe_reader_and_planner()
    reader = reader_class(str(folder))
    try:
        load(state_dict, storage_reader=reader, planner=planner_class(reader), no_dist=no_dist)
    except CheckpointException as error:
        refused = [exc for exc, _ in error.failures.values() if isinstance(exc, ValueError)]
        if refused:
            raise refused[0] from None
        raise
