"""Data-parallel processes on CPU (DDP over gloo, started by Fabric from the CLI): the losses of one
process with the same global batch, per-rank checkpoint files, and exact resume onto another number of
ranks (a job that comes back with fewer or more processes)."""

import pytest

from gdn2.checkpoint import list_checkpoints
from gdn2.train.loop import fit
from gdn2.train.metrics import read_jsonl
from gdn2.train.recipe import load_recipe
from train_helpers import micro_config, run_main


def losses(folder):
    return {r["step"]: r["loss"] for r in read_jsonl(folder / "metrics.jsonl") if r["kind"] == "train"}


@pytest.mark.slow
def test_two_ranks_match_one_rank_and_resume_across_world_sizes(corpus, tmp_path):
    # global batch 4: one rank does 2 micro-batches of 2; two ranks do 2 micro-batches of 1 each.
    # The loader hands out global samples in the same order, so each optimizer step sees the same 4.
    cfg = micro_config(corpus, tmp_path, train=dict(max_steps=6, warmup_steps=1))
    assert fit(load_recipe(str(cfg), out_dir=str(tmp_path / "one"))).step == 6
    run, out = ["--config", str(cfg), "--out_dir", str(tmp_path / "moved")], tmp_path / "moved"
    two = ["--distributed.devices", "2", "--distributed.accelerator", "cpu", "--train.micro_batch_size", "1"]

    first = run_main(run + two + ["--train.stop_at_step", "2"])  # steps 1-2 on two ranks
    assert first.returncode == 0, first.stderr[-3000:]
    ckpt = list_checkpoints(out / "checkpoints")[-1][1]
    assert sorted(p.name for p in (ckpt / "ranks").iterdir()) == ["rank-00000.pt", "rank-00001.pt"]
    # steps 3-4 on one rank: the model and optimizer load, the data continue at the same global sample
    recipe = load_recipe(str(cfg), {"train.stop_at_step": "4"}, out_dir=str(out))
    assert fit(recipe, resume="auto").step == 4
    second = run_main(run + two + ["--resume", "auto"])  # steps 5-6 on two ranks again
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resuming on 2 rank(s) a checkpoint written by 1" in second.stdout + second.stderr

    one, moved = losses(tmp_path / "one"), losses(out)
    assert sorted(moved) == [1, 2, 3, 4, 5, 6]
    for step in range(1, 7):
        assert moved[step] == pytest.approx(one[step], rel=1e-5), step
