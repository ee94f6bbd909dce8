"""The ring-buffer decode attention kernel against its plain torch oracle (Triton's interpreter on the
CPU, fp32 and fp16), the split of the window over programs, and the entry point's backend dispatch."""

import pytest
import torch

import gdn2.ops.decode_attention.naive as naive_mod
import gdn2.ops.decode_attention.ring as ring_mod
from gdn2.ops import ring_decode_attention, ring_decode_attention_reference
from gdn2.ops.decode_attention.ring import ring_decode_attention_triton, split_count

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _inputs(B, C, H, Hkv, D, dtype, slot, column, seed=0):
    """Random decode-step inputs: cache contents, a ragged visibility mask (row r starts at column r;
    slot positions as a ring after ``column`` steps), RoPE tables at each row's position."""
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(B, (H + 2 * Hkv) * D, generator=gen).to(dtype)
    k_cache = torch.randn(B, C, Hkv, D, generator=gen).to(dtype)
    v_cache = torch.randn(B, C, Hkv, D, generator=gen).to(dtype)
    # column c sits in slot c % C; the slots hold the last C columns up to this step's
    cols = torch.arange(column - C + 1, column + 1)
    positions = torch.full((C,), -1, dtype=torch.long)
    positions[cols[cols >= 0] % C] = cols[cols >= 0]
    positions[slot] = -7  # stale: the op writes this step's column
    offsets = torch.arange(B)
    kpos = positions.clone()
    kpos[slot] = column
    visible = (kpos[None, :] >= offsets[:, None]) & (kpos[None, :] >= 0)
    pos = column - offsets
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
    ang = pos.float()[:, None] * inv[None, :]
    ang = torch.cat([ang, ang], dim=-1)
    tensors = dict(qkv=qkv, cos=ang.cos(), sin=ang.sin(), k_cache=k_cache, v_cache=v_cache, positions=positions,
                   slot=torch.tensor([slot]), column=torch.tensor(column), visible=visible)
    return {k: v.to(DEVICE) for k, v in tensors.items()}


def _run(fn, inputs, n_head, **kw):
    state = {k: v.clone() for k, v in inputs.items()}
    out = fn(state["qkv"], state["cos"], state["sin"], state["k_cache"], state["v_cache"], state["positions"],
             state["slot"], state["column"], state["visible"], n_head, **kw)
    return out, state


# (B, C, H, Hkv, D, slot, column, splits): one query head per kv head and grouped heads, a head size
# that is not a power of two, one split and several (the merge kernel), a window still filling up
CASES = [(2, 40, 4, 4, 32, 7, 87, 1), (2, 40, 4, 4, 32, 7, 87, 3), (3, 70, 6, 2, 16, 69, 69, 4),
         (1, 33, 4, 1, 24, 0, 99, 2), (2, 20, 2, 2, 16, 5, 5, None)]


PARAMS = [(torch.float32, *c) for c in CASES] + [(torch.float16, *c) for c in (CASES[1], CASES[2])]


@pytest.mark.parametrize("dtype,B,C,H,Hkv,D,slot,column,splits", PARAMS)
def test_kernel_matches_oracle(dtype, B, C, H, Hkv, D, slot, column, splits):
    inputs = _inputs(B, C, H, Hkv, D, dtype, slot, column)
    expected, ref_state = _run(ring_decode_attention_reference, inputs, H)
    got, state = _run(ring_decode_attention_triton, inputs, H, num_splits=splits)
    assert got.shape == (B, H * D) and got.dtype == dtype
    tol = 2e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(got, expected, atol=tol, rtol=tol)
    # the new key (rotated) and value land in the slot, exactly as the oracle rounds them
    torch.testing.assert_close(state["k_cache"], ref_state["k_cache"], atol=tol, rtol=tol)
    assert torch.equal(state["v_cache"], ref_state["v_cache"])
    assert torch.equal(state["positions"], ref_state["positions"]) and int(state["positions"][slot]) == column
    untouched = torch.ones(C, dtype=torch.bool)
    untouched[slot] = False
    assert torch.equal(state["k_cache"][:, untouched.to(DEVICE)], inputs["k_cache"][:, untouched.to(DEVICE)])
    assert not torch.equal(state["k_cache"][:, slot], inputs["k_cache"][:, slot])


def test_masked_slots_do_not_count_and_the_new_key_does():
    """A row that sees only the new slot returns the new value exactly; the old contents of that
    slot (here huge) are ignored."""
    B, C, H, D, slot = 2, 24, 2, 16, 9
    inputs = _inputs(B, C, H, H, D, torch.float32, slot, 40)
    inputs["visible"][0] = False
    inputs["visible"][0, slot] = True
    inputs["k_cache"][:, slot] = 1e4
    inputs["v_cache"][:, slot] = 1e4
    got, _ = _run(ring_decode_attention_triton, inputs, H, num_splits=3)
    v_new = inputs["qkv"][0, 2 * H * D:].reshape(H, D)
    torch.testing.assert_close(got[0].reshape(H, D), v_new, atol=1e-6, rtol=0)
    expected, _ = _run(ring_decode_attention_reference, inputs, H)
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=2e-5)


def test_split_count_fills_the_gpu_and_covers_the_window():
    # batch 1 of swa_gdn2_1.3B on an H200: the window is spread over many programs
    splits, chunk = split_count(1, 18, 2048, 64, 132)
    assert splits * 18 >= 2 * 132 and splits * chunk >= 2048 and chunk % 64 == 0
    assert (splits - 1) * chunk < 2048  # no empty split
    # batch 64: the rows and heads fill the GPU, the window stays in one program
    assert split_count(64, 18, 2048, 64, 132) == (1, 2048)
    assert split_count(1, 4, 10, 64, 132) == (1, 64)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_entry_point_dispatch(backend, ops_settings, monkeypatch):
    """The backend argument, else the setting, picks the kernel or the oracle; both update the caches."""
    calls = []
    for mod, name in ((ring_mod, "ring_decode_attention_triton"), (naive_mod, "ring_decode_attention_reference")):
        real = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, _real=real, _name=name: calls.append(_name) or _real(*a))
    inputs = _inputs(2, 20, 2, 1, 16, torch.float32, 5, 45)
    expected, ref_state = _run(ring_decode_attention_reference, inputs, 2)
    ran = "ring_decode_attention_triton" if backend == "triton" else "ring_decode_attention_reference"
    other = "torch" if backend == "triton" else "triton"
    for setting, kw in ((backend, {}), (other, dict(backend=backend))):
        ops_settings(backend=setting)
        calls.clear()
        got, state = _run(ring_decode_attention, inputs, 2, **kw)
        assert calls == [ran]
        torch.testing.assert_close(got, expected, atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(state["k_cache"], ref_state["k_cache"], atol=2e-5, rtol=2e-5)


def test_bad_input_raises_value_error():
    inputs = _inputs(2, 20, 2, 2, 16, torch.float32, 5, 45)
    cases = [("k_cache and v_cache must both be", dict(v_cache=inputs["v_cache"][:, :10])),
             ("n_head=3 is not a multiple", dict(n_head=3)),
             ("qkv must be", dict(qkv=inputs["qkv"][:, :-2])),
             ("cos and sin must be", dict(cos=inputs["cos"][:, :8])),
             ("positions \\[C\\], slot \\[1\\] and visible", dict(visible=inputs["visible"][:, :10]))]
    for msg, change in cases:
        args = dict(inputs, n_head=2)
        args.update(change)
        with pytest.raises(ValueError, match=msg):
            ring_decode_attention_reference(**args)
    odd = _inputs(1, 8, 1, 1, 15, torch.float32, 1, 9)
    odd.update(cos=odd["cos"][:, :15], sin=odd["sin"][:, :15])
    with pytest.raises(ValueError, match="even head size"):
        ring_decode_attention_reference(**odd, n_head=1)
    with pytest.raises(ValueError, match="contiguous"):
        ring_decode_attention_triton(**dict(inputs, qkv=inputs["qkv"].t().contiguous().t()), n_head=2)
