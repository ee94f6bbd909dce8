"""scripts/pretrain_1.3B.sh under a real SLURM scheduler (a one-node cluster, .ci/slurm_cluster.sh): the
warning signal (USR1, which SLURM sends before the time limit) saves and requeues, the requeued job
resumes from that checkpoint with the losses of an uninterrupted run, and ``scancel --signal=INT`` saves
and stops without a requeue. Skipped where no cluster answers.

SLURM delivers the warning through srun to the training task; the test has the controller send it
(``scancel --signal=USR1``) once training runs, because the time-limit warning of a one-minute job can
arrive before the task has started."""

import json
import os
import shutil
import subprocess
import time

import pytest

from gdn2.checkpoint.format import list_checkpoints
from gdn2.train.loop import fit
from gdn2.train.metrics import read_jsonl
from gdn2.train.recipe import load_recipe
from slurm_helpers import job_state, wait_for
from train_helpers import ROOT


def _cluster_idle() -> bool:
    if not shutil.which("sbatch") or not shutil.which("sinfo"):
        return False
    try:
        states = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.TimeoutExpired):
        return False
    return "idle" in states


pytestmark = [pytest.mark.slow, pytest.mark.skipif(not _cluster_idle(), reason="no idle SLURM cluster")]


def _train_steps(run) -> list[int]:
    try:
        return [r["step"] for r in read_jsonl(run / "metrics.jsonl") if r["kind"] == "train"]
    except (FileNotFoundError, json.JSONDecodeError):
        return []


def test_usr1_requeue_resume_and_scancel_int(corpus, tmp_path):
    run, log = tmp_path / "run", tmp_path / "slurm.out"
    overrides = {"data.train": str(corpus), "data.val": str(corpus), "data.prepare_default": "false",
                 "data.num_workers": "0", "model.block_size": "64", "train.max_steps": "100000",
                 "train.global_batch_size": "2", "train.micro_batch_size": "2", "eval.interval": "0",
                 "eval.at_end": "false", "checkpoint.interval": "0", "logging.interval": "1"}
    args = [a for key, value in overrides.items() for a in (f"--{key}", value)]
    env = dict(os.environ, CONFIG="swa_gdn2_tiny", OUT_DIR=str(run), OMP_NUM_THREADS="1")
    submitted = subprocess.run(
        ["sbatch", "--parsable", "--nodes=1", "--ntasks-per-node=1", "--gres=none", "--cpus-per-task=1", "--time=10",
         f"--output={log}", str(ROOT / "scripts" / "pretrain_1.3B.sh"), *args],
        cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    job = submitted.stdout.strip().split(";")[0]
    try:
        wait_for("training to run", lambda: max(_train_steps(run), default=0) >= 3, 180, log)
        subprocess.run(["scancel", "--signal=USR1", job], check=True)  # the warning before the time limit
        wait_for("the requeue", lambda: "job requeued" in (log.read_text() if log.exists() else ""), 120, log)
        saved = list_checkpoints(run / "checkpoints")
        assert len(saved) == 1
        first_stop = saved[0][0]
        wait_for("the job pending again", lambda: job_state(job) == "PENDING", 60, log)
        wait_for("the node free of the first run", _cluster_idle, 60, log)  # or its restart is refused
        time.sleep(2)
        subprocess.run(["scontrol", "update", f"jobid={job}", "StartTime=now"], check=True)
        wait_for("the resumed job training", lambda: max(_train_steps(run), default=0) >= first_stop + 5, 180, log)
        subprocess.run(["scancel", "--signal=INT", job], check=True)
        wait_for("the job to end", lambda: job_state(job) not in ("RUNNING", "PENDING", "COMPLETING"), 120, log)
    finally:
        subprocess.run(["scancel", job], capture_output=True)
    text = log.read_text()
    assert f"resumed from {run / 'checkpoints' / f'step-{first_stop:09d}'}" in text
    assert "(interrupted)" in text and text.count("job requeued") == 1  # Ctrl-C stops without a requeue
    assert job_state(job).startswith("COMPLETED")
    final = list_checkpoints(run / "checkpoints")[-1][0]
    steps = _train_steps(run)
    assert steps == list(range(1, final + 1))  # every step once: the crashed tail replaced, nothing skipped

    # the same recipe uninterrupted gives the same losses
    recipe = load_recipe("swa_gdn2_tiny", dict(overrides, **{"train.stop_at_step": str(final)}),
                         out_dir=str(tmp_path / "whole"))
    fit(recipe)
    whole = {r["step"]: r["loss"] for r in read_jsonl(tmp_path / "whole" / "metrics.jsonl") if r["kind"] == "train"}
    split = {r["step"]: r["loss"] for r in read_jsonl(run / "metrics.jsonl") if r["kind"] == "train"}
    for step in range(1, final + 1):
        assert split[step] == pytest.approx(whole[step], rel=1e-5), step
