"""TrainLoader / ValLoader: sample cut, determinism, exact resume, rank sharding, mixing, cu_seqlens."""

import numpy as np
import pytest
import torch

from gdn2.data.loader import TrainLoader, ValLoader, document_cu_seqlens
from gdn2.data.shards import write_shard

BLOCK = 16


def _write_stream(directory, tokens, shard_tokens, prefix="train", dtype=np.uint16):
    directory.mkdir(parents=True, exist_ok=True)
    for i, start in enumerate(range(0, len(tokens), shard_tokens)):
        write_shard(directory / f"{prefix}_{i:010d}.bin", np.asarray(tokens[start:start + shard_tokens], dtype=dtype))
    return directory


@pytest.fixture
def counting_source(tmp_path):
    """Tokens 0..N-1 (all distinct), in uneven shards of 37 tokens so samples cross shard ends."""
    tokens = np.arange(50 * BLOCK + 5)
    return _write_stream(tmp_path / "count", tokens, shard_tokens=37), tokens


def _take(loader, n):
    it = iter(loader)
    return [next(it) for _ in range(n)]


def _same(a, b):
    assert a.keys() == b.keys()
    for key in a:
        assert a[key].dtype == b[key].dtype
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=0)


def test_batches_are_shifted_windows_of_the_stream(counting_source):
    directory, tokens = counting_source
    batches = _take(TrainLoader([(directory, 1.0)], BLOCK, micro_batch_size=4), 5)
    for batch in batches:
        x, y = batch["input_ids"], batch["labels"]
        assert x.shape == y.shape == (4, BLOCK) and x.dtype == y.dtype == torch.int64
        assert "cu_seqlens" not in batch
        for row_x, row_y in zip(x.tolist(), y.tolist()):
            start = row_x[0]
            assert start % BLOCK == 0  # samples start at multiples of block_size (shared boundary token)
            assert row_x == tokens[start:start + BLOCK].tolist()
            assert row_y == tokens[start + 1:start + BLOCK + 1].tolist()


def test_same_seed_same_batches_other_seed_other_batches(counting_source):
    directory, _ = counting_source
    a = _take(TrainLoader([(directory, 1.0)], BLOCK, 4, seed=1), 6)
    b = _take(TrainLoader([(directory, 1.0)], BLOCK, 4, seed=1), 6)
    c = _take(TrainLoader([(directory, 1.0)], BLOCK, 4, seed=2), 6)
    for x, y in zip(a, b):
        _same(x, y)
    assert any(not torch.equal(x["input_ids"], z["input_ids"]) for x, z in zip(a, c))


@pytest.mark.parametrize("world_size, micro", [(1, 4), (3, 2)])
def test_every_sample_once_per_epoch_across_ranks(counting_source, world_size, micro):
    directory, tokens = counting_source
    n = (len(tokens) - 1) // BLOCK
    rounds = -(-2 * n // (world_size * micro))  # two epochs and a bit
    per_rank = [_take(TrainLoader([(directory, 1.0)], BLOCK, micro, rank=r, world_size=world_size), rounds)
                for r in range(world_size)]
    # Global order: micro-batch t of rank 0, of rank 1, ..., then t+1.
    order = [int(row[0]) // BLOCK for t in range(rounds) for r in range(world_size)
             for row in per_rank[r][t]["input_ids"]]
    assert sorted(order[:n]) == list(range(n))
    assert sorted(order[n:2 * n]) == list(range(n))
    assert order[:n] != order[n:2 * n]  # a fresh shuffle every epoch


@pytest.mark.parametrize("workers_after", [0, 2])
def test_exact_resume_including_other_num_workers(tmp_path, workers_after):
    rng = np.random.default_rng(0)
    a = _write_stream(tmp_path / "a", rng.integers(0, 50, 3000), shard_tokens=500)
    b = _write_stream(tmp_path / "b", rng.integers(0, 50, 900), shard_tokens=250)
    sources = [(a, 2.0), (str(b / "train_*.bin"), 1.0)]
    kwargs = dict(block_size=BLOCK, micro_batch_size=3, seed=7, rank=1, world_size=2, document_masking=True)
    reference = _take(TrainLoader(sources, **kwargs), 40)

    first = TrainLoader(sources, num_workers=1, **kwargs)
    head = _take(first, 17)
    state = first.state_dict()
    assert state["batches_consumed"] == 17
    resumed = TrainLoader(sources, num_workers=workers_after, **kwargs)
    resumed.load_state_dict(state)
    tail = _take(resumed, 23)
    for x, y in zip(head + tail, reference):
        _same(x, y)
    assert resumed.state_dict()["batches_consumed"] == 40


def test_load_state_dict_rejects_a_different_setup(counting_source, tmp_path):
    directory, _ = counting_source
    loader = TrainLoader([(directory, 1.0)], BLOCK, 4, world_size=2)
    _take(loader, 2)
    state = loader.state_dict()
    TrainLoader([(directory, 1.0)], BLOCK, 4, rank=1, world_size=2).load_state_dict(state)  # any rank
    with pytest.raises(ValueError, match="block_size"):
        TrainLoader([(directory, 1.0)], BLOCK * 2, 4, world_size=2).load_state_dict(state)
    with pytest.raises(ValueError, match="do not divide"):  # 16 samples consumed, rounds of 3 x 2
        TrainLoader([(directory, 1.0)], BLOCK, 2, world_size=3).load_state_dict(state)
    with pytest.raises(ValueError, match="sources"):
        TrainLoader([(directory, 1.0), (directory, 1.0)], BLOCK, 4, world_size=2).load_state_dict(state)
    with pytest.raises(ValueError, match="seed"):
        TrainLoader([(directory, 1.0)], BLOCK, 4, seed=1, world_size=2).load_state_dict(state)
    with pytest.raises(ValueError, match="format"):
        loader.load_state_dict({"batches_consumed": 3})


def test_resume_on_another_world_size_continues_the_global_sample_order(counting_source):
    """2 ranks x 4 -> 1 rank x 4 and 4 ranks x 2: the same samples in the same order, none repeated or skipped."""
    directory, _ = counting_source

    def rounds(world, micro, k, state=None):
        loaders = [TrainLoader([(directory, 1.0)], BLOCK, micro, rank=r, world_size=world) for r in range(world)]
        for loader in loaders:
            if state is not None:
                loader.load_state_dict(state)
        batches = [_take(loader, k) for loader in loaders]
        order = [int(row[0]) for t in range(k) for r in range(world) for row in batches[r][t]["input_ids"]]
        return order, loaders[0].state_dict()

    whole, _ = rounds(1, 8, 6)
    first, state = rounds(2, 4, 2)
    for world, micro in ((1, 4), (4, 2)):
        rest, _ = rounds(world, micro, 32 // (world * micro), state)
        assert first + rest == whole[:48]


def test_token_ids_outside_the_vocabulary_name_the_shard(counting_source):
    directory, _ = counting_source
    loader = TrainLoader([(directory, 1.0)], BLOCK, 4, vocab_size=10)
    with pytest.raises(ValueError, match=r"train_\d+\.bin: token id \d+ .* vocabulary of 10"):
        _take(loader, 1)


def test_mixing_weights_are_respected(tmp_path):
    a = _write_stream(tmp_path / "a", np.full(200 * BLOCK + 1, 1), shard_tokens=10_000)
    b = _write_stream(tmp_path / "b", np.full(30 * BLOCK + 1, 2), shard_tokens=10_000)
    c = _write_stream(tmp_path / "c", np.full(30 * BLOCK + 1, 3), shard_tokens=10_000)
    loader = TrainLoader([(a, 6.0), (b, 3.0), (c, 1.0)], BLOCK, micro_batch_size=10)
    firsts = torch.cat([batch["input_ids"][:, 0] for batch in _take(loader, 300)])
    fractions = [(firsts == s).float().mean().item() for s in (1, 2, 3)]
    assert fractions == pytest.approx([0.6, 0.3, 0.1], abs=0.03)


def test_cu_seqlens_on_a_hand_made_shard(tmp_path):
    eos = 2
    # Documents of lengths 5, 9, 3, 20 (EOS included) then filler.
    tokens = []
    for length in (5, 9, 3, 20):
        tokens += [7] * (length - 1) + [eos]
    tokens += [9] * 30
    directory = _write_stream(tmp_path / "v", np.array(tokens), shard_tokens=11, prefix="val")
    loader = ValLoader(directory, block_size=8, micro_batch_size=2, num_batches=1, document_masking=True, eos_id=eos)
    (batch,) = list(loader)
    # Row 0 = tokens[0:8]  (EOS at 4)      -> boundary 5
    # Row 1 = tokens[8:16] (EOS at 13, 16) -> boundary 8 + 13 - 8 + 1 = 14; 16's EOS is the label only
    assert batch["input_ids"][0].tolist() == tokens[0:8]
    assert batch["cu_seqlens"].dtype == torch.int32
    assert batch["cu_seqlens"].tolist() == [0, 5, 8, 14, 16]
    # EOS in the last input column: its boundary coincides with the next sample start, not duplicated.
    x = np.array([[1, 1, 1, eos], [eos, 1, eos, 1]])
    assert document_cu_seqlens(x, eos).tolist() == [0, 4, 5, 7, 8]


def test_train_cu_seqlens_property(tmp_path):
    rng = np.random.default_rng(3)
    tokens = rng.integers(0, 6, 5000)  # EOS (2) about every 6 tokens
    directory = _write_stream(tmp_path / "t", tokens, shard_tokens=999)
    for batch in _take(TrainLoader([(directory, 1.0)], BLOCK, 4, document_masking=True), 5):
        cu = batch["cu_seqlens"].tolist()
        flat = batch["input_ids"].reshape(-1)
        expected = sorted({0, 4 * BLOCK} | set(range(0, 4 * BLOCK, BLOCK))
                          | {int(i) + 1 for i in torch.nonzero(flat == 2).flatten()})
        assert cu == expected


def test_val_loader_is_sequential_finite_disjoint_and_reiterable(tmp_path):
    tokens = np.arange(20 * BLOCK + 1)
    directory = _write_stream(tmp_path / "v", tokens, shard_tokens=100, prefix="val")
    loaders = [ValLoader(directory, BLOCK, 2, num_batches=3, rank=r, world_size=2) for r in range(2)]
    assert [len(v) for v in loaders] == [3, 3]
    starts = {r: [int(row[0]) // BLOCK for b in v for row in b["input_ids"]] for r, v in enumerate(loaders)}
    assert starts == {0: [0, 1, 4, 5, 8, 9], 1: [2, 3, 6, 7, 10, 11]}
    again = [int(row[0]) // BLOCK for b in loaders[0] for row in b["input_ids"]]
    assert again == starts[0]
    # Fewer samples than asked for: fewer batches (20 samples, 2 ranks x 3 rows -> 3 rounds).
    assert len(ValLoader(directory, BLOCK, 3, num_batches=100, world_size=2)) == 3
    # Not even one full round: one smaller batch per rank.
    small = ValLoader(directory, BLOCK, 16, num_batches=5, rank=1, world_size=2)
    (batch,) = list(small)
    assert batch["input_ids"].shape == (10, BLOCK) and int(batch["input_ids"][0, 0]) == 10 * BLOCK


def test_too_short_sources_are_clear_errors(tmp_path):
    directory = _write_stream(tmp_path / "tiny", np.arange(BLOCK), shard_tokens=100, prefix="val")
    with pytest.raises(ValueError, match="tiny"):
        ValLoader(directory, BLOCK, 2, num_batches=1)
    _write_stream(tmp_path / "tiny", np.arange(BLOCK), shard_tokens=100, prefix="train")
    with pytest.raises(ValueError, match="tiny"):
        TrainLoader([(directory, 1.0)], BLOCK, 2)
    with pytest.raises(FileNotFoundError, match="missing"):
        TrainLoader([(tmp_path / "missing", 1.0)], BLOCK, 2)
    with pytest.raises(ValueError, match="weight"):
        TrainLoader([(directory, 0.0)], 4, 2)
    with pytest.raises(ValueError, match="rank"):
        TrainLoader([(directory, 1.0)], 4, 2, rank=2, world_size=2)
    with pytest.raises(ValueError, match="block_size"):
        TrainLoader([(directory, 1.0)], 4.0, 2)
    with pytest.raises(ValueError, match="seed"):
        TrainLoader([(directory, 1.0)], 4, 2, seed=-1)
    assert TrainLoader([(directory, 1.0)], np.int64(4), np.int32(2)).block_size == 4  # YAML / numpy ints
