"""Shared pieces of the Triton GDN-2 kernels: chunk bookkeeping, autotuning, in-register helpers.

Token tensors are flattened to ``[TT, H, D]`` (``TT = B*T``); a sequence ``n`` owns tokens
``cu[n]:cu[n+1]`` (fixed-length batches are the special case ``cu = arange(0, B*T + 1, T)`` and need
no index tensors). Chunks of ``BT = 64`` tokens restart at every sequence start; the global chunk
``c`` is the unit of the chunk-parallel kernels and indexes the per-chunk state checkpoints.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from gdn2.ops.backend import settings

CHUNK = 64      # chunk length
SUB = 16        # sub-chunk length (diagonal blocks of the WY system)
LOG2E = tl.constexpr(1.4426950408889634)  # a constexpr so that kernels may read it
# Largest log2-decay over half a sub-chunk (8 rows) for which the diagonal 16x16 blocks are built as one
# product anchored at the sub-chunk's middle row: factors stay within [2^-60, 2^60], so every product,
# the discarded upper triangle included, is a finite normal number (about 5.2 nats per token on
# average, the usual lower bound of trained gates). Steeper sub-chunks take the exact column path.
FAST_SPAN = tl.constexpr(60.0)


def padded(d: int) -> int:
    """Smallest power of two >= d and >= 16 (tl.dot needs every dimension >= 16)."""
    return max(16, triton.next_power_of_2(d))


def dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs must stay fp32 inside tl.dot: tf32 would miss the 1e-4 accuracy target.
    return "ieee" if dtype == torch.float32 else "tf32"


# --------------------------------------------------------------------------------------------------
# Chunk bookkeeping
# --------------------------------------------------------------------------------------------------

@dataclass
class ChunkLayout:
    """Where the sequences and chunks of one call lie.

    N sequences, NC chunks in all; ``T`` / ``NT`` are the per-sequence length / chunk count of a
    fixed-length batch (unused when ``varlen``). ``cu`` (int32 [N+1]), ``chunk_info`` (int32 [NC, 2]:
    sequence, chunk within it) and ``chunk_off`` (int32 [N+1]: first global chunk of each sequence)
    exist only for varlen inputs; kernels compute them arithmetically otherwise.
    """

    N: int
    NC: int
    T: int
    NT: int
    varlen: bool
    cu: Optional[torch.Tensor]
    chunk_info: Optional[torch.Tensor]
    chunk_off: Optional[torch.Tensor]

    def kernel_args(self, dummy: torch.Tensor):
        cu = self.cu if self.varlen else dummy
        info = self.chunk_info if self.varlen else dummy
        off = self.chunk_off if self.varlen else dummy
        return cu, info, off


def chunk_layout(B: int, T: int, cu_seqlens: Optional[torch.Tensor], device: torch.device) -> ChunkLayout:
    if cu_seqlens is None:
        nt = triton.cdiv(T, CHUNK)
        return ChunkLayout(B, B * nt, T, nt, False, None, None, None)
    cu = [int(c) for c in cu_seqlens.tolist()]
    counts = [triton.cdiv(e - s, CHUNK) for s, e in zip(cu[:-1], cu[1:])]
    info, off = [], [0]
    for n, c in enumerate(counts):
        info.extend(x for i in range(c) for x in (n, i))
        off.append(off[-1] + c)
    as_t = lambda xs: torch.tensor(xs, dtype=torch.int32, device=device)  # noqa: E731
    return ChunkLayout(len(counts), off[-1], T, 0, True, as_t(cu), as_t(info), as_t(off))


@triton.jit
def chunk_identity(i_c, cu, chunk_info, T, NT, IS_VARLEN: tl.constexpr, BT: tl.constexpr):
    """Sequence of global chunk ``i_c``, its index within that sequence, its first token and valid length."""
    if IS_VARLEN:
        i_n = tl.load(chunk_info + 2 * i_c)
        i_l = tl.load(chunk_info + 2 * i_c + 1)
        bos = tl.load(cu + i_n)
        eos = tl.load(cu + i_n + 1)
    else:
        i_n = i_c // NT
        i_l = i_c % NT
        bos = i_n * T
        eos = bos + T
    t0 = bos + i_l * BT
    return i_n, i_l, t0, tl.minimum(eos - t0, BT)


@triton.jit
def chunk_bounds(i_c, cu, chunk_info, T, NT, IS_VARLEN: tl.constexpr, BT: tl.constexpr):
    """First token and valid length of global chunk ``i_c``."""
    _, _, t0, L = chunk_identity(i_c, cu, chunk_info, T, NT, IS_VARLEN, BT)
    return t0, L


@triton.jit
def key_block_program(cu, chunk_info, T, NT, H: tl.constexpr, K: tl.constexpr, IS_VARLEN: tl.constexpr,
                      BT: tl.constexpr, BK: tl.constexpr):
    """Where a program of a (chunks * key blocks, heads) grid works: chunk i_c, head i_h, the chunk's
    valid length L, the (token, head) row of its first token, that row's element offset into a
    [TT, H, K] tensor and the key block's channel offsets o_k."""
    return key_block_at(tl.program_id(0), tl.program_id(1), cu, chunk_info, T, NT, H, K, IS_VARLEN, BT, BK)


@triton.jit
def key_block_at(p0, i_h, cu, chunk_info, T, NT, H: tl.constexpr, K: tl.constexpr, IS_VARLEN: tl.constexpr,
                 BT: tl.constexpr, BK: tl.constexpr):
    """``key_block_program`` for the program at (p0, i_h) of that grid."""
    NK = tl.cdiv(K, BK)
    i_c = p0 // NK
    t0, L = chunk_bounds(i_c, cu, chunk_info, T, NT, IS_VARLEN, BT)
    row0 = t0.to(tl.int64) * H + i_h
    o_k = (p0 % NK) * BK + tl.arange(0, BK)
    return i_c, i_h, L, row0, row0 * K, o_k


# The exact-path launches (a second launch over the programs the first one flagged as too steep for the
# anchored diagonal product) give each program EXACT_SPAN of the first launch's programs: almost every
# flag is zero, and one vector load of them replaces EXACT_SPAN programs that each load one flag and exit.
EXACT_SPAN = 16


@triton.jit
def steep_flags(steep, p0_first, i_h, N0, stride_p, stride_h, SPAN: tl.constexpr):
    """The flags of programs p0_first .. p0_first + SPAN - 1 (zero past N0) at head i_h, as [SPAN]."""
    o_s = p0_first + tl.arange(0, SPAN)
    return tl.load(steep + o_s * stride_p + i_h * stride_h, mask=o_s < N0, other=0)


@triton.jit
def flag_at(flags, s, SPAN: tl.constexpr):
    return tl.sum(tl.where(tl.arange(0, SPAN) == s, flags, 0), axis=0)


@triton.jit
def seq_bounds(i_n, cu, chunk_off, T, NT, IS_VARLEN: tl.constexpr):
    """First token, end token and first global chunk of sequence ``i_n``."""
    if IS_VARLEN:
        bos = tl.load(cu + i_n)
        eos = tl.load(cu + i_n + 1)
        c0 = tl.load(chunk_off + i_n)
    else:
        bos = i_n * T
        eos = bos + T
        c0 = i_n * NT
    return bos, eos, c0


@triton.jit
def scan_program(cu, chunk_off, T, NT, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, KP: tl.constexpr,
                 IS_VARLEN: tl.constexpr, BV: tl.constexpr):
    """Where a program of a (value blocks, sequences * heads) scan grid works: head i_h, the sequence's
    first / end token and first global chunk, the [KP] key and [BV] value offsets with their masks, and
    the element offsets of this program's [KP, BV] slice of an [N, H, K, V] state."""
    i_v = tl.program_id(0)
    i_nh = tl.program_id(1)
    i_n = i_nh // H
    i_h = i_nh % H
    bos, eos, c0 = seq_bounds(i_n, cu, chunk_off, T, NT, IS_VARLEN)
    o_k = tl.arange(0, KP)
    o_v = i_v * BV + tl.arange(0, BV)
    p_s = (i_n.to(tl.int64) * H + i_h) * K * V + (o_k[:, None] * V + o_v[None, :])
    return i_h, bos, eos, c0, o_k, o_k < K, o_v, o_v < V, p_s


@triton.jit
def scan_chunk(bos, eos, c0, i_t, i_h, H: tl.constexpr, BT: tl.constexpr):
    """Chunk i_t of a scan program's sequence: the mask of its valid rows ([BT]), the (token, head) row
    of its first token and its global chunk index (both int64)."""
    t0 = bos + i_t * BT
    return tl.arange(0, BT) < eos - t0, t0.to(tl.int64) * H + i_h, (c0 + i_t).to(tl.int64)


@triton.jit
def store_chunk_state(buf, i_c, i_h, o_k, o_v, m_kv, x, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr):
    """This program's [KP, BV] slice of chunk i_c's state in an [NC, H, K, V] buffer, in its dtype."""
    tl.store(buf + (i_c * H + i_h) * K * V + (o_k[:, None] * V + o_v[None, :]), x.to(buf.dtype.element_ty),
             mask=m_kv)


@triton.jit
def load_rows_t(ptr, row0, o_t, o_k, m_t, m_k, H: tl.constexpr, K: tl.constexpr):
    """A chunk's [BT, KP] tile of a token-major [TT, H, K] tensor, transposed ([KP, BT]) by the load."""
    return tl.load(ptr + row0 * K + (o_t[None, :] * (H * K) + o_k[:, None]), mask=m_t[None, :] & m_k[:, None],
                   other=0.0)


# --------------------------------------------------------------------------------------------------
# Tile helpers for the 16-row sub-chunks of a 64-row chunk
# --------------------------------------------------------------------------------------------------

@triton.jit
def row_of(x, i, BT: tl.constexpr):
    """Row i of a [BT, D] tile as a [D] vector."""
    r = tl.arange(0, BT)
    return tl.sum(tl.where((r == i)[:, None], x, 0.0), axis=0)


@triton.jit
def load_rows_raw(ptr, base, rows, o_k, L, H: tl.constexpr, K: tl.constexpr):
    """[len(rows), BK] tile of a token-major [TT, H, K] tensor in its own dtype; ``base`` is the (int64)
    element offset of the chunk's first token for this head; rows at or past ``L`` load as zeros.

    A kernel that needs several tiles issues all their loads before widening any of them, so that the
    loads are in flight together rather than one round trip each."""
    msk = (rows < L)[:, None] & (o_k < K)[None, :]
    return tl.load(ptr + base + (rows[:, None] * (H * K) + o_k[None, :]), mask=msk, other=0.0)


@triton.jit
def load_rows(ptr, base, rows, o_k, L, H: tl.constexpr, K: tl.constexpr):
    """``load_rows_raw`` widened to fp32."""
    return load_rows_raw(ptr, base, rows, o_k, L, H, K).to(tl.float32)


@triton.jit
def store_rows(ptr, base, rows, o_k, L, x, H: tl.constexpr, K: tl.constexpr):
    msk = (rows < L)[:, None] & (o_k < K)[None, :]
    tl.store(ptr + base + (rows[:, None] * (H * K) + o_k[None, :]), x.to(ptr.dtype.element_ty), mask=msk)


@triton.jit
def load_block(ptr, row0, i, j, o_c, L, H: tl.constexpr, BT: tl.constexpr,
               BC: tl.constexpr, TRANS: tl.constexpr):
    """Block (i, j) of a token-major [TT, H, BT] chunk matrix as a [BC, BC] tile, or its transpose
    (read in transposed order, no register transpose); rows at or past L read as zeros."""
    rows = i * BC + o_c
    if TRANS:
        p = row0 * BT + (rows[None, :] * (H * BT) + (j * BC + o_c)[:, None])
        x = tl.load(ptr + p, mask=(rows < L)[None, :], other=0.0)
    else:
        p = row0 * BT + (rows[:, None] * (H * BT) + (j * BC + o_c)[None, :])
        x = tl.load(ptr + p, mask=(rows < L)[:, None], other=0.0)
    return x


@triton.jit
def exp2_nonpos(x):
    # every decay factor is exp2 of an exponent <= 0 where it is used; clamping keeps the masked
    # lanes (whose exponent may be large and positive) finite instead of inf.
    return tl.exp2(tl.minimum(x, 0.0))


# --------------------------------------------------------------------------------------------------
# Launch configs: one pinned config per kernel; autotuning only with GDN2_AUTOTUNE=1
# --------------------------------------------------------------------------------------------------

class Tuned:
    """A Triton kernel with a pinned launch config, autotuned over ``configs`` only on request.

    By default (and always under ``TRITON_INTERPRET=1``) the config is ``pick(named_args)`` when a
    ``pick`` function is given (a shape heuristic), else ``configs[0]``: no benchmarking at the first
    call of a shape. ``GDN2_AUTOTUNE=1`` autotunes over ``configs`` on the GPU instead.
    ``clip`` maps a block-size meta-parameter to the kernel argument that bounds it (e.g.
    ``{"BK": "KP"}``): configs are clipped to that bound, so small heads do not compile oversized
    tiles. ``GDN2_SKIP_CONFIGS="kernel:i,kernel:j"`` drops configs by index, for a Triton build that
    cannot compile one of them. A launch whose pipeline needs more shared memory than the GPU has is
    retried with fewer stages. The switches are read at launch time (``gdn2.ops.backend.settings``).
    """

    def __init__(self, fn, configs, key, clip=None, pick=None):
        self.fn = fn
        self.all_configs = list(configs)
        self.key = key
        self.clip = clip or {}
        self.pick = pick
        self._pinned = None  # a config forced by ``pinned`` (launch-config sweeps)
        self._stages = {}  # pipeline depth that fitted, per (config, input dtypes)
        self._autotuned = {}  # triton.autotune wrapper per offered config list

    @property
    def configs(self) -> list:
        """The configs on offer: ``all_configs`` less those ``GDN2_SKIP_CONFIGS`` names (never none)."""
        skip = settings().skip_configs
        kept = [c for i, c in enumerate(self.all_configs) if f"{self.fn.__name__}:{i}" not in skip]
        return kept or self.all_configs[:1]

    @property
    def direct(self) -> bool:
        """Whether a launch uses one config without benchmarking (see the class doc)."""
        s = settings()
        return self._pinned is not None or s.interpret or not s.autotune or len(self.configs) == 1

    @contextmanager
    def pinned(self, cfg: triton.Config):
        """Launch with ``cfg`` alone (clipped) inside the ``with`` block."""
        saved, self._pinned = self._pinned, cfg
        try:
            yield self
        finally:
            self._pinned = saved

    def _autotuner(self):
        configs = self.configs
        sig = tuple(id(c) for c in configs)
        if sig not in self._autotuned:
            def bench(kernel_call, quantiles):
                # short runs: tuning happens once per key, and the key changes with every size bucket
                return triton.testing.do_bench(kernel_call, warmup=5, rep=20, quantiles=quantiles)

            self._autotuned[sig] = triton.autotune(configs=configs, key=self.key, do_bench=bench,
                                                   prune_configs_by={"early_config_prune": self._prune})(self.fn)
        return self._autotuned[sig]

    def _clipped(self, cfg, args):
        kw = dict(cfg.kwargs)
        for meta, bound in self.clip.items():
            if meta in kw and bound in args:
                kw[meta] = min(kw[meta], int(args[bound]))
        return triton.Config(kw, num_warps=cfg.num_warps, num_stages=cfg.num_stages, maxnreg=cfg.maxnreg)

    def _prune(self, configs, named_args, **kwargs):
        args = {**named_args, **kwargs}
        out, seen = [], set()
        for cfg in configs:
            c = self._clipped(cfg, args)
            sig = (tuple(sorted(c.kwargs.items())), c.num_warps, c.num_stages, c.maxnreg)
            if sig not in seen:
                seen.add(sig)
                out.append(c)
        return out

    def config_for(self, named: dict) -> triton.Config:
        """The pinned config for these launch arguments (clipped)."""
        if self._pinned is not None:
            cfg = self._pinned
        else:
            cfg = self.pick(named) if self.pick is not None else self.configs[0]
        return self._clipped(cfg, named)

    def __getitem__(self, grid):
        if not self.direct:
            return self._autotuner()[grid]
        interpret = settings().interpret

        def launch(*args, **kwargs):
            named = dict(zip(self.fn.arg_names, args), **kwargs)
            cfg = self.config_for(named)
            g = grid(cfg.kwargs) if callable(grid) else grid
            if interpret:
                return self.fn[g](*args, **kwargs, **cfg.kwargs)
            # a pipeline that does not fit this GPU's shared memory (fp32 inputs, smaller GPUs) runs with
            # fewer stages; the number that fits is remembered per config and input dtypes
            sig = (str(cfg), tuple(str(a.dtype) for a in args if isinstance(a, torch.Tensor)))
            stages = self._stages.get(sig, cfg.num_stages)
            # a register cap (ptx .maxnreg) trades spills for occupancy; only passed where a config sets one
            cap = {} if cfg.maxnreg is None else {"maxnreg": cfg.maxnreg}
            while True:
                try:
                    out = self.fn[g](*args, **kwargs, **cfg.kwargs, num_warps=cfg.num_warps, num_stages=stages, **cap)
                except OutOfResources:
                    if stages <= 1:
                        raise
                    stages -= 1
                    continue
                self._stages[sig] = stages
                return out

        return launch


def tuned(configs, key, clip=None, pick=None):
    return lambda fn: Tuned(fn, configs, key, clip, pick)
