"""Data-parallel processes on CPU over gloo, started by Fabric from the CLI (DDP, and FSDP2 with full and
hybrid sharding): the losses of one process with the same global batch, per-rank checkpoint files, and
exact resume onto another number of ranks and another strategy (a job that comes back with fewer or
more processes)."""

import pytest

from gdn2.checkpoint.format import list_checkpoints
from gdn2.train.loop import fit
from gdn2.train.metrics import read_jsonl
from gdn2.train.recipe import load_recipe
from train_helpers import micro_config, run_main


def losses(folder):
    return {r["step"]: r["loss"] for r in read_jsonl(folder / "metrics.jsonl") if r["kind"] == "train"}


@pytest.fixture(scope="module")
def one_rank(corpus, tmp_path_factory):
    """The micro config and the train losses of its 6 steps on one process."""
    folder = tmp_path_factory.mktemp("one_rank")
    cfg = micro_config(corpus, folder, train=dict(max_steps=6, warmup_steps=1))
    assert fit(load_recipe(str(cfg), out_dir=str(folder / "one"))).step == 6
    return cfg, losses(folder / "one")


@pytest.mark.slow
def test_two_ranks_match_one_rank_and_resume_on_one(one_rank, tmp_path):
    # global batch 4: one rank does 2 micro-batches of 2; two ranks do 2 micro-batches of 1 each.
    # The loader hands out global samples in the same order, so each optimizer step sees the same 4.
    cfg, one = one_rank
    run, out = ["--config", str(cfg), "--out_dir", str(tmp_path / "moved")], tmp_path / "moved"
    two = ["--distributed.devices", "2", "--distributed.accelerator", "cpu", "--train.micro_batch_size", "1"]

    first = run_main(run + two + ["--train.stop_at_step", "2"])  # steps 1-2 on two ranks
    assert first.returncode == 0, first.stderr[-3000:]
    ckpt = list_checkpoints(out / "checkpoints")[-1][1]
    assert sorted(p.name for p in (ckpt / "ranks").iterdir()) == ["rank-00000.pt", "rank-00001.pt"]
    # steps 3-6 on one rank: the model and optimizer load, the data continue at the same global sample
    assert fit(load_recipe(str(cfg), out_dir=str(out)), resume="auto").step == 6
    moved = losses(out)
    assert sorted(moved) == [1, 2, 3, 4, 5, 6]
    for step in range(1, 7):
        assert moved[step] == pytest.approx(one[step], rel=1e-5), step


@pytest.mark.slow
def test_fsdp2_hybrid_sharding_matches_one_rank_and_reshards(one_rank, tmp_path):
    """Steps 1-2 on one rank, 3-4 on 4 ranks as 2 replica groups of 2 shards (the 2-D mesh hybrid
    sharding uses across nodes; with ``train.recompute``, which changes no value), 5-6 on one rank again:
    every step's loss is the one-rank run's, the checkpoint resharded at each change (1 -> 4 -> 1)."""
    cfg, one = one_rank
    out = tmp_path / "moved"
    assert fit(load_recipe(str(cfg), {"train.stop_at_step": "2"}, out_dir=str(out))).step == 2
    run = run_main(["--config", str(cfg), "--out_dir", str(out), "--resume", "auto", "--distributed.strategy", "fsdp2",
                    "--distributed.accelerator", "cpu", "--train.micro_batch_size", "1", "--distributed.devices", "4",
                    "--distributed.sharding", "hybrid", "--distributed.replicas", "2", "--train.stop_at_step", "4",
                    "--train.recompute", "true"])
    assert run.returncode == 0, run.stderr[-3000:]
    log = run.stdout + run.stderr
    assert "4 rank(s) on cpu (ModelParallelStrategy" in log and "resuming on 4 rank(s) a checkpoint written by 1" in log
    ckpt = list_checkpoints(out / "checkpoints")[-1][1]
    assert len(list((ckpt / "state").glob("*.distcp"))) == 4  # each rank wrote its shards
    assert fit(load_recipe(str(cfg), out_dir=str(out)), resume="auto").step == 6
    moved = losses(out)
    assert sorted(moved) == [1, 2, 3, 4, 5, 6]
    for step in range(1, 7):
        assert moved[step] == pytest.approx(one[step], rel=1e-5), step
