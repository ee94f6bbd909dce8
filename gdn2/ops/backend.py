"""Which backend each operator runs on, and every environment switch of ``gdn2.ops``, read in one place.

The switches are read from the environment once, at the first call that needs them (not at import), into
a frozen :class:`Settings`. :func:`reload_settings` reads them again after the environment changed;
:func:`override` replaces some of them for the duration of a ``with`` block (tests).

One backend rule for every operator (``gdn2``, ``swa``, ``decode_attention``, ``short_conv``,
``pointwise``), decided here and nowhere else: the ``backend=`` argument, else ``GDN2_BACKEND``, else the
default: on CUDA tensors flash-attn for ``swa`` when it is installed, our Triton kernels otherwise; on any
other device the torch path. ``flash`` asked of an operator without a flash-attn path means the default.
``triton`` on CPU tensors works under ``TRITON_INTERPRET=1``. Tensors of a dtype the Triton kernels do
not take (float64) run on the torch path unless the ``backend=`` argument itself asks for Triton.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Optional

import torch

from gdn2.ops.checks import TRITON_DTYPES

BACKENDS = ("triton", "torch", "flash")
OPERATORS = ("gdn2", "swa", "decode_attention", "short_conv", "pointwise")
FLASH_OPERATORS = ("swa",)


def _check_backend(choice: str) -> None:
    if choice not in BACKENDS:
        raise ValueError(f"GDN2_BACKEND / backend must be one of {BACKENDS}, got {choice!r}")


@dataclasses.dataclass(frozen=True)
class Settings:
    """The environment switches (see the README's table)."""

    backend: Optional[str] = None  # GDN2_BACKEND: forced backend of every operator
    interpret: bool = False  # TRITON_INTERPRET=1: Triton's CPU interpreter runs the kernels
    autotune: bool = False  # GDN2_AUTOTUNE=1: autotune the GDN-2 chunk kernels instead of pinned configs
    skip_configs: frozenset[str] = frozenset()  # GDN2_SKIP_CONFIGS: "kernel:index" entries never launched
    ds_scratch_mb: float = 2048.0  # GDN2_SWA_DS_SCRATCH_MB: cap of the SWA backward's ds scratch

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> "Settings":
        backend = env.get("GDN2_BACKEND") or None
        if backend is not None:
            _check_backend(backend)
        raw_mb = env.get("GDN2_SWA_DS_SCRATCH_MB", "2048")
        try:
            mb = float(raw_mb)
        except ValueError:
            raise ValueError(f"GDN2_SWA_DS_SCRATCH_MB must be a number of MiB, got {raw_mb!r}") from None
        return cls(
            backend=backend,
            interpret=env.get("TRITON_INTERPRET", "0") == "1",
            autotune=env.get("GDN2_AUTOTUNE", "0") == "1",
            skip_configs=frozenset(e.strip() for e in env.get("GDN2_SKIP_CONFIGS", "").split(",") if e.strip()),
            ds_scratch_mb=mb,
        )

    @property
    def ds_scratch_bytes(self) -> int:
        return int(self.ds_scratch_mb * 2 ** 20)


_current: Optional[Settings] = None


def settings() -> Settings:
    """The switches, read from the environment at the first call."""
    global _current
    if _current is None:
        _current = Settings.from_env()
    return _current


def reload_settings() -> Settings:
    """Read the environment again (after it changed) and return the new switches."""
    global _current
    _current = Settings.from_env()
    return _current


@contextmanager
def override(**changes) -> Iterator[Settings]:
    """Replace some switches (``Settings`` field names) inside a ``with`` block, e.g.
    ``with override(backend="triton"):``; the previous ones come back on exit."""
    global _current
    saved = settings()
    _current = dataclasses.replace(saved, **changes)
    try:
        yield _current
    finally:
        _current = saved


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def select_backend(op: str, device: torch.device, backend: Optional[str] = None,
                   dtype: Optional[torch.dtype] = None) -> str:
    """The backend ('triton', 'torch' or 'flash') that operator ``op`` runs on for tensors on ``device``
    (of ``dtype``, when given)."""
    if op not in OPERATORS:
        raise ValueError(f"unknown operator {op!r}; one of {OPERATORS}")
    if backend is not None:
        _check_backend(backend)
        if backend != "flash" or op in FLASH_OPERATORS:
            return backend
    if dtype is not None and dtype not in TRITON_DTYPES:
        return "torch"
    choice = settings().backend if backend is None else None
    if choice is not None and (choice != "flash" or op in FLASH_OPERATORS):
        return choice
    if device.type != "cuda":
        return "torch"
    if op in FLASH_OPERATORS and _installed("flash_attn"):
        return "flash"
    return "triton"


def traced_or_captured(x: torch.Tensor) -> bool:
    """Whether a call on x happens while an outer ``torch.compile`` traces or a CUDA graph captures (a
    decode step): there an operator's plain torch form is what gets fused or captured."""
    return torch.compiler.is_compiling() or (x.is_cuda and torch.cuda.is_current_stream_capturing())
