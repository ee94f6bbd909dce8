"""The ring-buffer decode attention kernel against its plain torch oracle (Triton's interpreter on the
CPU, fp32 and fp16), and the model's decode step on the kernel against the full forward pass."""

import pytest
import torch

from gdn2.ops.decode_attention import (ring_decode_attention_reference, ring_decode_attention_triton,
                                       split_count)

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


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("B,C,H,Hkv,D,slot,column,splits", CASES)
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


@pytest.mark.parametrize("name,kw", [("swa_gdn2_tiny", dict(sliding_window=6, gdn2_recurrent_max_len=4)),
                                     ("transformer_tiny", dict(n_query_groups=2))])
def test_decode_on_the_kernel_equals_the_full_forward(monkeypatch, name, kw):
    """The model's decode steps (fused and not) with the attention layers on the kernel, fp32,
    ragged prompts, a window that wraps the ring: the logits of the full forward pass."""
    from gdn2.config import Config
    from gdn2.inference import DecodeWeights, InferenceCache, decode_step, prefill
    from gdn2.model import GPT

    monkeypatch.setenv("GDN2_BACKEND", "triton")
    torch.manual_seed(0)
    model = GPT(Config.from_name(name, vocab_size=128, n_layer=2, **kw)).to(DEVICE).eval()
    lengths, steps = [5, 9, 1], 7
    seqs = [torch.randint(0, 128, (n + steps,), device=DEVICE) for n in lengths]
    with torch.no_grad():
        full = [model(s[None])[0] for s in seqs]
        for weights in (None, DecodeWeights(model)):
            cache = InferenceCache(model, len(seqs), max_length=32)
            logits = prefill(model, [s[:n] for s, n in zip(seqs, lengths)], cache)
            for j in range(steps + 1):
                for r, n in enumerate(lengths):
                    torch.testing.assert_close(logits[r], full[r][n - 1 + j], atol=1e-4, rtol=1e-4)
                if j < steps:
                    tokens = torch.stack([s[n + j] for s, n in zip(seqs, lengths)])
                    logits = decode_step(model, tokens, cache, weights)
