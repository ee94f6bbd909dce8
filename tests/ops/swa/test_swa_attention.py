"""Triton sliding-window flash attention against the explicit-mask oracle.

On CPU the kernels run under TRITON_INTERPRET=1 with fp32 / fp16 inputs and small tiles; on CUDA the
same cases also run in bf16 at D = 128 with the default (Hopper-sized) tiles.
"""

import dataclasses

import pytest
import torch

import gdn2.ops.swa.attention as swa
from gdn2.ops import sliding_window_attention_reference
from gdn2.ops.swa.attention import _tma_usable, sliding_window_attention_triton, swa_forward
from gdn2.ops.swa.configs import BwdConfig, FwdConfig
from gdn2.ops.testing import rel_err

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"

# Small tiles keep the interpreter fast and make T = 37 / 50 / 70 span several partial blocks. The
# layouts exercise BLOCK_M > BLOCK_N, BLOCK_M < BLOCK_N and equal tiles in every kernel, and each way of
# computing dq (by its own recomputing kernel, from the stored ds) with pointer loads and stores and
# with TMA descriptors. None: the default tiles (on CPU: pointer loads, dq from ds).
CONFIGS = {
    "default": None,
    "split": (FwdConfig(16, 32, 4, 1), BwdConfig(32, 16, 4, 1, 16, 32, 4, 1)),
    # every streamed tile through TMA descriptors: rows past a sequence's end are the next
    # sequence's or zeros, never masked at load time, so the score masks alone must drop them
    "tma": (FwdConfig(32, 16, 4, 1, tma=True), BwdConfig(16, 32, 4, 1, 32, 16, 4, 1, tma=True, dq_tma=True)),
    # dq from the stored ds: pointer stores and loads; TMA ones, where the dq kernel's 32-query tiles
    # start before a 16-key slab (the diagonal block's negative columns load as zeros)
    "ds": (FwdConfig(32, 32, 4, 1), BwdConfig(32, 32, 4, 1, dq_from_ds=True, ds_block_m=16, ds_num_stages=1)),
    "ds_tma": (FwdConfig(32, 16, 4, 1, tma=True),
               BwdConfig(16, 16, 4, 1, tma=True, dq_tma=True, dq_from_ds=True, ds_block_m=32, ds_num_stages=1)),
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


def _err(x, ref):
    """rel_err, with a floor on the denominator: with one visible key (T = 1, W = 1) dq and dk are
    exactly zero and only rounding remains."""
    x, ref = x.detach().double(), ref.detach().double()
    return float((x - ref).norm() / max(float(ref.norm()), 0.1 * ref.numel() ** 0.5))


def _assert_close(ours, ref, tol):
    for name, a, b in zip(("o", "dq", "dk", "dv"), ours, ref):
        assert torch.isfinite(a).all(), name
        assert _err(a, b) < tol, (name, _err(a, b))


@pytest.fixture
def nan_scratch(monkeypatch):
    """The ds scratch starts as NaN: every pair the dq kernel reads must have been written."""
    real = swa._ds_scratch
    monkeypatch.setattr(swa, "_ds_scratch", lambda *a: real(*a).fill_(float("nan")))


CASES = [
    # B, T, H, HKV, D, window, cu_seqlens
    (2, 37, 2, 1, 16, 8, None),              # T not a multiple of any tile, two query heads per KV head
    (1, 70, 1, 1, 64, None, None),           # full causal (unmasked interior blocks), D = 64
    (2, 1, 2, 1, 16, 5, None),               # a single token, a window longer than the sequence
    (1, 50, 2, 1, 16, 7, [0, 30, 31, 50]),   # packed sequences, one of length 1
    (1, 50, 1, 1, 24, None, [0, 25, 50]),    # head dim not a power of two (no TMA), varlen causal
]
# the default tiles also run in every other test here
PARAMS = ([(c, torch.float32, name) for c in CASES for name in CONFIGS if name != "default"]
          + [(c, torch.float16, name) for c in CASES[3:] for name in ("default", "ds_tma")])


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # ds rows past seq_len: never stored
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("case,dtype,cfg_name", PARAMS,
                         ids=[f"{'x'.join(map(str, c[:5]))}-w{c[5]}-{'cu' if c[6] else 'dense'}-"
                              f"{str(d)[6:]}-{n}" for c, d, n in PARAMS])
def test_matches_reference(case, dtype, cfg_name, nan_scratch):
    B, T, H, HKV, D, window, cu = case
    q, k, v, do = _inputs(B, T, H, HKV, D, dtype, seed=T * 7 + D)
    cu_t = torch.tensor(cu, dtype=torch.int32, device=DEVICE) if cu else None
    ours = _ours(q, k, v, do, window, cu_t, CONFIGS[cfg_name])
    assert all(a.dtype == dtype for a in ours)
    _assert_close(ours, _reference(q, k, v, do, window, cu_t), 1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.gpu  # bf16 tensor-core path, default (Hopper-sized) tiles
@pytest.mark.parametrize("B,T,H,HKV,window,cu", [
    (2, 1000, 4, 2, 256, None), (1, 300, 2, 2, 1000, None), (2, 777, 4, 4, None, None),
    (1, 1500, 4, 1, 128, [0, 1, 700, 1100, 1500]),
])
def test_matches_reference_bf16_cuda(B, T, H, HKV, window, cu):
    q, k, v, do = _inputs(B, T, H, HKV, 128, torch.bfloat16, seed=T)
    cu_t = torch.tensor(cu, dtype=torch.int32, device=DEVICE) if cu else None
    for a, b in zip(_ours(q, k, v, do, window, cu_t), _reference(q, k, v, do, window, cu_t)):
        assert rel_err(a, b) < 1e-2


def test_window_one_is_identity_on_values():
    # each query sees only itself: o = v, dv = sum of do over the group, dq = dk = 0
    B, T, H, HKV, D = 1, 37, 2, 1, 16
    q, k, v, do = _inputs(B, T, H, HKV, D, torch.float32, seed=11)
    o, dq, dk, dv = _ours(q, k, v, do, 1, None)
    assert rel_err(o, v.repeat_interleave(H // HKV, dim=2)) < 1e-6
    assert rel_err(dv, do.view(B, T, HKV, H // HKV, D).sum(3)) < 1e-6
    assert dq.abs().max() < 1e-5 and dk.abs().max() < 1e-5  # rounding of p * (do.v - o.do)


@pytest.mark.parametrize("window,cu", [(9, None), (None, [0, 20, 21, 50])])
def test_lse_matches_direct_logsumexp(window, cu):
    B, T, H, HKV, D = (1 if cu else 2), 50, 2, 1, 16
    q, k, v, _ = _inputs(B, T, H, HKV, D, torch.float32, seed=5)
    scale = 0.3
    cu_t = torch.tensor(cu, dtype=torch.int32, device=DEVICE) if cu else None
    o, lse = swa_forward(q, k, v, window, scale, cu_t)
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
@pytest.mark.parametrize("cfg_name,window", [("tma", 5), ("ds_tma", None)])
def test_tma_tiles_past_a_sequence_do_not_leak(cfg_name, window):
    # packed sequences: TMA tiles cross into the neighbour sequence, whose keys are made large so that
    # any missed mask would show
    q, k, v, do = _inputs(1, 50, 2, 1, 16, torch.float32, seed=4)
    k[:, 20:] *= 30.0
    cu_t = torch.tensor([0, 20, 21, 50], dtype=torch.int32, device=DEVICE)
    ours = _ours(q, k, v, do, window, cu_t, CONFIGS[cfg_name])
    _assert_close(ours, _reference(q, k, v, do, window, cu_t), 1e-5)


# the ds path runs 16-bit inputs on a GPU (fp32 there takes the recomputing dq kernel), any under the interpreter
DS_DTYPE, DS_TOL = (torch.float16, 1e-2) if CUDA else (torch.float32, 1e-5)


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # NaN rows past seq_len
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("cfg_name,T,H,HKV,window,cu", [("ds", 37, 2, 1, 9, None),
                                                        ("ds_tma", 50, 2, 1, 12, [0, 20, 21, 50])])
def test_ds_backward_in_one_row_per_launch(cfg_name, T, H, HKV, window, cu, nan_scratch, ops_settings):
    """A scratch cap of one (batch, KV head) row runs the backward as one launch per row, each reading
    only what the dk/dv pass of the same launch wrote."""
    f, b = CONFIGS[cfg_name]
    q, k, v, do = _inputs(2 if cu is None else 1, T, H, HKV, 16, DS_DTYPE, seed=T + H)
    cu_t = torch.tensor(cu, dtype=torch.int32, device=DEVICE) if cu else None
    span, rows = swa.ds_plan(q, k, window, cu_t, b, limit=2 ** 40)
    assert rows == q.shape[0] * HKV
    n_slabs = -(-T // b.block_n) + (len(cu) - 1 if cu else 0)
    one_row = (H // HKV) * n_slabs * b.block_n * span * q.element_size()
    ops_settings(ds_scratch_mb=one_row / 2 ** 20)
    assert swa.ds_plan(q, k, window, cu_t, b) == (span, 1)
    _assert_close(_ours(q, k, v, do, window, cu_t, (f, b)), _reference(q, k, v, do, window, cu_t), DS_TOL)


def test_ds_path_falls_back_where_one_head_exceeds_the_scratch(monkeypatch, ops_settings):
    f, b = CONFIGS["ds"]
    q, k, v, do = _inputs(1, 50, 2, 1, 16, DS_DTYPE, seed=3)
    assert swa.ds_plan(q, k, 10, None, b) is not None
    assert swa.ds_plan(q, k, 10, None, dataclasses.replace(b, dq_from_ds=False), limit=2 ** 40) is None
    ops_settings(ds_scratch_mb=0.001)
    assert swa.ds_plan(q, k, 10, None, b) is None
    monkeypatch.setattr(swa, "_ds_scratch", lambda *a: pytest.fail("ds scratch allocated past the limit"))
    _assert_close(_ours(q, k, v, do, 10, None, (f, b)), _reference(q, k, v, do, 10, None), DS_TOL)


def test_varlen_equals_separate_sequences():
    cu = [0, 17, 18, 40]
    q, k, v, do = _inputs(1, 40, 2, 1, 16, torch.float32, seed=9)
    cu_t = torch.tensor(cu, dtype=torch.int32, device=DEVICE)
    packed = _ours(q, k, v, do, 6, cu_t)
    for a, b in zip(cu[:-1], cu[1:]):
        alone = _ours(q[:, a:b], k[:, a:b], v[:, a:b], do[:, a:b], 6, None)
        for x, y in zip(packed, alone):
            assert rel_err(x[:, a:b], y) < 1e-6


def test_bad_input_names_the_argument():
    q = torch.randn(1, 8, 2, 16, device=DEVICE)
    kv = torch.randn(1, 8, 1, 16, device=DEVICE)
    with pytest.raises(ValueError, match="q must be \\[B, T, H, D\\]"):
        sliding_window_attention_triton(q[0], kv, kv, 4)
    with pytest.raises(ValueError, match="float16, bfloat16 or float32"):
        sliding_window_attention_triton(q.double(), kv.double(), kv.double(), 4)
    with pytest.raises(ValueError, match="share one dtype"):
        sliding_window_attention_triton(q, kv.half(), kv.half(), 4)
    with pytest.raises(ValueError, match="k and v must be \\[B, T, Hkv, D\\] matching q"):
        sliding_window_attention_triton(q, kv, kv[..., :8], 4)
    with pytest.raises(ValueError, match="multiple"):
        sliding_window_attention_triton(q, torch.randn(1, 8, 3, 16, device=DEVICE),
                                        torch.randn(1, 8, 3, 16, device=DEVICE), 4)
    with pytest.raises(ValueError, match="head dim"):
        big = torch.randn(1, 2, 1, 512, device=DEVICE)
        sliding_window_attention_triton(big, big, big, 4)
    with pytest.raises(ValueError, match="window must be a positive int or None"):
        sliding_window_attention_triton(q, kv, kv, 0)
    with pytest.raises(ValueError, match="scale"):
        sliding_window_attention_triton(q, kv, kv, 4, scale=-0.1)
    with pytest.raises(ValueError, match="1-D integer tensor"):
        sliding_window_attention_triton(q, kv, kv, 4, cu_seqlens=torch.tensor([0.0, 8.0], device=DEVICE))
    with pytest.raises(ValueError, match="cu_seqlens requires batch size 1"):
        sliding_window_attention_triton(q.expand(2, -1, -1, -1), kv.expand(2, -1, -1, -1),
                                        kv.expand(2, -1, -1, -1), 4,
                                        cu_seqlens=torch.tensor([0, 8], device=DEVICE))
