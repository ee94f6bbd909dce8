"""scripts/pretrain_1.3B.sh, unchanged, as a two-node job of a real SLURM cluster (.ci/slurm_cluster.sh: two
slurmd on this machine, each in its own UTS namespace, so each node has its own host name): four CPU ranks,
two per node, FSDP2 with hybrid sharding across the nodes over gloo.

- The warning signal (USR1) saves and requeues; the requeued two-node job resumes with the losses of an
  uninterrupted one-process run.
- One training process killed (``kill -9``): the job ends within seconds, its log holds the one line that
  names the rank, its pid and node and the checkpoint ``--resume auto`` will take, and no traceback.
- That two-node checkpoint resumes on one node (one process): the next steps' losses are the
  uninterrupted run's.

The node names (node1, node2) do not resolve on this machine, so the job is told to rendezvous on
127.0.0.1 (MASTER_ADDR) and gloo to bind to loopback. Skipped where no two idle nodes answer."""

import json
import os
import shutil
import signal
import subprocess
import time

import pytest

from gdn2.checkpoint.format import list_checkpoints
from gdn2.train.loop import fit
from gdn2.train.metrics import read_jsonl
from gdn2.train.recipe import load_recipe
from slurm_helpers import job_state, wait_for
from train_helpers import ROOT


def _idle_nodes() -> int:
    if not shutil.which("sbatch") or not shutil.which("sinfo"):
        return 0
    try:
        out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %T"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return len({line.split()[0] for line in out.splitlines() if line.endswith(" idle")})


pytestmark = [pytest.mark.slow, pytest.mark.skipif(_idle_nodes() < 2, reason="no two idle SLURM nodes")]


def _losses(run) -> dict[int, float]:
    try:
        return {r["step"]: r["loss"] for r in read_jsonl(run / "metrics.jsonl") if r["kind"] == "train"}
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def _ranks(job: str) -> dict[int, int]:
    """SLURM task rank -> pid of the job's training processes (they run on this machine)."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmdline = open(f"/proc/{entry}/cmdline", "rb").read().split(b"\0")
            env = dict(v.split(b"=", 1) for v in open(f"/proc/{entry}/environ", "rb").read().split(b"\0") if b"=" in v)
        except OSError:
            continue
        if env.get(b"SLURM_JOB_ID") == job.encode() and any(a.endswith(b"pretrain/main.py") for a in cmdline) \
                and b"SLURM_PROCID" in env and b"SLURM_STEP_ID" in env:
            found[int(env[b"SLURM_PROCID"])] = int(entry)
    return found


def test_two_node_job_requeues_resumes_ends_on_a_killed_rank_and_resumes_on_one_node(corpus, tmp_path):
    run, log = tmp_path / "run", tmp_path / "slurm.out"
    overrides = {"data.train": str(corpus), "data.val": str(corpus), "data.prepare_default": "false",
                 "data.num_workers": "0", "model.block_size": "64", "train.max_steps": "100000",
                 "train.global_batch_size": "4", "train.micro_batch_size": "1", "eval.interval": "0",
                 "eval.at_end": "false", "checkpoint.interval": "0", "logging.interval": "1"}
    cpu = {"distributed.accelerator": "cpu", "distributed.strategy": "fsdp2", "distributed.sharding": "hybrid",
           "distributed.timeout_seconds": "60"}
    args = [a for key, value in {**overrides, **cpu}.items() for a in (f"--{key}", value)]
    env = dict(os.environ, CONFIG="swa_gdn2_tiny", OUT_DIR=str(run), OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1",
               GLOO_SOCKET_IFNAME="lo")
    submitted = subprocess.run(
        ["sbatch", "--parsable", "--nodes=2", "--ntasks-per-node=2", "--time=20", f"--output={log}",
         str(ROOT / "scripts" / "pretrain_1.3B.sh"), *args],
        cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    job = submitted.stdout.strip().split(";")[0]
    try:
        # 1. the warning signal: save, requeue, and the requeued job resumes on the two nodes
        wait_for("training to run", lambda: max(_losses(run), default=0) >= 3, 300, log)
        subprocess.run(["scancel", "--signal=USR1", job], check=True)
        wait_for("the requeue", lambda: "job requeued" in (log.read_text() if log.exists() else ""), 180, log)
        (saved,) = list_checkpoints(run / "checkpoints")
        first_stop = saved[0]
        wait_for("the job pending again", lambda: job_state(job) == "PENDING", 120, log)
        wait_for("both nodes free of the first run", lambda: _idle_nodes() == 2, 120, log)
        time.sleep(2)
        subprocess.run(["scontrol", "update", f"jobid={job}", "StartTime=now"], check=True)
        wait_for("the resumed job training", lambda: max(_losses(run), default=0) >= first_stop + 3, 300, log)

        # 2. one training process killed: the job ends within seconds, with one line
        ranks = _ranks(job)
        assert sorted(ranks) == [0, 1, 2, 3], ranks
        killed = time.monotonic()
        os.kill(ranks[3], signal.SIGKILL)
        wait_for("the job to end", lambda: job_state(job) not in ("RUNNING", "CONFIGURING"), 120, log)
        wait_for("every rank gone", lambda: not _ranks(job), 60, log)
        took = time.monotonic() - killed
    finally:
        subprocess.run(["scancel", job], capture_output=True)
    text = log.read_text()
    assert took < 45, (took, text[-3000:])
    assert f"resumed from {saved[1]}" in text and text.count("job requeued") == 1
    assert "4 rank(s) on cpu (ModelParallelStrategy" in text
    assert "Traceback" not in text and "Exception raised from" not in text, text[-4000:]
    ours = [line for line in text.splitlines() if "gdn2 pretrain: error:" in line]
    assert len(ours) == 1, text[-4000:]
    assert ours[0].startswith(f"gdn2 pretrain: error: rank 3 (pid {ranks[3]} on node2) ")
    assert ours[0].endswith(f"--resume auto will continue from {saved[1]}")
    two_nodes = _losses(run)
    last = max(two_nodes)
    assert sorted(two_nodes) == list(range(1, last + 1))  # every step once: the requeue repeated none

    # the same recipe uninterrupted, on one process
    whole_dir = tmp_path / "whole"
    fit(load_recipe("swa_gdn2_tiny", dict(overrides, **{"train.stop_at_step": str(last + 2)}), out_dir=str(whole_dir)))
    whole = _losses(whole_dir)
    for step in range(1, last + 1):
        assert two_nodes[step] == pytest.approx(whole[step], rel=1e-5), step

    # 3. the two-node checkpoint resumes on one node (one process): the next steps are the uninterrupted run's
    resumed = fit(load_recipe("swa_gdn2_tiny", dict(overrides, **{"train.stop_at_step": str(first_stop + 2)}),
                              out_dir=str(run)), resume="auto")
    assert resumed.step == first_stop + 2
    one_node = _losses(run)
    assert sorted(one_node) == list(range(1, first_stop + 3))
    for step in (first_stop + 1, first_stop + 2):
        assert one_node[step] == pytest.approx(whole[step], rel=1e-5), step
