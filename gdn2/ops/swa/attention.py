"""Triton sliding-window flash attention: launches, the backward's ds-scratch plan, and autograd.

Layout ``[B, T, H, D]`` for q, ``[B, T, Hkv, D]`` for k and v (H a multiple of Hkv). Query ``i`` sees
keys ``j`` with ``i - window < j <= i``; ``window=None`` is full causal attention. ``cu_seqlens``
(B == 1) packs several sequences into one row, each attended separately. Kernels: ``fwd`` (forward),
``bwd`` (delta, dk/dv, dq); tile shapes: ``configs``.

The backward takes dq, by default, from the ds tiles the dk/dv pass stores into a scratch bounded by
``GDN2_SWA_DS_SCRATCH_MB`` (the heads run in groups that fit); for fp32 inputs on a GPU, for a head
whose slabs alone exceed the bound, or where the config asks for it, dq comes from the recomputing
kernel, which runs first and writes delta on the way.

On Hopper the tiles a loop streams can come through TMA descriptors over the [B*T, H*D] view
(``FwdConfig.tma``, ``BwdConfig.dq_tma`` / ``tma``); elsewhere, or where a tensor's alignment does not
allow it, pointer loads serve the same configs.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton

from gdn2.ops.backend import settings
from gdn2.ops.swa.bwd import _bwd_delta_kernel, _swa_bwd_dkdv_kernel, _swa_bwd_dq_ds_kernel, _swa_bwd_dq_kernel
from gdn2.ops.swa.configs import BwdConfig, FwdConfig, default_configs, interpreted
from gdn2.ops.swa.fwd import _swa_fwd_kernel
from gdn2.ops.swa.utils import cdiv

try:  # host-side TMA descriptors (triton >= 3.4)
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover
    TensorDescriptor = None

LOG2E = 1.4426950408889634


_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _check(q, k, v, window, cu_seqlens, scale=None) -> None:
    for name, t in dict(q=q, k=k, v=v).items():
        if t.dim() != 4:
            raise ValueError(f"{name} must be [B, T, H, D], got shape {tuple(t.shape)}")
        if t.dtype not in _SUPPORTED_DTYPES:
            raise ValueError(f"{name} must be float16, bfloat16 or float32, got {t.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k and v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if k.shape != v.shape or k.shape[0] != q.shape[0] or k.shape[1] != q.shape[1] or k.shape[3] != q.shape[3]:
        raise ValueError(f"k and v must be [B, T, Hkv, D] matching q {tuple(q.shape)}, got "
                         f"{tuple(k.shape)} and {tuple(v.shape)}")
    if q.shape[2] % k.shape[2] != 0:
        raise ValueError(f"q heads ({q.shape[2]}) must be a multiple of k/v heads ({k.shape[2]})")
    if q.shape[3] > 256:
        raise ValueError(f"head dim D={q.shape[3]} exceeds the supported maximum 256")
    if window is not None and (not isinstance(window, int) or window < 1):
        raise ValueError(f"window must be a positive int or None, got {window!r}")
    if scale is not None and not scale > 0:
        raise ValueError(f"scale must be positive, got {scale!r}")
    if cu_seqlens is not None:
        if cu_seqlens.dim() != 1 or cu_seqlens.is_floating_point() or cu_seqlens.numel() < 2:
            raise ValueError("cu_seqlens must be a 1-D integer tensor [N+1]")
        if q.shape[0] != 1:
            raise ValueError(f"cu_seqlens requires batch size 1, got B={q.shape[0]}")


def _sequence_blocks(cu_seqlens: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """int64 [N] each: the ``block``-row blocks of each packed sequence, and the index of its first
    block in a varlen launch's table (``_block_table``)."""
    cu = cu_seqlens.long()
    n_blocks = (cu[1:] - cu[:-1] + block - 1) // block
    return n_blocks, torch.cumsum(n_blocks, 0) - n_blocks


def _block_table(cu_seqlens: torch.Tensor, block: int, T: int) -> torch.Tensor:
    """[G, 2] int32 rows (sequence, block in sequence) for each program of a varlen launch.

    Built on the device without a host sync: G = cdiv(T, block) + N bounds the true block count,
    and spare rows carry sequence -1.
    """
    n_seq = cu_seqlens.numel() - 1
    n_blocks, starts = _sequence_blocks(cu_seqlens, block)
    ends = starts + n_blocks
    grid = _grid_size(T, cu_seqlens, block)
    g = torch.arange(grid, device=cu_seqlens.device)
    seq = torch.searchsorted(ends, g, right=True)
    valid = seq < n_seq
    seq_c = seq.clamp(max=n_seq - 1)
    blk = g - starts[seq_c]
    table = torch.stack([torch.where(valid, seq_c, -1), blk], dim=1)
    return table.to(torch.int32).contiguous()


def _precision(dtype: torch.dtype) -> str:
    # fp32 inputs get exact fp32 products (the accuracy tests rely on it); 16-bit inputs ignore this
    return "ieee" if dtype == torch.float32 else "tf32"


def _grid_size(T: int, cu_seqlens: Optional[torch.Tensor], block: int) -> int:
    """Programs per (batch, head) row of a launch over ``block``-row blocks (``_launch_geometry``'s)."""
    return triton.cdiv(T, block) + (0 if cu_seqlens is None else cu_seqlens.numel() - 1)


def _launch_geometry(q, cu_seqlens, block):
    T = q.shape[1]
    if cu_seqlens is None:
        n_blocks = _grid_size(T, None, block)
        return n_blocks, n_blocks, None, q.new_empty(1, dtype=torch.int32)
    table = _block_table(cu_seqlens, block, T)
    return table.shape[0], table.shape[0], table, cu_seqlens


def _wide_offsets(T: int, heads: int, block_d: int) -> bool:
    """Whether one sequence row (plus a tile of overrun) can pass 2^31 elements."""
    return (T + 256) * heads * block_d >= 2 ** 31


def _window_args(window, T):
    # a window covering the whole row is plain causal attention: no window mask needed
    has_window = window is not None and window < T
    return has_window, (int(window) if has_window else 0)


def _tma_descriptor(use: bool, t: torch.Tensor, block_rows: int, D: int):
    """A TMA descriptor over ``t`` viewed as [rows, heads * D], loading [block_rows, D] tiles; or ``t``
    itself (an unused placeholder) where TMA is off or cannot serve this tensor."""
    if not use:
        return t
    t2 = t.view(t.shape[0] * t.shape[1], t.shape[2] * t.shape[3])
    return TensorDescriptor(t2, shape=list(t2.shape), strides=list(t2.stride()), block_shape=[block_rows, D])


def _tma_usable(want: bool, D: int, block_d: int, *tensors: torch.Tensor) -> bool:
    """TMA wants Hopper or newer, a power-of-two head dim, and 16-byte aligned bases and row strides."""
    if not want or TensorDescriptor is None or D != block_d:
        return False
    dev = tensors[0].device
    if not interpreted(dev) and torch.cuda.get_device_capability(dev)[0] < 9:
        return False
    return all(t.data_ptr() % 16 == 0 and (t.shape[2] * D * t.element_size()) % 16 == 0 for t in tensors)


def _block_d(D: int) -> int:
    """Channel tile of head dim ``D``: the next power of two, at least 16 (the products' minimum)."""
    return max(16, triton.next_power_of_2(D))


def _defaults(q: torch.Tensor, scale: Optional[float], config, backward: bool):
    """(scale, launch config, BLOCK_D) of one call: 1/sqrt(D) when ``scale`` is None, the default tiles
    of q's head dim, device and dtype (the backward's when ``backward``) when ``config`` is None."""
    D = q.shape[-1]
    cfg = config or default_configs(D, q.device, q.dtype)[1 if backward else 0]
    return (D ** -0.5 if scale is None else scale), cfg, _block_d(D)


def swa_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: Optional[int],
                scale: Optional[float] = None, cu_seqlens: Optional[torch.Tensor] = None, *,
                config: Optional[FwdConfig] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward pass without autograd.

    q: [B,T,H,D]; k, v: [B,T,Hkv,D], all of one dtype (fp16, bf16 or fp32). Returns ``o`` [B,T,H,D] in
    q's dtype and ``lse`` fp32 [B,H,T], the natural-log log-sum-exp of each query's scaled scores
    (with cu_seqlens, B == 1 and T runs over the packed tokens).
    """
    _check(q, k, v, window, cu_seqlens, scale)
    B, T, H, D = q.shape
    HKV = k.shape[2]
    scale, cfg, BLOCK_D = _defaults(q, scale, config, backward=False)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    o = torch.empty_like(q)
    lse = torch.empty(B, H, T, device=q.device, dtype=torch.float32)
    if T == 0:
        return o, lse
    grid0, n_blocks, table, cu = _launch_geometry(q, cu_seqlens, cfg.block_m)
    has_window, w = _window_args(window, T)
    tma = _tma_usable(cfg.tma, D, BLOCK_D, k, v)
    _swa_fwd_kernel[(grid0, B * H)](
        q, k, v, _tma_descriptor(tma, k, cfg.block_n, D), _tma_descriptor(tma, v, cfg.block_n, D),
        o, lse, cu, table if table is not None else cu,
        T, H, HKV, w, float(scale) * LOG2E, n_blocks,
        D=D, BLOCK_D=BLOCK_D, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        HAS_WINDOW=has_window, IS_VARLEN=cu_seqlens is not None,
        PRECISION=_precision(q.dtype), WIDE=_wide_offsets(T, H, BLOCK_D), TMA=tma,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return o, lse


def swa_backward_dq(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                    lse: torch.Tensor, window: Optional[int], scale: Optional[float] = None,
                    cu_seqlens: Optional[torch.Tensor] = None, *, config: Optional[BwdConfig] = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """The dq kernel alone (``config.dq_*`` tiles): returns dq and ``delta = rowsum(o * do)`` (fp32
    [B,H,T]), which the dk/dv kernel reads. Contiguous inputs of one dtype expected."""
    B, T, H, D = q.shape
    HKV = k.shape[2]
    scale, cfg, BLOCK_D = _defaults(q, scale, config, backward=True)
    dq = torch.empty_like(q)
    delta = torch.empty(B, H, T, device=q.device, dtype=torch.float32)
    has_window, w = _window_args(window, T)
    grid0, n_blocks, table, cu = _launch_geometry(q, cu_seqlens, cfg.dq_block_m)
    tma = _tma_usable(cfg.dq_tma, D, BLOCK_D, k, v)
    _swa_bwd_dq_kernel[(grid0, B * H)](
        q, k, v, _tma_descriptor(tma, k, cfg.dq_block_n, D), _tma_descriptor(tma, v, cfg.dq_block_n, D),
        o, do, lse, delta, dq, cu, table if table is not None else cu, T, H, HKV, w,
        float(scale) * LOG2E, float(scale), n_blocks,
        D=D, BLOCK_D=BLOCK_D, BLOCK_M=cfg.dq_block_m, BLOCK_N=cfg.dq_block_n, HAS_WINDOW=has_window,
        IS_VARLEN=cu_seqlens is not None, PRECISION=_precision(q.dtype), WIDE=_wide_offsets(T, H, BLOCK_D),
        TMA=tma, num_warps=cfg.dq_num_warps, num_stages=cfg.dq_num_stages)
    return dq, delta


def swa_backward_dkdv(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      lse: torch.Tensor, delta: torch.Tensor, window: Optional[int],
                      scale: Optional[float] = None, cu_seqlens: Optional[torch.Tensor] = None, *,
                      config: Optional[BwdConfig] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The dk/dv kernel alone: returns dk, dv. Contiguous inputs of one dtype expected."""
    scale, cfg, _ = _defaults(q, scale, config, backward=True)
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    _launch_dkdv(do, q, k, v, lse, delta, dk, dv, window, scale, cu_seqlens, cfg)
    return dk, dv


def _launch_dkdv(do, q, k, v, lse, delta, dk, dv, window, scale, cu_seqlens, cfg: BwdConfig, *,
                 ds=None, q_span=0, rows=None, geometry=None) -> None:
    """One dk/dv launch over the (batch, KV head) rows ``rows`` (start, count; default all), writing
    their dk and dv; with ``ds`` also their ds slabs (``q_span`` queries per key block). ``geometry``:
    ``_launch_geometry`` over ``cfg.block_n`` keys, when the caller launches several times."""
    B, T, H, D = q.shape
    HKV = k.shape[2]
    BLOCK_D = _block_d(D)
    row0, n_rows = rows if rows is not None else (0, B * HKV)
    has_window, w = _window_args(window, T)
    grid0, n_blocks, table, cu = geometry or _launch_geometry(q, cu_seqlens, cfg.block_n)
    tma = _tma_usable(cfg.tma, D, BLOCK_D, q, do)
    ds_tma = ds is not None and tma
    _swa_bwd_dkdv_kernel[(grid0, n_rows)](
        q, k, v, do, _tma_descriptor(tma, q, cfg.block_m, D), _tma_descriptor(tma, do, cfg.block_m, D),
        lse, delta, dk, dv, ds if ds is not None else delta,
        _slab_descriptor(ds, q_span, [cfg.block_n, cfg.block_m]) if ds_tma else delta, cu,
        table if table is not None else cu,
        T, H, HKV, w, float(scale) * LOG2E, float(scale), n_blocks, q_span, row0,
        D=D, BLOCK_D=BLOCK_D, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, HAS_WINDOW=has_window,
        IS_VARLEN=cu_seqlens is not None, STORE_DS=ds is not None, DS_TMA=ds_tma, PRECISION=_precision(q.dtype),
        WIDE=_wide_offsets(T, H, BLOCK_D), TMA=tma, num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def _launch_dq_from_ds(ds, k, dq, q_span, n_slabs, kb_start, window, scale, cu_seqlens, cfg: BwdConfig,
                       rows, geometry) -> None:
    """dq of the (batch, query head) rows ``rows`` (start, count) from their ds slabs (``n_slabs`` per
    row; ``kb_start``: each packed sequence's first slab; ``geometry``: ``_launch_geometry`` over
    ``cfg.ds_block_m`` queries)."""
    B, T, H, D = dq.shape
    HKV = k.shape[2]
    BLOCK_D = _block_d(D)
    has_window, w = _window_args(window, T)
    grid0, n_blocks, table, cu = geometry
    tma = _tma_usable(cfg.dq_tma, D, BLOCK_D, k)
    _swa_bwd_dq_ds_kernel[(grid0, rows[1])](
        ds, _slab_descriptor(ds, q_span, [cfg.block_n, cfg.ds_block_m]) if tma else ds,
        k, _tma_descriptor(tma, k, cfg.block_n, D), dq, cu, table if table is not None else cu,
        kb_start if kb_start is not None else cu,
        T, H, HKV, w, float(scale), n_blocks, n_slabs, q_span, rows[0],
        D=D, BLOCK_D=BLOCK_D, BLOCK_M=cfg.ds_block_m, BLOCK_N=cfg.block_n, HAS_WINDOW=has_window,
        IS_VARLEN=cu_seqlens is not None, PRECISION=_precision(dq.dtype), WIDE=_wide_offsets(T, H, BLOCK_D),
        TMA=tma, DS_TMA=tma, num_warps=cfg.ds_num_warps, num_stages=cfg.ds_num_stages)


def _slab_descriptor(ds: torch.Tensor, q_span: int, block: list[int]):
    """TMA descriptor over the ds scratch viewed as [slabs * block_n, q_span] (rows are keys)."""
    view = ds.view(-1, q_span)
    return TensorDescriptor(view, shape=list(view.shape), strides=list(view.stride()), block_shape=block)


def ds_plan(q: torch.Tensor, k: torch.Tensor, window: Optional[int], cu_seqlens: Optional[torch.Tensor],
            cfg: BwdConfig, limit: Optional[int] = None) -> Optional[tuple[int, int]]:
    """(queries per slab, KV-head rows per launch) of the dq-from-ds backward, or None where it does not
    apply: off in ``cfg``, fp32 inputs on a GPU (its transposed tf32 operand is not a Hopper product),
    or one KV head's slabs over the scratch limit (``limit`` bytes, default ``GDN2_SWA_DS_SCRATCH_MB``)."""
    if not cfg.dq_from_ds or (q.element_size() > 2 and not interpreted(q.device)):
        return None
    B, T, H, _ = q.shape
    HKV = k.shape[2]
    has_window, w = _window_args(window, T)
    span = cdiv(cfg.block_n - 1 + (w if has_window else T), cfg.block_m) * cfg.block_m
    n_slabs = _grid_size(T, cu_seqlens, cfg.block_n)
    rows_per_row = (H // HKV) * n_slabs * cfg.block_n  # slab rows (keys) per (batch, KV head) row
    per_row = rows_per_row * span * q.element_size()
    limit = settings().ds_scratch_bytes if limit is None else limit
    if per_row > limit:
        return None
    # the kernels address slab rows with 32-bit integers
    fit = min(limit // per_row, (2 ** 31 - 1) // rows_per_row)
    if fit < 1:
        return None
    launches = cdiv(B * HKV, fit)
    return span, cdiv(B * HKV, launches)  # equal launches rather than a full one and a remainder


def _ds_scratch(numel: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    # uninitialised: the dk/dv pass writes every pair the dq kernel reads (tests fill it with NaN)
    return torch.empty(numel, device=device, dtype=dtype)


def _delta(o: torch.Tensor, do: torch.Tensor) -> torch.Tensor:
    """fp32 [B,H,T] rowsum(o * do)."""
    B, T, H, D = o.shape
    BLOCK_T = 64
    delta = torch.empty(B, H, T, device=o.device, dtype=torch.float32)
    _bwd_delta_kernel[(triton.cdiv(T, BLOCK_T), B * H)](o, do, delta, T, H, D=D, BLOCK_T=BLOCK_T,
                                                       BLOCK_D=_block_d(D), num_warps=4)
    return delta


def swa_backward(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                 lse: torch.Tensor, window: Optional[int], scale: Optional[float] = None,
                 cu_seqlens: Optional[torch.Tensor] = None, *, config: Optional[BwdConfig] = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (dq [B,T,H,D], dk, dv [B,T,Hkv,D], in the inputs' dtype) from the forward's o and lse."""
    B, T, H, _ = q.shape
    HKV = k.shape[2]
    scale, cfg, _ = _defaults(q, scale, config, backward=True)
    q, k, v, o, do = (t.contiguous() for t in (q, k, v, o, do))
    do = do.to(q.dtype)
    if T == 0:
        return torch.zeros_like(q), torch.empty_like(k), torch.empty_like(v)
    plan = ds_plan(q, k, window, cu_seqlens, cfg)
    if plan is not None:
        span, rows_per_launch = plan
        group = H // HKV
        delta = _delta(o, do)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        # the launch geometries (block tables with cu_seqlens) are the same for every group of rows;
        # each dk/dv program (key block) of a row owns one slab
        key_blocks = _launch_geometry(q, cu_seqlens, cfg.block_n)
        query_blocks = _launch_geometry(q, cu_seqlens, cfg.ds_block_m)
        n_slabs = key_blocks[0]
        kb_start = None if cu_seqlens is None else _sequence_blocks(cu_seqlens, cfg.block_n)[1].to(torch.int32)
        n_rows = min(rows_per_launch, B * HKV)
        ds = _ds_scratch(n_rows * group * n_slabs * cfg.block_n * span, q.device, q.dtype)
        for row0 in range(0, B * HKV, n_rows):
            rows = (row0, min(n_rows, B * HKV - row0))
            _launch_dkdv(do, q, k, v, lse, delta, dk, dv, window, scale, cu_seqlens, cfg, ds=ds, q_span=span,
                         rows=rows, geometry=key_blocks)
            _launch_dq_from_ds(ds, k, dq, span, n_slabs, kb_start, window, scale, cu_seqlens, cfg,
                               (rows[0] * group, rows[1] * group), query_blocks)
        return dq, dk, dv
    # the dq kernel also writes delta, so it runs before the dk/dv kernel
    dq, delta = swa_backward_dq(do, q, k, v, o, lse, window, scale, cu_seqlens, config=cfg)
    dk, dv = swa_backward_dkdv(do, q, k, v, lse, delta, window, scale, cu_seqlens, config=cfg)
    return dq, dk, dv


class SlidingWindowAttentionFunction(torch.autograd.Function):
    """Autograd wrapper: saves q, k, v, o and the fp32 lse; the backward recomputes probabilities."""

    @staticmethod
    def forward(ctx, q, k, v, window, scale, cu_seqlens, fwd_config, bwd_config):
        o, lse = swa_forward(q, k, v, window, scale, cu_seqlens, config=fwd_config)
        ctx.save_for_backward(q, k, v, o, lse, cu_seqlens)
        ctx.window, ctx.scale, ctx.bwd_config = window, scale, bwd_config
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse, cu_seqlens = ctx.saved_tensors
        dq, dk, dv = swa_backward(do, q, k, v, o, lse, ctx.window, ctx.scale, cu_seqlens,
                                  config=ctx.bwd_config)
        return dq, dk, dv, None, None, None, None, None


def sliding_window_attention_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                    window: Optional[int], scale: Optional[float] = None,
                                    cu_seqlens: Optional[torch.Tensor] = None, *,
                                    fwd_config: Optional[FwdConfig] = None,
                                    bwd_config: Optional[BwdConfig] = None) -> torch.Tensor:
    """Causal sliding-window attention, differentiable in q, k and v.

    q: [B,T,H,D]; k, v: [B,T,Hkv,D] (H a multiple of Hkv), fp16 / bf16 / fp32, D <= 256. Query i sees
    keys j with ``i - window < j <= i`` (``window=None``: full causal). ``cu_seqlens`` (int [N+1],
    B == 1) keeps packed sequences apart. ``scale`` defaults to D**-0.5. Returns [B,T,H,D] in q's
    dtype. ``fwd_config`` / ``bwd_config`` override the tile shapes (benchmarks).
    """
    _check(q, k, v, window, cu_seqlens, scale)
    if cu_seqlens is not None:
        cu_seqlens = cu_seqlens.to(device=q.device, dtype=torch.int32).contiguous()
    if scale is None:
        scale = q.shape[-1] ** -0.5
    return SlidingWindowAttentionFunction.apply(q, k, v, window, float(scale), cu_seqlens,
                                                fwd_config, bwd_config)
