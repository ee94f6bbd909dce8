"""Tile shapes of the sliding-window attention kernels, per device, head dim and dtype."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from gdn2.ops.backend import settings


@dataclass(frozen=True)
class FwdConfig:
    """Tile shape of the forward kernel: BLOCK_M queries x BLOCK_N keys per step; ``tma``: k and v
    tiles come through Hopper TMA descriptors (falls back to pointer loads where TMA cannot be used)."""
    block_m: int = 128
    block_n: int = 64
    num_warps: int = 8
    num_stages: int = 3
    tma: bool = False


@dataclass(frozen=True)
class BwdConfig:
    """Tile shapes of the backward.

    ``block_n`` keys per dk/dv program, stepping over ``block_m`` queries at a time. dq comes from a
    second kernel: with ``dq_from_ds`` the dk/dv pass also stores ds (in the inputs' dtype, as the
    products use it) into a scratch buffer, and a kernel of one product per block, ds k, reads it back
    (``ds_block_m`` queries per program, ``ds_num_warps``, ``ds_num_stages``, stepping over the dk/dv
    kernel's ``block_n`` keys; ``dq_tma``: ds and k tiles through TMA): five products per block pair
    instead of seven, for ~2 bytes per visible (query, key) pair written and read. The scratch is
    bounded by ``GDN2_SWA_DS_SCRATCH_MB`` (the backward then runs in groups of heads that fit it).
    Without ``dq_from_ds``, and where one head alone does not fit the scratch (long full-causal rows),
    the recomputing dq kernel runs instead: ``dq_block_m`` queries per program stepping over
    ``dq_block_n`` keys. ``tma`` / ``dq_tma``: the streamed tiles (q and do in the dk/dv kernel, k and v
    in the dq kernel) come through Hopper TMA descriptors.
    """
    block_m: int = 32
    block_n: int = 128
    num_warps: int = 8
    num_stages: int = 3
    dq_block_m: int = 128
    dq_block_n: int = 64
    dq_num_warps: int = 8
    dq_num_stages: int = 3
    tma: bool = False
    dq_tma: bool = False
    dq_from_ds: bool = False
    ds_block_m: int = 128
    ds_num_warps: int = 4
    ds_num_stages: int = 3


def interpreted(device: torch.device) -> bool:
    """Whether kernels for tensors on ``device`` run in Triton's interpreter (any non-CUDA device)."""
    return device.type != "cuda" or settings().interpret


def default_configs(head_dim: int, device: torch.device,
                    dtype: torch.dtype = torch.bfloat16) -> tuple[FwdConfig, BwdConfig]:
    """The tile shapes used when none are given: small tiles under the interpreter (fast on CPU),
    Hopper-sized tiles on CUDA, shrinking as the head dim grows so that accumulators fit registers.

    D = 128 is the measured one (bench/ops_swa.py sweep on an H200); the others are scaled from it.
    The tiles are sized for 16-bit inputs; for wider ones (fp32) the streamed tiles shrink until the
    pipelined buffers fit the shared memory (see ``fit_shared_memory``).
    """
    if interpreted(device):
        return (FwdConfig(32, 16, 4, 1),
                BwdConfig(16, 32, 4, 1, 32, 16, 4, 1, dq_from_ds=True, ds_block_m=32, ds_num_stages=1))
    if head_dim <= 64:
        return fit_shared_memory(FwdConfig(128, 64, 4, 3),
                                 BwdConfig(32, 128, 8, 3, 128, 64, 8, 3), head_dim, dtype)
    if head_dim <= 128:
        # dk/dv in one-warp-group programs of 64 keys x 32 queries: two share an SM, so one's products
        # run under the other's exponentials; TMA for the streamed tiles; dq from the stored ds (the
        # sweeps behind these choices: bench/NOTES.md, "Sliding-window attention")
        return fit_shared_memory(FwdConfig(128, 128, 8, 3, tma=True),
                                 BwdConfig(32, 64, 4, 3, 128, 64, 8, 3, tma=True, dq_tma=True,
                                           dq_from_ds=True, ds_block_m=128, ds_num_warps=4, ds_num_stages=3),
                                 head_dim, dtype)
    return fit_shared_memory(FwdConfig(64, 64, 8, 2),
                             BwdConfig(32, 64, 4, 1, 64, 32, 4, 1), head_dim, dtype)


# Pipelined buffers per program: the streamed tiles (two of them: k and v, or q and do) times the
# stages. Hopper has 227 KB per block; the rest is left for the compiler's own scratch.
SHARED_MEMORY_BUDGET = 200 * 1024


def streamed_bytes(rows: int, stages: int, head_dim: int, itemsize: int) -> int:
    return 2 * rows * head_dim * itemsize * max(stages, 1)


def fit_shared_memory(fwd: FwdConfig, bwd: BwdConfig, head_dim: int,
                      dtype: torch.dtype) -> tuple[FwdConfig, BwdConfig]:
    """Halve each kernel's streamed tile (forward and dq: keys; dk/dv: queries) until its pipelined
    buffers fit ``SHARED_MEMORY_BUDGET`` for this dtype (fp32 doubles them: a 128 x 128 x 3-stage
    forward needs 384 KB). 16-bit inputs at the measured tile shapes are left as they are."""
    size = torch.empty((), dtype=dtype).element_size()

    def shrink(rows, stages):
        while rows > 16 and streamed_bytes(rows, stages, head_dim, size) > SHARED_MEMORY_BUDGET:
            rows //= 2
        return rows

    fwd = replace(fwd, block_n=shrink(fwd.block_n, fwd.num_stages))
    bwd = replace(bwd, block_m=shrink(bwd.block_m, bwd.num_stages),
                  dq_block_n=shrink(bwd.dq_block_n, bwd.dq_num_stages))
    if size > 2:  # TMA was measured with 16-bit tiles only; wider inputs keep the pointer loads
        fwd, bwd = replace(fwd, tma=False), replace(bwd, tma=False, dq_tma=False)
    return fwd, bwd
