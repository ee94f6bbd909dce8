"""Triton sliding-window flash attention against the explicit-mask oracle.

On CPU the kernels run under TRITON_INTERPRET=1 with fp32 / fp16 inputs and small tiles; on CUDA the
same cases also run in bf16 at D = 128 with the default (Hopper-sized) tiles.
"""

import dataclasses
import math

import pytest
import torch

from gdn2.ops import sliding_window_attention
from gdn2.ops.reference import sliding_window_attention_reference
from gdn2.ops.swa import (BwdConfig, FwdConfig, _tma_usable, count_key_blocks, count_query_blocks,
                          key_block_range, query_block_range, sliding_window_attention_triton, swa_backward,
                          swa_forward, SHARED_MEMORY_BUDGET, default_configs, streamed_bytes)
from gdn2.ops.testing import rel_err

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"

# Small tiles keep the interpreter fast and make T = 37 / 100 span several partial blocks. The
# layouts exercise BLOCK_M > BLOCK_N, BLOCK_M < BLOCK_N and equal tiles, and the four ways of
# computing dq (from the stored ds, by its own recomputing kernel, by atomic adds of dq or of dq^T),
# plus TMA-descriptor loads and stores.
SMALL = {
    "m32n16_atomic": (FwdConfig(32, 16, 4, 1), BwdConfig(16, 32, 4, 1, True, 32, 16, 4, 1)),
    "m16n32_split": (FwdConfig(16, 32, 4, 1), BwdConfig(32, 16, 4, 1, False, 16, 32, 4, 1)),
    "m32n32_atomic_t": (FwdConfig(32, 32, 4, 1), BwdConfig(16, 32, 4, 1, True, dq_transposed=True)),
    # every streamed tile through TMA descriptors: rows past a sequence's end are the next
    # sequence's or zeros, never masked at load time, so the score masks alone must drop them
    "m32n16_tma": (FwdConfig(32, 16, 4, 1, tma=True),
                   BwdConfig(16, 32, 4, 1, False, 32, 16, 4, 1, tma=True, dq_tma=True)),
    # dq from the stored ds: pointer stores and loads; TMA ones, where the dq kernel's 32-query
    # tiles start before a 16-key slab (the diagonal block's negative columns load as zeros)
    "m16n32_ds": (FwdConfig(16, 32, 4, 1),
                  BwdConfig(32, 32, 4, 1, False, dq_from_ds=True, ds_block_m=16, ds_num_stages=1)),
    "m32n16_ds_tma": (FwdConfig(32, 16, 4, 1, tma=True),
                      BwdConfig(16, 16, 4, 1, False, tma=True, dq_tma=True, dq_from_ds=True, ds_block_m=32,
                                ds_num_stages=1)),
}


def _inputs(B, T, H, HKV, D, dtype, seed, device=DEVICE):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, D, generator=gen)
    k = torch.randn(B, T, HKV, D, generator=gen)
    v = torch.randn(B, T, HKV, D, generator=gen)
    do = torch.randn(B, T, H, D, generator=gen)
    return [t.to(device=device, dtype=dtype) for t in (q, k, v, do)]


def _reference(q, k, v, do, window, cu):
    """o, dq, dk, dv of the explicit-mask oracle in float64 (float32 on CUDA, where it is the GPU's)."""
    ref_dtype = torch.float32 if q.is_cuda else torch.float64
    leaves = [t.detach().to(ref_dtype).requires_grad_() for t in (q, k, v)]
    o = sliding_window_attention_reference(*leaves, window, cu_seqlens=cu)
    grads = torch.autograd.grad(o, leaves, do.to(ref_dtype))
    return (o, *grads)


def _ours(q, k, v, do, window, cu, configs=None):
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    kw = {} if configs is None else dict(fwd_config=configs[0], bwd_config=configs[1])
    o = sliding_window_attention_triton(*leaves, window, None, cu, **kw)
    grads = torch.autograd.grad(o, leaves, do)
    return (o, *grads)


CASES = [
    # B, T, H, HKV, D, window, cu_seqlens
    (2, 37, 4, 2, 16, 8, None),             # T not a multiple of any tile, grouped KV heads
    (2, 100, 2, 1, 64, 20, None),           # D = 64, one KV head for two query heads
    (2, 100, 2, 2, 16, None, None),         # full causal
    (1, 37, 2, 2, 16, 64, None),            # window longer than the sequence
    (2, 1, 2, 1, 16, 5, None),              # a single token
    (1, 100, 4, 2, 16, 7, [0, 30, 31, 100]),  # packed sequences, one of length 1
    (1, 100, 2, 1, 24, None, [0, 45, 100]),   # head dim not a power of two, varlen causal
]


def _err(x, ref):
    """rel_err, with a floor on the denominator: with one visible key (T = 1, W = 1) dq and dk are
    exactly zero and only rounding remains."""
    x, ref = x.detach().double(), ref.detach().double()
    return float((x - ref).norm() / max(float(ref.norm()), 0.1 * ref.numel() ** 0.5))


PARAMS = [(c, torch.float32, name) for c in CASES for name in SMALL] + \
         [(c, torch.float16, name) for c in CASES for name in ("m32n16_atomic", "m32n16_ds_tma")]


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # ds rows past seq_len: never stored
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("case,dtype,cfg_name", PARAMS,
                         ids=[f"{'x'.join(map(str, c[:5]))}-w{c[5]}-{'cu' if c[6] else 'dense'}-"
                              f"{str(d)[6:]}-{n}" for c, d, n in PARAMS])
def test_matches_reference(case, dtype, cfg_name):
    B, T, H, HKV, D, window, cu = case
    q, k, v, do = _inputs(B, T, H, HKV, D, dtype, seed=T * 7 + D)
    cu_t = torch.tensor(cu, dtype=torch.int32, device=DEVICE) if cu else None
    ours = _ours(q, k, v, do, window, cu_t, SMALL[cfg_name])
    ref = _reference(q, k, v, do, window, cu_t)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for name, a, b in zip(("o", "dq", "dk", "dv"), ours, ref):
        assert a.dtype == dtype, name
        assert torch.isfinite(a).all(), name
        assert _err(a, b) < tol, (name, _err(a, b))


@pytest.mark.skipif(not CUDA, reason="bf16 Tensor-Core path needs a GPU")
@pytest.mark.parametrize("B,T,H,HKV,window,cu", [
    (2, 1000, 4, 2, 256, None), (1, 300, 2, 2, 1000, None), (2, 777, 4, 4, None, None),
    (1, 1500, 4, 1, 128, [0, 1, 700, 1100, 1500]),
])
def test_matches_reference_bf16_cuda(B, T, H, HKV, window, cu):
    q, k, v, do = _inputs(B, T, H, HKV, 128, torch.bfloat16, seed=T)
    cu_t = torch.tensor(cu, dtype=torch.int32, device=DEVICE) if cu else None
    for a, b in zip(_ours(q, k, v, do, window, cu_t), _reference(q, k, v, do, window, cu_t)):
        assert rel_err(a, b) < 1e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_window_one_is_identity_on_values(dtype):
    # each query sees only itself: o = v, dv = sum of do over the group, dq = dk = 0
    B, T, H, HKV, D = 2, 37, 4, 2, 16
    q, k, v, do = _inputs(B, T, H, HKV, D, dtype, seed=11)
    o, dq, dk, dv = _ours(q, k, v, do, 1, None, None if CUDA else SMALL["m32n16_atomic"])
    expect_o = v.repeat_interleave(H // HKV, dim=2)
    assert rel_err(o, expect_o) < (1e-6 if dtype == torch.float32 else 1e-3)
    expect_dv = do.float().view(B, T, HKV, H // HKV, D).sum(3)
    assert rel_err(dv, expect_dv) < (1e-6 if dtype == torch.float32 else 2e-3)
    # dq = dk = 0 up to rounding of p * (do.v - o.do)
    bound = 1e-5 if dtype == torch.float32 else 2e-2
    assert dq.float().abs().max() < bound and dk.float().abs().max() < bound


@pytest.mark.parametrize("window,cu", [(9, None), (None, None), (5, [0, 20, 21, 70])])
def test_lse_matches_direct_logsumexp(window, cu):
    B, T, H, HKV, D = (1 if cu else 2), 70, 2, 1, 16
    q, k, v, _ = _inputs(B, T, H, HKV, D, torch.float32, seed=5)
    scale = 0.3
    cu_t = torch.tensor(cu, dtype=torch.int32, device=DEVICE) if cu else None
    cfg = None if CUDA else SMALL["m32n16_atomic"][0]
    o, lse = swa_forward(q, k, v, window, scale, cu_t, config=cfg)
    i = torch.arange(T, device=q.device)
    mask = i[None, :] <= i[:, None]
    if window is not None:
        mask &= i[:, None] - i[None, :] < window
    if cu is not None:
        doc = torch.zeros(T, dtype=torch.long, device=q.device)
        doc[cu_t[1:-1].long()] = 1
        doc = doc.cumsum(0)
        mask &= doc[:, None] == doc[None, :]
    kf = k.double().repeat_interleave(H // HKV, dim=2)
    scores = torch.einsum("bihd,bjhd->bhij", q.double(), kf) * scale
    expect = scores.masked_fill(~mask, float("-inf")).logsumexp(-1)
    assert lse.shape == (B, H, T) and lse.dtype == torch.float32
    assert (lse.double() - expect).abs().max() < 1e-5
    assert rel_err(o, sliding_window_attention_reference(q.double(), k.double(), v.double(), window,
                                                         scale, cu_t)) < 1e-5


def test_tma_only_where_descriptors_fit():
    q = torch.zeros(1, 8, 2, 16, device=DEVICE)
    assert _tma_usable(True, 16, 16, q)
    assert not _tma_usable(False, 16, 16, q)
    assert not _tma_usable(True, 24, 32, q)  # padded head dim: pointer loads
    odd = torch.zeros(1 * 8 * 2 * 16 + 1, device=DEVICE)[1:].view(1, 8, 2, 16)
    assert not _tma_usable(True, 16, 16, odd)  # base not 16-byte aligned


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # exp2 of masked-out scores
@pytest.mark.parametrize("window,cu", [(5, [0, 20, 21, 70]), (None, [0, 45, 70])])
def test_tma_loads_match_pointer_loads(window, cu):
    # packed sequences: TMA tiles cross into the neighbour sequence, pointer tiles load zeros there
    q, k, v, do = _inputs(1, 70, 2, 1, 16, torch.float32, seed=4)
    k[:, 20:] *= 30.0  # large neighbour keys would show through any missed mask
    cu_t = torch.tensor(cu, dtype=torch.int32, device=DEVICE)
    plain = _ours(q, k, v, do, window, cu_t, SMALL["m16n32_split"])
    f, b = SMALL["m16n32_split"]
    tma = _ours(q, k, v, do, window, cu_t, (dataclasses.replace(f, tma=True),
                                             dataclasses.replace(b, tma=True, dq_tma=True)))
    for x, y in zip(tma, plain):
        assert rel_err(x, y) < 1e-6


# the ds path runs 16-bit inputs on a GPU (fp32 there takes the recomputing dq kernel), any under the interpreter
DS_DTYPE, DS_TOL = (torch.float16, 1e-2) if CUDA else (torch.float32, 1e-5)


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # NaN rows past seq_len
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("cfg_name", ["m16n32_ds", "m32n16_ds_tma"])
@pytest.mark.parametrize("T,H,HKV,window,cu", [(45, 4, 2, 9, None), (70, 2, 1, 12, [0, 20, 21, 70]),
                                               (40, 2, 2, None, None)])
def test_ds_scratch_never_read_where_unwritten(cfg_name, T, H, HKV, window, cu, monkeypatch):
    """The ds scratch starts as NaN and the backward runs one (batch, KV head) row per launch: every
    pair the dq kernel reads must have been written by the dk/dv pass of the same launch."""
    import gdn2.ops.swa as swa
    f, b = SMALL[cfg_name]
    q, k, v, do = _inputs(2 if cu is None else 1, T, H, HKV, 16, DS_DTYPE, seed=T + H)
    cu_t = torch.tensor(cu, dtype=torch.int32, device=DEVICE) if cu else None
    span, _ = swa.ds_plan(q, k, window, cu_t, b, limit=2 ** 40)
    n_slabs = -(-T // b.block_n) + (len(cu) - 1 if cu else 0)
    one_row = (H // HKV) * n_slabs * b.block_n * span * q.element_size()
    monkeypatch.setenv("GDN2_SWA_DS_SCRATCH_MB", str(one_row / 2 ** 20))
    assert swa.ds_plan(q, k, window, cu_t, b) == (span, 1)
    real = swa._ds_scratch
    monkeypatch.setattr(swa, "_ds_scratch", lambda *a: real(*a).fill_(float("nan")))
    ours = _ours(q, k, v, do, window, cu_t, (f, b))
    ref = _reference(q, k, v, do, window, cu_t)
    for name, x, y in zip(("o", "dq", "dk", "dv"), ours, ref):
        assert torch.isfinite(x).all(), name
        assert _err(x, y) < DS_TOL, (name, _err(x, y))


def test_ds_path_falls_back_where_one_head_exceeds_the_scratch(monkeypatch):
    import gdn2.ops.swa as swa
    f, b = SMALL["m16n32_ds"]
    q, k, v, do = _inputs(1, 50, 2, 1, 16, DS_DTYPE, seed=3)
    assert swa.ds_plan(q, k, 10, None, b) is not None
    monkeypatch.setenv("GDN2_SWA_DS_SCRATCH_MB", "0.001")
    assert swa.ds_plan(q, k, 10, None, b) is None
    monkeypatch.setattr(swa, "_ds_scratch", lambda *a: pytest.fail("ds scratch allocated past the limit"))
    ours = _ours(q, k, v, do, 10, None, (f, b))
    for name, x, y in zip(("o", "dq", "dk", "dv"), ours, _reference(q, k, v, do, 10, None)):
        assert _err(x, y) < DS_TOL, name
    assert swa.ds_plan(q, k, 10, None, dataclasses.replace(b, dq_from_ds=False), limit=2 ** 40) is None
    monkeypatch.setenv("GDN2_SWA_DS_SCRATCH_MB", "lots")
    with pytest.raises(ValueError, match="GDN2_SWA_DS_SCRATCH_MB"):
        swa.ds_plan(q, k, 10, None, b)


def test_varlen_equals_separate_sequences():
    cu = [0, 23, 24, 90]
    q, k, v, do = _inputs(1, 90, 2, 1, 16, torch.float32, seed=9)
    cu_t = torch.tensor(cu, dtype=torch.int32, device=DEVICE)
    cfg = None if CUDA else SMALL["m16n32_split"]
    packed = _ours(q, k, v, do, 6, cu_t, cfg)
    for a, b in zip(cu[:-1], cu[1:]):
        alone = _ours(q[:, a:b], k[:, a:b], v[:, a:b], do[:, a:b], 6, None, cfg)
        for x, y in zip(packed, alone):
            assert rel_err(x[:, a:b], y) < 1e-6


# --------------------------------------------------------------------------------------------------
# Work bounded by the window
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("block_m,block_n", [(16, 16), (32, 16), (16, 32), (64, 128), (128, 64)])
def test_loop_bounds_cover_exactly_the_window(block_m, block_n):
    """Python twins of the in-kernel bounds: every visible (query, key) pair lies in a visited block,
    unmasked blocks hold only visible pairs, and the count of visited blocks depends on the window,
    not on the position (T x W work, not T^2)."""
    for seq_len in (1, 37, 100, 300):
        for window in (None, 1, 5, 16, 33, 64, 1000):
            w = seq_len if window is None else window
            key_cap = math.ceil((min(w, seq_len) + block_m - 1) / block_n) + 1
            for m0 in range(0, seq_len, block_m):
                rows = range(m0, min(m0 + block_m, seq_len))
                lo, a, b, hi = key_block_range(m0, seq_len, window, block_m, block_n)
                visited = set(range(lo, a, block_n)) | set(range(a, b, block_n)) | set(range(b, hi, block_n))
                needed = {j // block_n * block_n for i in rows for j in range(max(0, i - w + 1), i + 1)}
                assert needed <= visited
                assert all(n0 < seq_len for n0 in visited)
                for n0 in range(a, b, block_n):  # interior: no mask needed
                    assert all(0 <= i - j < w for i in rows for j in range(n0, n0 + block_n))
                assert count_key_blocks(m0, seq_len, window, block_m, block_n) == len(visited) <= key_cap
            query_cap = math.ceil((min(w, seq_len) + block_n - 1) / block_m) + 1
            for n0 in range(0, seq_len, block_n):
                cols = range(n0, min(n0 + block_n, seq_len))
                lo, a, b, hi = query_block_range(n0, seq_len, window, block_m, block_n)
                starts = list(range(lo, min(a, hi), block_m)) + list(range(a, b, block_m)) + list(range(b, hi, block_m))
                assert len(starts) == len(set(starts))
                covered = {i for m in starts for i in range(m, m + block_m)}
                needed = {i for j in cols for i in range(j, min(j + w, seq_len))}
                assert needed <= covered
                for m in range(a, b, block_m):
                    assert m + block_m <= seq_len
                    assert all(0 <= i - j < w for i in range(m, m + block_m) for j in cols)
                assert count_query_blocks(n0, seq_len, window, block_m, block_n) == len(starts) <= query_cap


def test_kernels_visit_only_window_blocks():
    """The kernels' own visit counters equal the Python bounds, and stay flat along the sequence."""
    B, T, H, HKV, D, window = 1, 200, 2, 1, 16, 20
    fwd_cfg, bwd_cfg = (FwdConfig(16, 16, 4, 1), BwdConfig(16, 16, 4, 1, True, 16, 16, 4, 1)) if not CUDA \
        else (FwdConfig(64, 32, 4, 2), BwdConfig(64, 32, 4, 2, True, 64, 32, 4, 2))
    q, k, v, do = _inputs(B, T, H, HKV, D, torch.float32, seed=1)
    n_q = math.ceil(T / fwd_cfg.block_m)
    visits = torch.full((B * H * n_q,), -1, dtype=torch.int32, device=q.device)
    o, lse = swa_forward(q, k, v, window, None, None, config=fwd_cfg, visits=visits)
    starts = [(n_q - 1 - pid) * fwd_cfg.block_m for pid in range(n_q)]  # heaviest block first
    expect = [count_key_blocks(m0, T, window, fwd_cfg.block_m, fwd_cfg.block_n) for m0 in starts]
    assert visits.view(B * H, n_q).tolist() == [expect] * (B * H)
    cap = math.ceil((window + fwd_cfg.block_m - 1) / fwd_cfg.block_n) + 1
    assert max(expect) <= cap < math.ceil(T / fwd_cfg.block_n)

    n_k = math.ceil(T / bwd_cfg.block_n)
    visits = torch.full((B * HKV * n_k,), -1, dtype=torch.int32, device=q.device)
    swa_backward(do, q, k, v, o, lse, window, None, None, config=bwd_cfg, visits=visits)
    starts = [pid * bwd_cfg.block_n for pid in range(n_k)]  # most-seen key block first
    group = H // HKV
    expect = [group * count_query_blocks(n0, T, window, bwd_cfg.block_m, bwd_cfg.block_n) for n0 in starts]
    assert visits.view(B * HKV, n_k).tolist() == [expect] * (B * HKV)
    assert max(expect) <= group * (math.ceil((window + bwd_cfg.block_n - 1) / bwd_cfg.block_m) + 1)


# --------------------------------------------------------------------------------------------------
# API
# --------------------------------------------------------------------------------------------------

def test_dispatch_through_public_api():
    q, k, v, _ = _inputs(1, 40, 2, 1, 16, torch.float32, seed=2)
    cu = torch.tensor([0, 17, 40], dtype=torch.int32, device=DEVICE)
    ours = sliding_window_attention(q, k, v, 6, scale=0.5, cu_seqlens=cu, backend="triton")
    ref = sliding_window_attention_reference(q.double(), k.double(), v.double(), 6, 0.5, cu)
    assert rel_err(ours, ref) < 1e-5


def test_bad_input_names_the_argument():
    q = torch.randn(1, 8, 2, 16, device=DEVICE)
    kv = torch.randn(1, 8, 1, 16, device=DEVICE)
    with pytest.raises(ValueError, match="share one dtype"):
        sliding_window_attention_triton(q, kv.half(), kv.half(), 4)
    with pytest.raises(ValueError, match="float16, bfloat16 or float32"):
        sliding_window_attention_triton(q.double(), kv.double(), kv.double(), 4)
    with pytest.raises(ValueError, match="head dim"):
        big = torch.randn(1, 2, 1, 512, device=DEVICE)
        sliding_window_attention_triton(big, big, big, 4)
    with pytest.raises(ValueError, match="window"):
        sliding_window_attention_triton(q, kv, kv, 0)
    with pytest.raises(ValueError, match="scale"):
        sliding_window_attention_triton(q, kv, kv, 4, scale=-0.1)
    with pytest.raises(ValueError, match="multiple"):
        sliding_window_attention_triton(q, torch.randn(1, 8, 3, 16, device=DEVICE),
                                        torch.randn(1, 8, 3, 16, device=DEVICE), 4)
    with pytest.raises(ValueError, match="cu_seqlens"):
        sliding_window_attention_triton(q.expand(2, -1, -1, -1), kv.expand(2, -1, -1, -1),
                                        kv.expand(2, -1, -1, -1), 4,
                                        cu_seqlens=torch.tensor([0, 8], device=DEVICE))


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_cuda_tiles_fit_shared_memory_for_every_dtype(head_dim, monkeypatch):
    """The CUDA tile shapes are measured for bf16; fp32 inputs double every pipelined buffer, so the
    streamed tiles must shrink until they fit (a 128 x 128, 3-stage forward needs 384 KB in fp32, beyond
    Hopper's 227 KB). 16-bit inputs keep the measured shapes."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    cuda = torch.device("cuda")
    half = default_configs(head_dim, cuda, torch.bfloat16)
    assert default_configs(head_dim, cuda, torch.float16) == half
    fwd, bwd = default_configs(head_dim, cuda, torch.float32)
    for f, b, size in ((fwd, bwd, 4), (*half, 2)):
        assert streamed_bytes(f.block_n, f.num_stages, head_dim, size) <= SHARED_MEMORY_BUDGET
        assert streamed_bytes(b.dq_block_n, b.dq_num_stages, head_dim, size) <= SHARED_MEMORY_BUDGET
        assert streamed_bytes(b.block_m, b.num_stages, head_dim, size) <= SHARED_MEMORY_BUDGET
    if head_dim == 128:
        assert half[0].block_n == 128 and fwd.block_n == 64  # the measured bf16 tile, halved for fp32
        assert half[0].tma and not fwd.tma and not bwd.dq_tma
