"""Selective recomputation: intermediates autograd would keep for the backward, let go in the forward and
rebuilt when the backward first reads them.

Inside a :class:`RecomputeScope` every tensor autograd saves is held by a handle.
``scope.recompute(tensors, rebuild)`` names tensors the code in the scope has made and that
``rebuild()`` makes again from tensors the backward keeps anyway. Each handle that holds one of them, or
a view of one, whether saved before or after the call, lets go of it; at the first unpack of such a
handle ``rebuild()`` runs once (without gradients, under the forward's autocast state) and the handle
returns its view of the rebuilt tensor (which must have the named tensor's shape, strides and dtype).
A rebuilt tensor is freed once every handle of it has been read.

``rebuild`` must give the forward's values: the same functions on the same inputs, and nothing random.
Only plain tensors that own their whole storage can be named (views of a larger buffer are kept as
saved); a named tensor no longer alive matches nothing, so a later allocation at its address is safe.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Optional

import torch


def _storage_key(t: torch.Tensor) -> Optional[int]:
    """The address of t's storage, for plain tensors with a non-empty one (else None)."""
    if type(t) is not torch.Tensor or t.layout != torch.strided:
        return None
    storage = t.untyped_storage()
    return storage.data_ptr() if storage.nbytes() > 0 else None


def _owns_storage(t: torch.Tensor) -> bool:
    return (_storage_key(t) is not None and t.storage_offset() == 0 and t.is_contiguous()
            and t.untyped_storage().nbytes() == t.numel() * t.element_size())


class _Rebuild:
    """One ``recompute`` call: its tensors' addresses, the function and, while it is needed, its output."""

    def __init__(self, tensors: Sequence[torch.Tensor], rebuild: Callable[[], Sequence[torch.Tensor]]) -> None:
        self.fn = rebuild
        self.keys = {_storage_key(t): i for i, t in enumerate(tensors) if _owns_storage(t)}
        self.alive = [weakref.ref(t) for t in tensors]
        self.meta = [(t.shape, t.stride(), t.dtype, t.device) for t in tensors]
        self.pending = [0] * len(tensors)  # handles that have yet to read tensor i
        self.values: list[Optional[torch.Tensor]] = [None] * len(tensors)
        device = tensors[0].device.type
        self.autocast = (device, torch.get_autocast_dtype(device), torch.is_autocast_enabled(device))

    def index(self, t: torch.Tensor) -> Optional[int]:
        """i when t shares the storage of named tensor i, which is still alive."""
        i = self.keys.get(_storage_key(t))
        return i if i is not None and self.alive[i]() is not None else None

    def value(self, i: int) -> torch.Tensor:
        if self.values[i] is None:
            device, dtype, enabled = self.autocast
            with torch.no_grad(), torch.autocast(device, dtype=dtype, enabled=enabled):
                out = list(self.fn())
            for j, (t, (shape, stride, dt, dev)) in enumerate(zip(out, self.meta)):
                if t.shape != shape or t.stride() != stride or t.dtype != dt or t.device != dev:
                    raise RuntimeError(f"recompute gave tensor {j} as {tuple(t.shape)} {t.dtype} on {t.device} "
                                       f"(strides {t.stride()}), the forward made {tuple(shape)} {dt} on {dev} "
                                       f"(strides {stride})")
            # keep only what some handle has yet to read
            self.values = [t if n > 0 or j == i else None for j, (t, n) in enumerate(zip(out, self.pending))]
        return self.values[i]  # type: ignore[return-value]

    def read(self, i: int) -> torch.Tensor:
        """Tensor i for a handle's first read: freed here once its last handle has it."""
        t = self.value(i)
        self.pending[i] -= 1
        if self.pending[i] <= 0:
            self.values[i] = None
        return t


class _Handle:
    """What autograd keeps for one saved tensor: the tensor, or where to rebuild it and its view."""

    __slots__ = ("tensor", "rebuild", "index", "view", "read_once")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor: Optional[torch.Tensor] = tensor
        self.rebuild: Optional[_Rebuild] = None
        self.index = -1
        self.view: tuple = ()
        self.read_once = False

    def defer(self, rebuild: _Rebuild, i: int) -> None:
        t = self.tensor
        assert t is not None
        self.view = (t.shape, t.stride(), t.storage_offset())
        self.rebuild, self.index, self.tensor = rebuild, i, None
        rebuild.pending[i] += 1

    def unpack(self) -> torch.Tensor:
        if self.tensor is not None:
            return self.tensor
        rebuild = self.rebuild
        assert rebuild is not None
        base = rebuild.value(self.index) if self.read_once else rebuild.read(self.index)
        self.read_once = True
        shape, stride, offset = self.view  # offset within the named tensor, which began its storage
        return base.as_strided(shape, stride, base.storage_offset() + offset)


class RecomputeScope:
    """``with RecomputeScope() as scope:`` ... ``scope.recompute(tensors, rebuild)`` (see the module)."""

    def __init__(self) -> None:
        self._handles: list[_Handle] = []
        self._rebuilds: list[_Rebuild] = []
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _Handle.unpack)

    def __enter__(self) -> "RecomputeScope":
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
        self._handles.clear()
        self._rebuilds.clear()

    def _pack(self, t: torch.Tensor) -> _Handle:
        handle = _Handle(t)
        for rebuild in self._rebuilds:
            i = rebuild.index(t)
            if i is not None:
                handle.defer(rebuild, i)
                return handle
        if _storage_key(t) is not None:
            self._handles.append(handle)
        return handle

    def recompute(self, tensors: Sequence[torch.Tensor], rebuild: Callable[[], Sequence[torch.Tensor]]) -> None:
        """Let go of ``tensors`` wherever autograd saves them in this scope; ``rebuild()`` returns them
        again (same order, shapes and dtypes) when the backward needs them."""
        entry = _Rebuild(tensors, rebuild)
        if not entry.keys:
            return
        self._rebuilds.append(entry)
        kept = []
        for handle in self._handles:
            i = entry.index(handle.tensor)  # type: ignore[arg-type]
            if i is None:
                kept.append(handle)
            else:
                handle.defer(entry, i)
        self._handles = kept
