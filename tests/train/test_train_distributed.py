"""Two data-parallel processes on CPU (DDP over gloo, started by Fabric from the CLI): same losses as
one process with the same global batch, per-rank checkpoint files, and exact resume across ranks."""

import pytest

from gdn2.train.checkpoint import list_checkpoints
from gdn2.train.loop import fit
from gdn2.train.metrics import read_jsonl
from gdn2.train.recipe import load_recipe
from train_helpers import micro_config, run_main


def test_two_ranks_match_one_rank_and_resume(corpus, tmp_path):
    # global batch 4: one rank does 2 micro-batches of 2; two ranks do 2 micro-batches of 1 each.
    # The loader hands out global samples in the same order, so each optimizer step sees the same 4.
    cfg = micro_config(corpus, tmp_path, train=dict(max_steps=4, warmup_steps=1))
    single = fit(load_recipe(str(cfg), out_dir=str(tmp_path / "one")))
    assert single.step == 4
    two = ["--config", str(cfg), "--out_dir", str(tmp_path / "two"), "--distributed.devices", "2",
           "--distributed.accelerator", "cpu", "--train.micro_batch_size", "1"]
    first = run_main(two + ["--train.stop_at_step", "2"])
    assert first.returncode == 0, first.stderr[-3000:]
    ckpt = list_checkpoints(tmp_path / "two" / "checkpoints")[-1][1]
    assert sorted(p.name for p in (ckpt / "ranks").iterdir()) == ["rank-00000.pt", "rank-00001.pt"]
    second = run_main(two + ["--resume", "auto"])
    assert second.returncode == 0, second.stderr[-3000:]

    def losses(folder):
        return {r["step"]: r["loss"] for r in read_jsonl(folder / "metrics.jsonl") if r["kind"] == "train"}

    one, dp = losses(tmp_path / "one"), losses(tmp_path / "two")
    assert sorted(dp) == [1, 2, 3, 4]
    for step in range(1, 5):
        assert dp[step] == pytest.approx(one[step], rel=1e-5), step
