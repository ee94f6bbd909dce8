"""Two data-parallel processes on CPU (DDP over gloo, started by Fabric from the CLI): same losses as
one process with the same global batch, per-rank checkpoint files, and exact resume across ranks."""

import pytest

from gdn2.checkpoint import list_checkpoints
from gdn2.train.loop import fit
from gdn2.train.metrics import read_jsonl
from gdn2.train.recipe import load_recipe
from train_helpers import micro_config, run_main


def losses(folder):
    return {r["step"]: r["loss"] for r in read_jsonl(folder / "metrics.jsonl") if r["kind"] == "train"}


@pytest.fixture(scope="module")
def one_rank(corpus, tmp_path_factory):
    """(config, losses) of an uninterrupted one-process run of 4 steps of 4 sequences."""
    tmp = tmp_path_factory.mktemp("one_rank")
    cfg = micro_config(corpus, tmp, train=dict(max_steps=4, warmup_steps=1))
    assert fit(load_recipe(str(cfg), out_dir=str(tmp / "one"))).step == 4
    return cfg, losses(tmp / "one")


def test_two_ranks_match_one_rank_and_resume(one_rank, tmp_path):
    # global batch 4: one rank does 2 micro-batches of 2; two ranks do 2 micro-batches of 1 each.
    # The loader hands out global samples in the same order, so each optimizer step sees the same 4.
    cfg, one = one_rank
    two = ["--config", str(cfg), "--out_dir", str(tmp_path / "two"), "--distributed.devices", "2",
           "--distributed.accelerator", "cpu", "--train.micro_batch_size", "1"]
    first = run_main(two + ["--train.stop_at_step", "2"])
    assert first.returncode == 0, first.stderr[-3000:]
    ckpt = list_checkpoints(tmp_path / "two" / "checkpoints")[-1][1]
    assert sorted(p.name for p in (ckpt / "ranks").iterdir()) == ["rank-00000.pt", "rank-00001.pt"]
    second = run_main(two + ["--resume", "auto"])
    assert second.returncode == 0, second.stderr[-3000:]
    dp = losses(tmp_path / "two")
    assert sorted(dp) == [1, 2, 3, 4]
    for step in range(1, 5):
        assert dp[step] == pytest.approx(one[step], rel=1e-5), step


@pytest.mark.parametrize("before, after", [(2, 1), (1, 2)])
def test_resume_onto_another_number_of_ranks(one_rank, tmp_path, before, after):
    """A job that comes back with fewer (or more) processes: model and optimizer load, the data continue at
    the same global sample, and the losses are those of an uninterrupted run."""
    cfg, one = one_rank

    def ranks(n):  # global batch 4 = n ranks x micro-batch 2 // n x 2 accumulation steps
        return ["--distributed.devices", str(n), "--distributed.accelerator", "cpu", "--train.micro_batch_size",
                str(2 // n)]

    run = ["--config", str(cfg), "--out_dir", str(tmp_path / "moved")]
    first = run_main(run + ranks(before) + ["--train.stop_at_step", "2"])
    assert first.returncode == 0, first.stderr[-3000:]
    second = run_main(run + ranks(after) + ["--resume", "auto"])
    assert second.returncode == 0, second.stderr[-3000:]
    assert f"written by {before}" in second.stdout + second.stderr
    moved = losses(tmp_path / "moved")
    assert sorted(moved) == [1, 2, 3, 4]
    for step in range(1, 5):
        assert moved[step] == pytest.approx(one[step], rel=1e-5), step
